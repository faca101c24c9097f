"""Run directories with random contents (hypothesis): ``analyze``, ``report`` and ``export`` never end
in a traceback, and when some records fit they keep exactly those, all three alike
(docs/reliability.md, "Run directories").

Each rank's folder holds a random mix of segments: valid ones (steps in any order, repeated, at
+-10**12, nulls in measurements), ones truncated at a random byte, random bytes, empty files, folders
named like segments, foreign tables, tables with a schema column of the wrong type, and stray files;
rank metadata is valid, random JSON or missing; events are mixed the same way. The test knows which
rows fit (the rules of ``hyperacc.store``) and checks that the commands read exactly those.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_runs import check_cli_result

from hyperacc.cli import cli
from hyperacc.schema import STEP_SCHEMA, RankMeta

EXAMPLES = max(5, int(os.environ.get("HYPERACC_FUZZ_EXAMPLES", "40")) // 2)
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=os.environ.get("HYPERACC_FUZZ_RANDOM") != "1",
    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
MAX_STEP = 1 << 53

steps_st = st.lists(
    st.one_of(st.integers(0, 400), st.sampled_from([10**12, -(10**12), MAX_STEP, MAX_STEP + 1, -(2**63), 2**63 - 1])),
    min_size=0, max_size=40,
)  # fmt: skip
measure_st = st.one_of(st.none(), st.integers(0, 10**9))


@st.composite
def valid_segment(draw, rank: int) -> tuple[bytes, list[int]]:
    """Parquet bytes of a segment that fits, and the steps of it the readers keep."""
    steps = draw(steps_st)
    n = len(steps)
    cols = {"rank": pa.array([rank] * n, pa.int32()), "node": pa.array([rank // 2] * n, pa.int32()),
            "step": pa.array(steps, pa.int64())}  # fmt: skip
    for name in draw(st.lists(st.sampled_from(["step_ns", "self_ns", "comm_wait_ns", "gc_ns", "data_ns",
                                               "t_start_ns", "forward_ns", "pace_on"]), unique=True)):  # fmt: skip
        field = STEP_SCHEMA.field(name)
        if field.type == pa.bool_():
            cols[name] = pa.array(draw(st.lists(st.one_of(st.none(), st.booleans()), min_size=n, max_size=n)))
        elif draw(st.booleans()):  # measurements may arrive as floats, NaN for "not measured"
            vals = draw(st.lists(st.one_of(st.none(), st.floats(0, 1e12), st.just(float("nan"))),
                                 min_size=n, max_size=n))  # fmt: skip
            cols[name] = pa.array(vals, pa.float64())
        else:
            cols[name] = pa.array(draw(st.lists(measure_st, min_size=n, max_size=n)), pa.int64())
    kept = [s for s in steps if -MAX_STEP <= s <= MAX_STEP]
    return _parquet(pa.table(cols)), kept


@st.composite
def broken_segment(draw, rank: int) -> bytes:
    kind = draw(st.sampled_from(["truncated", "garbage", "empty", "foreign", "mistyped", "no step"]))
    good = _parquet(pa.table({"rank": pa.array([rank] * 3, pa.int32()), "step": pa.array([1, 2, 3], pa.int64())}))
    if kind == "truncated":
        return good[: draw(st.integers(0, len(good) - 1))]
    if kind == "garbage":
        return draw(st.binary(max_size=200))
    if kind == "empty":
        return b""
    if kind == "foreign":
        names = draw(st.lists(st.text("xyz_", min_size=1, max_size=6), min_size=1, max_size=3, unique=True))
        return _parquet(pa.table({n: [1, 2] for n in names}))
    column = draw(st.sampled_from(["step", "rank", "step_ns", "pace_on", "node"]))
    wrong = draw(st.sampled_from([pa.array(["1", "2"]), pa.array([[1], [2]]), pa.array([1.5, 2.5]),
                                  pa.array([True, False]), pa.array([{"a": 1}, {"a": 2}])]))  # fmt: skip
    if kind == "no step":
        return _parquet(pa.table({"step_ns": [1, 2]}))
    expected = STEP_SCHEMA.field(column).type
    if wrong.type == expected or (column == "step_ns" and pa.types.is_floating(wrong.type)):
        wrong = pa.array(["1", "2"])
    cols = {"step": pa.array([7, 8], pa.int64()), column: wrong}
    return _parquet(pa.table(cols))


def _parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


@st.composite
def run_directory(draw) -> dict:
    """{"files": {relative path: bytes or None for a folder}, "kept": {rank: set of kept steps}}."""
    files: dict[str, bytes | None] = {}
    kept: dict[int, set[int]] = {}
    ranks = draw(st.integers(1, 4))
    for rank in range(ranks):
        folder = f"steps/rank-{rank:05d}"
        for i in range(draw(st.integers(0, 3))):
            name = f"{folder}/seg-{i + 1:06d}.parquet"
            if draw(st.integers(0, 2)):  # two in three segments fit
                data, steps = draw(valid_segment(rank))
                files[name] = data
                if steps:
                    kept.setdefault(rank, set()).update(steps)
            elif draw(st.booleans()):
                files[name] = draw(broken_segment(rank))
            else:
                files[name] = None  # a folder named like a segment
        if draw(st.booleans()):
            files[f"{folder}/seg-000099.parquet.tmp"] = b"half a segment"  # a writer killed mid-write
        meta = draw(st.sampled_from(["valid", "garbage", "list", "wrong types", "none"]))
        text = {
            "valid": RankMeta(rank, rank % 2, rank // 2, ranks, 2, "host", 1).to_json(),
            "garbage": "{not json",
            "list": "[1, 2, 3]",
            "wrong types": json.dumps({"rank": rank, "local_rank": "x", "node": None, "world_size": 10**15,
                                       "local_world_size": 2, "hostname": 5, "pid": 1}),  # fmt: skip
        }.get(meta)
        if text is not None:
            files[f"meta/rank-{rank:05d}.json"] = text.encode()
        if draw(st.booleans()):
            event_rows = draw(st.integers(0, 5))
            events = pa.table({
                "rank": pa.array([rank] * event_rows, pa.int32()),
                "step": pa.array(draw(st.lists(st.one_of(st.none(), st.integers(0, 400)), min_size=event_rows,
                                               max_size=event_rows)), pa.int64()),
                "t_ns": pa.array([10**18 + i for i in range(event_rows)], pa.int64()),
                "kind": pa.array(draw(st.lists(st.one_of(st.none(), st.sampled_from(["gc_collect", "pace_on"])),
                                               min_size=event_rows, max_size=event_rows))),
            })  # fmt: skip
            files[f"events/rank-{rank:05d}/seg-000001.parquet"] = _parquet(events)
            files[f"events/rank-{rank:05d}/seg-000002.parquet"] = draw(broken_segment(rank))
    files["steps/README"] = b"not a rank"
    files["steps/rank-abc/seg-000001.parquet"] = b""
    return {"files": files, "kept": kept}


def _materialise(root: Path, spec: dict) -> None:
    (root / "steps").mkdir(parents=True)
    (root / "meta").mkdir()
    for rel, data in spec["files"].items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if data is None:
            path.mkdir()
        else:
            path.write_bytes(data)


def _count(output: str) -> int:
    return int(output.strip().splitlines()[-1].split(" ranks, ")[1].split()[0])


@FUZZ
@given(spec=run_directory())
def test_random_run_directories(spec):
    kept = spec["kept"]
    distinct = set().union(*kept.values()) if kept else set()
    with tempfile.TemporaryDirectory(prefix="hyperacc-rundir-") as tmp:
        root = Path(tmp) / "run"
        _materialise(root, spec)
        runner = CliRunner()
        analyze = runner.invoke(cli, ["analyze", str(root), "--json"])
        report = runner.invoke(cli, ["report", str(root), "-o", f"{tmp}/r.html"])
        export = runner.invoke(cli, ["export", str(root), "--chrome", f"{tmp}/t.json", "--no-diagnosis"])
    for result in (analyze, report, export):
        check_cli_result(result, (0,) if kept else (1, 2))
    if not kept:
        return
    doc = json.loads(analyze.output[analyze.output.index("{") :])
    assert doc["steps"] == len(distinct) and doc["ranks_analyzed"] == len(kept)
    assert _count(report.output) == len(distinct)
    assert _count(export.output) == sum(len(s) for s in kept.values())
