"""What-if simulator of bulk-synchronous data-parallel training at 4 to 4096 ranks (docs/pacing.md).

``simulate``/``sweep`` run the model of ``hyperacc.sim.model`` with and without pacing (the real
``PacingController``); ``MeasuredRun`` drives it from a traced run directory instead.
"""

from hyperacc.sim.model import (
    ComputeModel,
    EarlyArrivalCost,
    FabricModel,
    MeasuredRun,
    SimConfig,
    SimConfigError,
)
from hyperacc.sim.simulate import (
    NodeResult,
    RunSummary,
    simulate,
    summarize,
    sweep,
)

__all__ = [
    "ComputeModel",
    "EarlyArrivalCost",
    "FabricModel",
    "MeasuredRun",
    "NodeResult",
    "RunSummary",
    "SimConfig",
    "SimConfigError",
    "simulate",
    "summarize",
    "sweep",
]
