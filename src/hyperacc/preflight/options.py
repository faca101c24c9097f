"""Settings of the pre-flight check: what each rank measures and how the figures are judged.

Defaults and their reasons: docs/doctor.md. The judgement reuses ``hyperacc.analysis.DetectionOptions``
(the rules of ``hyperacc analyze``) with the doctor's own materiality and persistence.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from hyperacc.analysis.options import DetectionOptions

ENV = "HYPERACC_DOCTOR"  # the options as JSON, for the ranks
ENV_OUT = "HYPERACC_DOCTOR_OUT"  # where each node's local rank 0 writes the gathered measurements
_RULE = DetectionOptions()  # the cross-rank outlier rule's defaults, defined once (docs/detection.md)


class DoctorConfigError(ValueError):
    """An impossible doctor setting; the message names it."""


@dataclasses.dataclass(frozen=True)
class DoctorOptions:
    # -- measuring
    seconds: float = 45.0  # measurement time, split over the rounds (start-up comes on top)
    rounds: int = 5  # every figure is measured once per round; persistence is judged over rounds
    data: str | None = None  # a file or directory whose read latency is measured
    read_bytes: int = 256 * 1024  # bytes per read of the data path
    matmul_n: int | None = None  # square matmul size (None: 256 on a CPU, 4096 on a GPU)
    memory_mb: int = 32  # size of the host buffer copied for memory bandwidth
    exchange_mb: int = 4  # message size of the bandwidth exchanges (all-reduce, node pairs)
    # -- judging (docs/doctor.md, "Rules")
    min_slowdown: float = 0.25  # a figure must be this much worse than the median to count
    persist_k: int = 3  # ... in at least k of the rounds
    min_ranks: int = _RULE.min_ranks  # fewer ranks (or nodes, or node pairs) than this: no robust comparison
    z_threshold: float = _RULE.z_threshold
    iqr_k: float = _RULE.iqr_k

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise DoctorConfigError(f"--seconds must be > 0 (got {self.seconds})")
        if self.rounds < 1:
            raise DoctorConfigError(f"rounds must be >= 1 (got {self.rounds})")
        if not 1 <= self.persist_k <= self.rounds:
            raise DoctorConfigError(
                f"persist_k must be between 1 and rounds={self.rounds} (got {self.persist_k})"
            )
        if self.read_bytes < 512 or self.memory_mb < 1 or self.exchange_mb < 1:
            raise DoctorConfigError("read_bytes must be >= 512, memory_mb and exchange_mb >= 1")
        if self.matmul_n is not None and self.matmul_n < 16:
            raise DoctorConfigError(f"matmul_n must be >= 16 (got {self.matmul_n})")
        if self.min_slowdown < 0:
            raise DoctorConfigError(f"min_slowdown must be >= 0 (got {self.min_slowdown})")
        self.detection()  # the shared rules validate the rest

    def detection(self) -> DetectionOptions:
        """The analyze rules with the doctor's settings: one round plays the part of one window."""
        try:
            return DetectionOptions(
                min_slowdown=self.min_slowdown,
                persist_k=self.persist_k,
                persist_n=self.rounds,
                min_ranks=self.min_ranks,
                z_threshold=self.z_threshold,
                iqr_k=self.iqr_k,
            )
        except ValueError as exc:
            raise DoctorConfigError(str(exc)) from None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> DoctorOptions:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise DoctorConfigError(f"unknown doctor option(s) {unknown}; known: {', '.join(sorted(known))}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> DoctorOptions:
        try:
            values = json.loads(text)
        except ValueError as exc:
            raise DoctorConfigError(f"{ENV} is not valid JSON ({exc})") from None
        if not isinstance(values, dict):
            raise DoctorConfigError(f"{ENV} must be a JSON object")
        return cls.from_mapping(values)
