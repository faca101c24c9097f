"""Column positions of STEP_SCHEMA inside the tracer's preallocated int64 row buffers.

Every field is stored as int64 while recording (-1 = not measured, except ``gc_max_gen`` where -1
means "no collection"); the flusher converts to the schema's Arrow types and nulls.
"""

from __future__ import annotations

from hyperacc.schema import PHASES, STEP_COLUMNS

COL: dict[str, int] = {name: i for i, name in enumerate(STEP_COLUMNS)}
NCOLS = len(STEP_COLUMNS)
PHASE_COL: dict[str, int] = {p: COL[f"{p}_ns"] for p in PHASES if p != "other"}
MEASURED_PHASES: tuple[int, ...] = tuple(PHASE_COL.values())  # "other" is the rest of the step

RANK, NODE, STEP, T_START = COL["rank"], COL["node"], COL["step"], COL["t_start_ns"]
STEP_NS, SELF_NS, OTHER_NS = COL["step_ns"], COL["self_ns"], COL["other_ns"]
DATA_NS, H2D_NS, FORWARD_NS, BACKWARD_NS = COL["data_ns"], COL["h2d_ns"], COL["forward_ns"], COL["backward_ns"]
COMM_WAIT_NS, OPTIMIZER_NS = COL["comm_wait_ns"], COL["optimizer_ns"]
LAUNCH_NS, MIN_WAIT_RANK = COL["launch_ns"], COL["min_wait_rank"]
PACE_ON, PACE_DELAY_NS, SPREAD_NS = COL["pace_on"], COL["pace_delay_ns"], COL["spread_ns"]
CPU_NS, MICRO_STEPS, COLLECTIVES, DATA_GAP = COL["cpu_ns"], COL["micro_steps"], COL["collectives"], COL["data_gap"]
DATA_OWN = COL["data_own"]
DEV_STEP_NS, DEV_SELF_NS, DEV_COMM_WAIT_NS = COL["dev_step_ns"], COL["dev_self_ns"], COL["dev_comm_wait_ns"]
DEV_FORWARD_NS, DEV_BACKWARD_NS = COL["dev_forward_ns"], COL["dev_backward_ns"]
