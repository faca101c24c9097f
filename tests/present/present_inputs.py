"""Inputs the presentation tests share: paths of the real Kineto fixtures, traces derived from them."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KINETO_FIXTURES = REPO / "tests" / "fixtures" / "kineto"
NCCL_TRACE = KINETO_FIXTURES / "nccl_2rank_rank0.json.gz"
SINGLE_TRACE = KINETO_FIXTURES / "single_rank0.json.gz"


def trace_text(path: Path = NCCL_TRACE) -> str:
    with gzip.open(path, "rt") as f:
        return f.read()


_DIST_INFO = re.compile(r'"rank": \d+, "world_size": \d+')
_LAUNCH_DUR = re.compile(r'("name": "cudaLaunchKernel",[^\n]*\n\s*"ts": [0-9.]+, "dur": )([0-9.]+)')


def write_rank_trace(text: str, path: Path, rank: int, world: int, launch_factor: float = 1.0) -> Path:
    """A real trace (its text, as Kineto wrote it) as another rank would have written it: its own
    distributedInfo and optionally every kernel launch ``launch_factor`` times slower (the seed's
    slow-launch node). Edits the text, so the file keeps Kineto's own layout."""
    out, n = _DIST_INFO.subn(f'"rank": {rank}, "world_size": {world}', text, count=1)
    assert n == 1, "no distributedInfo in the trace"
    if launch_factor != 1.0:
        out, n = _LAUNCH_DUR.subn(lambda m: f"{m.group(1)}{float(m.group(2)) * launch_factor:.3f}", out)
        assert n > 0
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", **({"compresslevel": 1} if path.name.endswith(".gz") else {})) as f:
        f.write(out)
    return path


def synthetic_run(
    run_dir: Path | None,
    *,
    ranks: int = 6,
    steps: int = 400,
    ranks_per_node: int = 2,
    straggler: int | None = None,
    slowdown: float = 1.3,
    gc_spikes: dict[int, list[int]] | None = None,
    spike_ms: float = 60.0,
    seed: int = 0,
    segment_steps: int = 50,
):
    """Step records of a synchronous run built from a model (not a measurement): every rank's self-time
    ~ N(20 ms, 0.4 ms); ``straggler`` works ``slowdown`` x longer; ``gc_spikes[rank]`` lists steps with
    a ``spike_ms`` GC pause; the step ends when the slowest rank arrives, so the others wait.

    Returns the table (STEP_SCHEMA) and, when ``run_dir`` is given, writes it there as segments of
    ``segment_steps`` steps, with metadata.
    """
    import numpy as np
    import pyarrow as pa

    from hyperacc.schema import STEP_SCHEMA, RankMeta
    from hyperacc.store import step_writer, write_meta

    rng = np.random.default_rng(seed)
    gc_spikes = gc_spikes or {}
    work = rng.normal(20e6, 0.4e6, size=(ranks, steps))
    if straggler is not None:
        work[straggler] *= slowdown
    gc = np.zeros((ranks, steps))
    for r, ss in gc_spikes.items():
        gc[r, ss] = spike_ms * 1e6
    self_ns = work + gc
    arrive = self_ns.max(axis=0)
    comm = arrive[None, :] - self_ns + 1e6  # wait for the last rank plus 1 ms of transfer
    step_ns = self_ns + comm
    t0 = 1_700_000_000_000_000_000
    starts = t0 + np.concatenate([[0], np.cumsum(step_ns[0])[:-1]])
    fwd, bwd = 0.3 * work, 0.6 * work
    opt = work - fwd - bwd
    culprit = np.argmax(self_ns, axis=0)
    tables = []
    for r in range(ranks):
        cols = {
            "rank": np.full(steps, r, dtype=np.int32),
            "node": np.full(steps, r // ranks_per_node, dtype=np.int32),
            "step": np.arange(steps, dtype=np.int64),
            "t_start_ns": starts.astype(np.int64),
            "step_ns": step_ns[r].astype(np.int64),
            "self_ns": self_ns[r].astype(np.int64),
            "data_ns": np.zeros(steps, dtype=np.int64),
            "forward_ns": fwd[r].astype(np.int64),
            "backward_ns": (bwd[r] + gc[r]).astype(np.int64),
            "comm_wait_ns": comm[r].astype(np.int64),
            "optimizer_ns": opt[r].astype(np.int64),
            "other_ns": np.zeros(steps, dtype=np.int64),
            "gc_ns": gc[r].astype(np.int64),
            "gc_count": (gc[r] > 0).astype(np.int32),
            "gc_max_gen": np.where(gc[r] > 0, 2, -1).astype(np.int8),
            "min_wait_rank": np.concatenate([[culprit[0]], culprit[:-1]]).astype(np.int32),
        }
        n = steps
        table = pa.table({f.name: cols[f.name] if f.name in cols else pa.nulls(n, f.type) for f in STEP_SCHEMA},
                         schema=STEP_SCHEMA)  # fmt: skip
        tables.append(table)
        if run_dir is not None:
            w = step_writer(run_dir, r)
            for a in range(0, steps, segment_steps):
                w.write(table.slice(a, segment_steps))
            write_meta(run_dir, RankMeta(rank=r, local_rank=r % ranks_per_node, node=r // ranks_per_node,
                                         world_size=ranks, local_world_size=ranks_per_node, hostname=f"host{r // ranks_per_node}",
                                         pid=1000 + r, source="simulator"))  # fmt: skip
    return pa.concat_tables(tables)
