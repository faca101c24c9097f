"""Chrome / Perfetto trace export of run directories."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pytest
from click.testing import CliRunner
from present_inputs import synthetic_run

from hyperacc.analysis import diagnose
from hyperacc.cli import cli
from hyperacc.present.chrome import (
    TID_COLLECTIVES,
    TID_HYPERACC,
    TID_PHASES,
    TID_SIGNALS,
    TID_STEPS,
    TID_WAIT,
    ExportError,
    export_chrome,
    parse_steps,
)
from hyperacc.schema import EVENT_SCHEMA
from hyperacc.store import event_writer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("chrome") / "run"
    synthetic_run(d, ranks=4, steps=200, straggler=2, gc_spikes={1: [60, 130]})
    events = pa.table(
        {"rank": pa.array([0, 0], pa.int32()), "step": pa.array([100, 150], pa.int64()),
         "t_ns": pa.array([1_700_000_000_000_000_000 + 10**9, 1_700_000_000_000_000_000 + 2 * 10**9], pa.int64()),
         "kind": ["gc_collect", "pace_on"], "duration_ns": pa.array([3_000_000, None], pa.int64()),
         "value": pa.array([None, None], pa.float64()), "detail": pa.array(["gen 2", None], pa.string())},
        schema=EVENT_SCHEMA,
    )  # fmt: skip
    event_writer(d, 0).write(events)
    return d


def _check_format(doc: dict) -> list[dict]:
    """The invariants of the Trace Event Format that Perfetto and chrome://tracing rely on."""
    assert isinstance(doc["traceEvents"], list)
    for ev in doc["traceEvents"]:
        assert ev["ph"] in ("X", "i", "M", "C") and isinstance(ev["pid"], int)
        if ev["ph"] != "M":
            assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0
        if ev["ph"] == "X":
            assert ev["dur"] >= 0 and "tid" in ev
        if ev["ph"] == "i":
            assert ev["s"] in ("t", "p", "g")
    return doc["traceEvents"]


def test_export_draws_ranks_phases_waits_spikes_and_gc(run, tmp_path):
    diag = diagnose(run).to_dict()
    res = export_chrome(run, tmp_path / "t.json", diagnosis=diag)
    events = _check_format(json.loads(res.path.read_text()))
    assert res.ranks == 4 and res.steps == 800 and res.trace_events == len(events)
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r} (node {r // 2}, host{r // 2})" for r in range(4)}
    per_track = Counter((e["pid"], e.get("tid")) for e in events if e["ph"] == "X")
    for r in range(4):
        assert per_track[(r, TID_STEPS)] == 200
        assert per_track[(r, TID_PHASES)] == 3 * 200  # forward, backward, optimizer
        assert per_track[(r, TID_WAIT)] == 200
    # phases are laid end to end inside their step, the wait between backward and optimizer
    first = next(e for e in events if e.get("tid") == TID_STEPS and e["pid"] == 1 and e["ph"] == "X")
    inside = [e for e in events if e["pid"] == 1 and e["ph"] == "X" and e.get("tid") in (TID_PHASES, TID_WAIT) and e["args"]["step"] == 0]
    assert [e["name"] for e in sorted(inside, key=lambda e: e["ts"])] == ["forward", "backward", "comm wait", "optimizer"]
    end = max(e["ts"] + e["dur"] for e in inside)
    assert first["args"]["step"] == 0 and end == pytest.approx(first["ts"] + first["dur"], abs=0.01)
    # spikes with their cause at the ranks and steps the diagnosis names; GC pauses where gc_ns > 0
    spikes = sorted((e["pid"], e["args"]["step"], e["name"]) for e in events if e.get("cat") == "spike")
    assert spikes == sorted((s["rank"], s["step"], f"spike: {s['cause']}") for s in diag["spikes"]["events"])
    gc = sorted((e["pid"], e["args"]["step"]) for e in events if e.get("cat") == "gc")
    assert gc == [(1, 60), (1, 130)] and all(e["tid"] == TID_SIGNALS for e in events if e.get("cat") == "gc")
    # stabilizer and pacing events on their own track: a slice when they took time, else an instant
    hyper = [e for e in events if e.get("tid") == TID_HYPERACC and e["ph"] != "M"]
    assert sorted((e["name"], e["ph"]) for e in hyper) == [("gc_collect", "X"), ("pace_on", "i")]


def test_step_window_limits_the_export(run, tmp_path):
    res = export_chrome(run, tmp_path / "w.json", steps=parse_steps("100:150"))
    events = _check_format(json.loads(res.path.read_text()))
    got = sorted({e["args"]["step"] for e in events if e.get("tid") == TID_PHASES and e["ph"] == "X"})
    assert got == list(range(100, 150)) and res.steps == 4 * 50
    assert min(e["ts"] for e in events if e["ph"] != "M") == 0  # time zero: the window's first record
    hyper = [e["name"] for e in events if e.get("tid") == TID_HYPERACC and e["ph"] != "M"]
    assert hyper == ["gc_collect"]  # step 100 in, step 150 out


def test_kineto_import_exports_collectives_and_overlapping_waits(kineto_run, tmp_path):
    res = export_chrome(kineto_run, tmp_path / "k.json")
    events = _check_format(json.loads(res.path.read_text()))
    coll = [e for e in events if e.get("tid") == TID_COLLECTIVES and e["ph"] == "X"]
    assert len(coll) == 4 * 21 and {e["name"] for e in coll} == {"allreduce", "broadcast"}
    # the GPU collectives overlap backward: the wait is drawn ending at the step end
    step = next(e for e in events if e.get("tid") == TID_STEPS and e["pid"] == 0 and e["ph"] == "X")
    wait = next(e for e in events if e.get("tid") == TID_WAIT and e["ph"] == "X" and e["pid"] == 0 and e["args"]["step"] == step["args"]["step"])
    assert wait["ts"] + wait["dur"] == pytest.approx(step["ts"] + step["dur"], abs=0.01)


def test_parse_steps_rejects_nonsense():
    assert parse_steps("10:") == (10, None) and parse_steps(":5") == (None, 5) and parse_steps(None) == (None, None)
    for bad in ("a:b", "5", "9:3", "1:2:3"):
        with pytest.raises(ExportError, match="--steps"):
            parse_steps(bad)


def test_cli_export_prints_the_path_and_reports_bad_input_in_one_line(run, tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli.json"
    res = runner.invoke(cli, ["export", str(run), "--chrome", str(out), "--steps", "0:20"])
    assert res.exit_code == 0, res.output
    assert str(out) in res.output and "perfetto" in res.output.lower()
    assert json.loads(out.read_text())["otherData"]["steps"] == [0, 20]
    bad = runner.invoke(cli, ["export", str(run), "--chrome", str(out), "--steps", "x"])
    assert bad.exit_code != 0 and "--steps 'x'" in bad.output and "Traceback" not in bad.output
    missing = runner.invoke(cli, ["export", str(tmp_path / "nope"), "--chrome", str(out)])
    assert missing.exit_code != 0 and "does not exist" in missing.output and "Traceback" not in missing.output
