"""hyper-trace analysis: pure functions over step records, from a run directory to a diagnosis.

``diagnose(run_dir, **options)`` streams the ranks of a run directory and returns a ``Diagnosis``
(verdict, evidence, next step, stragglers, spike rates, causes, projection). ``LiveDetector`` judges
window summaries while training runs. Every rule, formula and default: docs/detection.md.
"""

from __future__ import annotations

from hyperacc.analysis.diagnosis import SCHEMA_VERSION, Diagnosis
from hyperacc.analysis.live import LiveDetector
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.run_dir import diagnose

__all__ = ["SCHEMA_VERSION", "DetectionOptions", "Diagnosis", "LiveDetector", "diagnose"]
