"""Foreign, mistyped, huge-step and corrupt contents of a run directory: ``analyze``, ``report`` and
``export`` all keep every record that fits, skip the rest with one warning naming the file, and agree
on what they read (docs/reliability.md, "Run directories")."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from reliability_runs import SMALL, check_cli_result, small_run

from hyperacc import store
from hyperacc.cli import cli
from hyperacc.schema import EVENT_SCHEMA

RANKS, STEPS = SMALL.ranks, SMALL.steps
I32 = pa.int32()


def _ids(steps: list, rank: int = 1) -> dict[str, pa.Array]:
    return {"rank": pa.array([rank] * len(steps), I32), "node": pa.array([0] * len(steps), I32),
            "step": pa.array(steps, pa.int64())}  # fmt: skip


# name -> (table written as rank 1's extra segment, distinct steps the run then has, why it is skipped)
CASES = {
    "foreign columns": (pa.table({"x": [1, 2, 3], "y": ["a", "b", "c"]}), STEPS, "foreign column(s) 'x', 'y'"),
    "step_ns as text": (pa.table({**_ids([STEPS]), "step_ns": ["12"]}), STEPS, "column 'step_ns' is string"),
    "fractional step": (pa.table({"rank": pa.array([1], I32), "node": pa.array([0], I32), "step": [300.5]}), STEPS,
                        "column 'step' is double"),
    "no step column": (pa.table({"step_ns": pa.array([5], pa.int64())}), STEPS, "no step column"),
    "step 10**12": (pa.table({**_ids([10**12]), "step_ns": pa.array([10**6], pa.int64())}), STEPS + 1, None),
    "step 2**62": (pa.table({**_ids([2**62]), "step_ns": pa.array([10**6], pa.int64())}), STEPS, "left out"),
    "null step": (pa.table({"rank": pa.array([1, 1], I32), "node": pa.array([0, 0], I32),
                            "step": pa.array([None, STEPS], pa.int64())}), STEPS + 1, "left out"),
    "step 2**64-1 unsigned": (pa.table({"rank": pa.array([1], I32), "node": pa.array([0], I32),
                                        "step": pa.array([2**64 - 1], pa.uint64())}), STEPS, "left out"),
    "rank beyond int32": (pa.table({"rank": pa.array([2**40], pa.int64()), "node": pa.array([0], I32),
                                    "step": pa.array([STEPS], pa.int64())}), STEPS, "left out"),
    "measurements as floats": (pa.table({**_ids([STEPS]), "step_ns": [float("nan")], "self_ns": [1e6]}), STEPS + 1,
                               None),
    "older schema (few columns)": (pa.table({**_ids([STEPS + 1]), "step_ns": pa.array([2 * 10**6], pa.int64())}),
                                   STEPS + 1, None),
    # a newer hyperacc's segment: its identity columns, and one this hyperacc does not know (left out)
    "newer schema (a column more)": (pa.table({**_ids([STEPS + 1]), "step_ns": pa.array([2 * 10**6], pa.int64()),
                                              "added_later_ns": pa.array([7], pa.int64())}), STEPS + 1, None),
}  # fmt: skip


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    return small_run(tmp_path_factory.mktemp("base") / "run")


def _copy(base: Path, dest: Path) -> Path:
    shutil.copytree(base, dest)
    return dest


def _all_three(run: Path, out: Path) -> tuple[dict, int, int]:
    """(analyze's document, report's step count, export's step records), each command checked."""
    runner = CliRunner()
    res = runner.invoke(cli, ["analyze", str(run), "--json"])
    check_cli_result(res, (0,))
    doc = json.loads(res.output[res.output.index("{") :])
    rep = runner.invoke(cli, ["report", str(run), "-o", str(out / "report.html")])
    check_cli_result(rep, (0,))
    exp = runner.invoke(cli, ["export", str(run), "--chrome", str(out / "trace.json")])
    check_cli_result(exp, (0,))
    report_steps = int(rep.output.strip().splitlines()[-1].split(" ranks, ")[1].split()[0])
    export_records = int(exp.output.strip().splitlines()[-1].split(" ranks, ")[1].split()[0])
    return doc, report_steps, export_records


@pytest.mark.parametrize("case", list(CASES))
def test_a_segment_that_does_not_fit_is_skipped_by_every_command_alike(case, base_run, tmp_path, caplog):
    table, steps, why = CASES[case]
    run = _copy(base_run, tmp_path / "run")
    bad = run / "steps" / "rank-00001" / "seg-000099.parquet"
    pq.write_table(table, bad)
    with caplog.at_level(logging.WARNING):
        doc, report_steps, export_records = _all_three(run, tmp_path)
    assert doc["steps"] == steps and report_steps == steps
    extra = steps - STEPS
    assert export_records == RANKS * STEPS + extra
    assert doc["ranks_analyzed"] == RANKS and doc["missing_ranks"] == []
    warnings = [r.getMessage() for r in caplog.records if str(bad) in r.getMessage()]
    if why is None:
        assert warnings == []
    else:
        # named once per process, however often the readers visit the file
        assert len(warnings) == 1 and why in warnings[0], warnings


def test_a_huge_step_costs_one_entry_not_a_dense_array(base_run, tmp_path):
    """A step numbered 10**12 and one numbered -10**12 (the explicit API takes any number): the
    analysis would need 15 TB of per-step arrays if it indexed steps densely."""
    run = _copy(base_run, tmp_path / "run")
    for rank, step in ((1, 10**12), (2, -(10**12))):
        pq.write_table(pa.table({**_ids([step], rank), "step_ns": pa.array([10**6], pa.int64())}),
                       run / "steps" / f"rank-{rank:05d}" / "seg-000099.parquet")  # fmt: skip
    doc, report_steps, export_records = _all_three(run, tmp_path)
    assert doc["steps"] == report_steps == STEPS + 2
    assert export_records == RANKS * STEPS + 2


def test_every_segment_of_a_rank_foreign_leaves_the_rank_missing(base_run, tmp_path):
    run = _copy(base_run, tmp_path / "run")
    for seg in (run / "steps" / "rank-00003").glob("seg-*.parquet"):
        pq.write_table(pa.table({"x": [1]}), seg)
    doc, report_steps, _ = _all_three(run, tmp_path)
    assert doc["missing_ranks"] == [3] and doc["ranks_analyzed"] == RANKS - 1 and report_steps == STEPS


def test_nothing_readable_is_one_line_from_every_command(base_run, tmp_path):
    run = _copy(base_run, tmp_path / "run")
    for seg in run.glob("steps/rank-*/seg-*.parquet"):
        seg.write_bytes(b"PAR1 not really")
    runner = CliRunner()
    for args in (["analyze", str(run)], ["report", str(run), "-o", str(tmp_path / "r.html")],
                 ["export", str(run), "--chrome", str(tmp_path / "t.json")]):  # fmt: skip
        res = runner.invoke(cli, args)
        check_cli_result(res, (1, 2))
        assert "could be read" in res.output or "no step records" in res.output, res.output


def test_foreign_and_mistyped_events_are_skipped(base_run, tmp_path, caplog):
    run = _copy(base_run, tmp_path / "run")
    good = pa.table({"rank": pa.array([0], I32), "step": pa.array([5], pa.int64()), "t_ns": pa.array([1], pa.int64()),
                     "kind": ["gc_collect"], "duration_ns": pa.array([10**6], pa.int64())})  # fmt: skip
    store.event_writer(run, 0).write(store.conform(good, EVENT_SCHEMA))  # an older writer's few columns
    folder = run / "events" / "rank-00001"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"foo": [1]}), folder / "seg-000001.parquet")
    pq.write_table(pa.table({"rank": pa.array([1], I32), "kind": [3]}), folder / "seg-000002.parquet")
    pq.write_table(pa.table({"rank": pa.array([1, 1], I32), "kind": pa.array([None, "pace_on"])}),
                   folder / "seg-000003.parquet")  # fmt: skip
    with caplog.at_level(logging.WARNING):
        events = store.read_events(run)
        _all_three(run, tmp_path)
    assert events.column("kind").to_pylist() == ["gc_collect", "pace_on"]
    assert events.column("step").to_pylist() == [5, None]  # an event need not belong to a step
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "seg-000001.parquet: foreign column(s) 'foo'" in text and "column 'kind' is int64" in text


def test_corrupt_metadata_and_impossible_rank_folders_are_left_out(base_run, tmp_path, caplog):
    run = _copy(base_run, tmp_path / "run")
    meta = json.loads((run / "meta" / "rank-00002.json").read_text())
    (run / "meta" / "rank-00002.json").write_text(json.dumps({**meta, "world_size": 10**12}))
    (run / "meta" / "rank-00001.json").write_text(json.dumps({**meta, "rank": 1, "node": "x"}))
    (run / "meta" / "rank-00003.json").write_text("[1, 2]")
    (run / "meta" / "rank-00009.json").write_text('{"rank": ' + "9" * 5000 + "}")
    huge = run / "steps" / "rank-99999999"
    huge.mkdir()
    shutil.copy(next((run / "steps" / "rank-00000").glob("seg-*.parquet")), huge / "seg-000001.parquet")
    with caplog.at_level(logging.WARNING):
        doc, _, _ = _all_three(run, tmp_path)
    # world size from the metadata that is left (ranks 0), ranks from the folders: nothing unbounded
    assert doc["world_size"] == RANKS and doc["ranks_analyzed"] == RANKS and doc["missing_ranks"] == []
    skipped = [r.getMessage() for r in caplog.records if "rank metadata" in r.getMessage()]
    assert len(skipped) == 4, skipped


def test_the_live_metrics_follower_skips_what_does_not_fit(base_run, tmp_path, caplog):
    from hyperacc.present.metrics import MetricsSink, RunDirFollower

    run = _copy(base_run, tmp_path / "run")
    table, _, why = CASES["step_ns as text"]
    pq.write_table(table, run / "steps" / "rank-00001" / "seg-000099.parquet")
    pq.write_table(pa.table({"x": [1]}), run / "steps" / "rank-00002" / "seg-000099.parquet")
    sink = MetricsSink(world_size=RANKS)
    with caplog.at_level(logging.WARNING):
        fed = RunDirFollower(run, sink).poll()
    assert fed == RANKS * (STEPS // SMALL.segment_steps) and sink.enabled  # the sink never saw them
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert why in text and "foreign column(s) 'x'" in text
