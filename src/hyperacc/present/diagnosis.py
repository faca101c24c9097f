"""The diagnosis document (``hyperacc.analysis.diagnose(...).to_dict()``) as the presenters use it."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def diagnosis_of(run_dir: str | os.PathLike, **options: Any) -> dict[str, Any] | None:
    """``diagnose(run_dir).to_dict()``, or None when this installation has no analysis module.

    Errors about the run directory itself (``RunDirError``) propagate: the caller reports them.
    """
    try:
        from hyperacc.analysis import diagnose
    except ImportError as exc:
        log.warning("analysis not available (%s); presenting the step records only", exc)
        return None
    return diagnose(run_dir, **options).to_dict()
