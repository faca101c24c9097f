"""Run directories written with the synthetic model (hyperacc.analysis.synthetic) and known faults."""

from __future__ import annotations

from pathlib import Path

import pytest
from analysis_runs import FAULTY

from hyperacc.analysis.synthetic import SyntheticRun, write_run


@pytest.fixture(scope="session")
def faulty_run(tmp_path_factory) -> Path:
    return write_run(tmp_path_factory.mktemp("faulty") / "run", FAULTY)


@pytest.fixture(scope="session")
def clean_run(tmp_path_factory) -> Path:
    return write_run(tmp_path_factory.mktemp("clean") / "run", SyntheticRun(ranks=8, steps=2000, seed=11))


@pytest.fixture(scope="session")
def faulty_diagnosis(faulty_run):
    from hyperacc.analysis import diagnose

    return diagnose(faulty_run).to_dict()
