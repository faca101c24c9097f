"""Zero-code tracing of the trainers people run: Hugging Face Trainer and PyTorch Lightning.

Each framework runs a tiny GPT-2 (built from a config, nothing downloaded) on 4 CPU ranks with gloo,
under plain torchrun and under ``hyperacc run`` with a chaos slowdown on rank 1 and gradient
accumulation. Checked: phases nest and add up to the step, every collective a step makes is counted
as wait, every micro-step's backward is counted, the slowed rank is named a compute straggler, and the
final weights equal those of plain torchrun bit for bit.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pytest

from hyperacc import harness, store
from hyperacc.analysis import diagnose
from hyperacc.schema import STEP_SCHEMA

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
JOBS = Path(__file__).parent / "jobs"
PHASES = ("data_ns", "h2d_ns", "forward_ns", "backward_ns", "comm_wait_ns", "optimizer_ns")
STEPS, ACCUM, RANKS = 60, 2, 4


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("script", "package"), [("train_hf.py", "transformers"), ("train_lightning.py", "lightning")]
)
def test_trainer_traced_without_changes(tmp_path: Path, script: str, package: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (pip install -e '.[dev]')")
    run_dir = tmp_path / "run"
    args = ["--steps", str(STEPS), "--accum", str(ACCUM)]
    chaos = {"seed": 1, "faults": [{"kind": "slowdown", "ranks": [1], "factor": 1.0}]}
    opts = {"run-dir": str(run_dir), "trace": json.dumps({"window": 0, "probe_every": 0}), "chaos": json.dumps(chaos)}
    traced = harness.launch(EXAMPLES / script, args, nproc=RANKS, timeout=400, traced=opts)
    assert traced.ok, traced.explain()
    plain = harness.launch(EXAMPLES / script, args, nproc=RANKS, timeout=400)
    assert plain.ok, plain.explain()
    # bit-identical training: the tracer does not touch the gradients' reduction
    assert [r["checksum"] for r in traced.results()] == [r["checksum"] for r in plain.results()]

    table = store.read_steps(run_dir)
    for rank in range(RANKS):
        rows = table.filter(pc.equal(table["rank"], rank)).to_pylist()
        assert [r["step"] for r in rows] == list(range(STEPS))
        for row in rows:
            phases = sum(row[c] or 0 for c in PHASES)
            assert phases <= row["step_ns"] + 1000 and row["other_ns"] == row["step_ns"] - phases, row
            assert row["micro_steps"] == ACCUM, row  # every micro-step's backward
            assert row["backward_ns"] > 0 and row["forward_ns"] > 0
            assert row["optimizer_ns"] < row["step_ns"] / 2  # the closure's forward/backward are not the optimizer's
            # the gradient all-reduce and every extra sync point (HF's token-count gather, Lightning's
            # reductions) are waits, not the rank's own time
            assert row["collectives"] >= 1 and row["self_ns"] == row["step_ns"] - row["comm_wait_ns"]
    d = diagnose(run_dir, window_steps=10, warmup_steps=5, min_window_samples=5)
    named = {s["rank"]: s["kind"] for s in d.stragglers}
    assert named.get(1) == "compute", (d.verdict, d.stragglers)
    assert set(named) <= {1}, d.stragglers


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("script", "package"), [("train_hf.py", "transformers"), ("train_lightning.py", "lightning")]
)
def test_the_trainers_callback_traces_a_run_started_by_plain_torchrun(tmp_path: Path, script: str, package: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (pip install -e '.[dev]')")
    run_dir = tmp_path / "run"
    job = harness.launch(EXAMPLES / script, ["--steps", "12", "--trace-dir", str(run_dir)], nproc=2, timeout=300)
    assert job.ok, job.explain()
    table = store.read_steps(run_dir)
    for rank in range(2):
        rows = table.filter(pc.equal(table["rank"], rank)).to_pylist()
        assert [r["step"] for r in rows] == list(range(12))
        assert all(r["comm_wait_ns"] is not None and r["forward_ns"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("framework,package", [("hf", "transformers"), ("lightning", "lightning")])
def test_a_trainer_resumed_from_its_checkpoint_numbers_its_steps_as_the_run_it_continues(
    tmp_path: Path, framework: str, package: str
) -> None:
    # 8 steps saving at step 4, then a second trainer resumes from that checkpoint (in the same process,
    # as a restarted job would from its own); the callback passes the trainer's global_step to the tracer
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (pip install -e '.[dev]')")
    run_dir = tmp_path / "run"
    job = subprocess.run([sys.executable, str(JOBS / "trainer_resume.py"), framework, str(run_dir), str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    written = []  # every record as written, in order
    for path in store.live_segments(run_dir / "steps" / "rank-00000"):
        written += store.read_segment(path, STEP_SCHEMA, ["step"])["step"].to_pylist()
    # the first run's steps 0-7, then the resumed run's from 4 (not 8 on, nor 0 on)
    assert written[:8] == list(range(8)) and written[8:] == list(range(4, len(written) - 4)), written
    assert store.read_steps(run_dir)["step"].to_pylist() == list(range(8))  # each step once, the later kept
