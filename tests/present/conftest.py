"""Fixtures of the presentation tests: the real Kineto fixtures and run directories built from them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from present_inputs import KINETO_FIXTURES, NCCL_TRACE, SINGLE_TRACE, trace_text, write_rank_trace


@pytest.fixture(scope="session")
def kineto_fixtures() -> Path:
    if not NCCL_TRACE.is_file() or not SINGLE_TRACE.is_file():
        pytest.skip(f"Kineto fixtures not found in {KINETO_FIXTURES} (tests/fixtures/kineto)")
    return KINETO_FIXTURES


@pytest.fixture(scope="session")
def nccl_doc(kineto_fixtures) -> dict:
    with gzip.open(NCCL_TRACE, "rt") as f:
        return json.load(f)


@pytest.fixture(scope="session")
def nccl_text(kineto_fixtures) -> str:
    return trace_text(NCCL_TRACE)


@pytest.fixture(scope="session")
def four_rank_traces(nccl_text, tmp_path_factory) -> Path:
    """Four ranks of the real 2-rank NCCL trace; rank 2 launches kernels 1.3x slower."""
    d = tmp_path_factory.mktemp("kineto4")
    for r in range(4):
        write_rank_trace(nccl_text, d / f"trace_rank{r}.json.gz", r, 4, 1.3 if r == 2 else 1.0)
    return d


@pytest.fixture(scope="session")
def kineto_run(four_rank_traces, tmp_path_factory) -> Path:
    from hyperacc.present.kineto import import_traces

    run = tmp_path_factory.mktemp("kineto-run") / "run"
    import_traces([four_rank_traces], run)
    return run
