"""Pacing at collectives (docs/pacing.md): delay ranks that are predicted to arrive early, boundedly.

``PacingController`` is the pure policy (observations in, delays out), shared by the runtime hook
(``hyperacc.pacing.runtime``) and the simulator (``hyperacc.sim``).
"""

from hyperacc.pacing.controller import PacingConfig, PacingConfigError, PacingController, PacingState

__all__ = ["PacingConfig", "PacingConfigError", "PacingController", "PacingState"]
