"""The pre-flight check behind ``hyperacc doctor``: per-rank benchmarks, exchanges, and the verdict.

``judge(measurements)`` turns what the ranks gathered (``hyperacc.preflight.worker``) into the doctor's
document; ``DoctorOptions`` holds every setting; ``RANK_FIGURES`` lists what is measured. docs/doctor.md.
"""

from __future__ import annotations

from hyperacc.preflight.figures import RANK_FIGURES, RESOURCES
from hyperacc.preflight.judge import judge
from hyperacc.preflight.options import DoctorConfigError, DoctorOptions

__all__ = ["RANK_FIGURES", "RESOURCES", "DoctorConfigError", "DoctorOptions", "judge"]
