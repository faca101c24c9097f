"""hyper-trace analysis: pure functions over step records, from a run directory to a diagnosis.

``diagnose(run_dir, **options)`` streams the ranks of a run directory and returns a ``Diagnosis``
(verdict, evidence, next step, stragglers, spike rates, causes, projection). ``LiveDetector`` judges
window summaries while training runs. Every rule, formula and default: docs/detection.md.

The names are imported on first use (PEP 562): a module that needs one part of the analysis (a rank
summarising its windows imports ``analysis.windows``) does not load the rest and scipy with it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SCHEMA_VERSION": "hyperacc.analysis.diagnosis",
    "Diagnosis": "hyperacc.analysis.diagnosis",
    "LiveDetector": "hyperacc.analysis.live",
    "DetectionOptions": "hyperacc.analysis.options",
    "diagnose": "hyperacc.analysis.run_dir",
}

__all__ = ["SCHEMA_VERSION", "DetectionOptions", "Diagnosis", "LiveDetector", "diagnose"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hyperacc.analysis' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
