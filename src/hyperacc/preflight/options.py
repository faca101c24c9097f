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
from hyperacc.options import OptionsError, check, check_fields, load, parse_json

ENV = "HYPERACC_DOCTOR"  # the options as JSON, for the ranks
ENV_OUT = "HYPERACC_DOCTOR_OUT"  # where each node's local rank 0 writes the gathered measurements
_RULE = DetectionOptions()  # the cross-rank outlier rule's defaults, defined once (docs/detection.md)
SECTION = "doctor"

DoctorConfigError = OptionsError  # the name before the one options error; public, kept as an alias


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
        check_fields(self, SECTION)
        for name, ok, allowed in (
            ("seconds", self.seconds > 0, "> 0"),
            ("rounds", self.rounds >= 1, ">= 1"),
            ("persist_k", 1 <= self.persist_k <= self.rounds, f"between 1 and rounds ({self.rounds})"),
            ("read_bytes", self.read_bytes >= 512, ">= 512"),
            ("memory_mb", self.memory_mb >= 1, ">= 1"),
            ("exchange_mb", self.exchange_mb >= 1, ">= 1"),
            ("matmul_n", self.matmul_n is None or self.matmul_n >= 16, ">= 16 or null"),
            ("min_slowdown", self.min_slowdown >= 0, ">= 0"),
        ):
            check(SECTION, name, getattr(self, name), ok, allowed)
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
        except OptionsError as exc:
            raise exc.within(SECTION) from None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> DoctorOptions:
        return load(cls, values, SECTION)

    @classmethod
    def from_json(cls, text: str) -> DoctorOptions:
        return cls.from_mapping(parse_json(text, ENV))
