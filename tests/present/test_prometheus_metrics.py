"""Prometheus metrics from step records, scraped over loopback."""

from __future__ import annotations

import urllib.request

import numpy as np
import pyarrow as pa
import pytest
from present_inputs import synthetic_run
from prometheus_client.parser import text_string_to_metric_families

from hyperacc.analysis import diagnose
from hyperacc.analysis.options import DetectionOptions
from hyperacc.harness import free_port
from hyperacc.present.metrics import MetricsSink, RunDirFollower, serve


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def feed_like_a_tracer(sink: MetricsSink, table: pa.Table, rows_per_flush: int = 37) -> None:
    """Each rank's records in flush-sized pieces, ranks interleaved, as flusher threads deliver them."""
    ranks = table.column("rank").to_numpy()
    per_rank = [table.filter(pa.array(ranks == r)) for r in np.unique(ranks)]
    n = per_rank[0].num_rows
    for a in range(0, n, rows_per_flush):
        for t in per_rank:
            sink(t.slice(a, rows_per_flush))


def test_sink_metrics_agree_with_the_offline_diagnosis(tmp_path):
    spikes = {1: [100, 150, 200, 250, 300], 4: [120, 260]}
    table = synthetic_run(tmp_path / "run", ranks=6, steps=400, straggler=3, gc_spikes=spikes)
    sink = MetricsSink(world_size=6, nodes=3)
    server = serve(sink, port := free_port())
    try:
        feed_like_a_tracer(sink, table)
        m = scrape(port)
    finally:
        server.shutdown()
    assert sink.enabled
    for r in range(6):
        assert m[("hyperacc_step_seconds_count", (("rank", str(r)),))] == 400
    step_sum = table.column("step_ns").to_numpy().sum() / 1e9
    assert total(m, "hyperacc_step_seconds_sum") == pytest.approx(step_sum, rel=1e-9)
    fwd = table.column("forward_ns").to_numpy().sum() / 1e9
    assert total(m, "hyperacc_phase_seconds_total", phase="forward") == pytest.approx(fwd, rel=1e-9)
    assert total(m, "hyperacc_gc_collections_total", rank="1") == 5
    assert total(m, "hyperacc_gc_pause_seconds_total", rank="4") == pytest.approx(0.12)

    # spikes and their causes: the same as `hyperacc analyze` finds in the written run
    diag = diagnose(tmp_path / "run").to_dict()
    offline = {(e["rank"], e["cause"]) for e in diag["spikes"]["events"]}
    assert offline == {(1, "gc"), (4, "gc")}
    for row in diag["spikes"]["per_rank"]:
        assert total(m, "hyperacc_spikes_total", rank=str(row["rank"])) == row["spikes"]
    assert total(m, "hyperacc_spikes_total", cause="gc") == 7
    assert total(m, "hyperacc_spike_seconds_total", cause="gc") == pytest.approx(
        sum(c["time_lost_ns"] for c in diag["causes"]) / 1e9, rel=0.05
    )
    # the straggler the analysis confirms is flagged, with its kind; nobody else
    assert [(s["rank"], s["kind"]) for s in diag["stragglers"]] == [(3, "compute")]
    flagged = {lab for (n, lab), v in m.items() if n == "hyperacc_straggler" and v == 1}
    assert flagged == {(("kind", "compute"), ("rank", "3"))}
    # in-band culprit view: rank 3 arrives last in (nearly) every step
    assert m[("hyperacc_culprit_share", (("rank", "3"),))] > 0.9


def test_sink_counts_stabilizer_and_pacing_actions():
    sink = MetricsSink()
    events = pa.table(
        {
            "rank": pa.array([0, 0, 0, 1], pa.int32()),
            "step": pa.array([10, 20, 30, 30], pa.int64()),
            "t_ns": pa.array([1, 2, 3, 4], pa.int64()),
            "kind": ["gc_collect", "gc_collect", "pace_on", "collective"],
            "duration_ns": pa.array([2_000_000, 3_000_000, None, 5], pa.int64()),
            "value": pa.array([None, None, None, None], pa.float64()),
            "detail": pa.array([None, None, None, None], pa.string()),
        }
    )
    sink.observe_events(events)
    reg = sink.registry
    assert reg.get_sample_value("hyperacc_stabilizer_actions_total", {"rank": "0", "action": "gc_collect"}) == 2
    assert reg.get_sample_value("hyperacc_stabilizer_seconds_total", {"rank": "0", "action": "gc_collect"}) == 0.005
    assert reg.get_sample_value("hyperacc_stabilizer_actions_total", {"rank": "0", "action": "pace_on"}) == 1
    assert reg.get_sample_value("hyperacc_stabilizer_actions_total", {"rank": "1", "action": "collective"}) is None


def test_an_internal_error_switches_the_sink_off_without_raising(caplog):
    sink = MetricsSink()
    sink(pa.table({"rank": pa.array([0], pa.int32()), "no_step_column": [1]}))
    assert not sink.enabled
    assert sum("metrics switched off" in r.message for r in caplog.records) == 1
    sink(pa.table({"rank": pa.array([0], pa.int32())}))  # ignored, no second line
    assert sum("metrics switched off" in r.message for r in caplog.records) == 1


def test_follower_aggregates_every_rank_from_the_run_dir(tmp_path):
    table = synthetic_run(tmp_path / "run", ranks=4, steps=120, segment_steps=40)
    sink = MetricsSink()
    follower = RunDirFollower(tmp_path / "run", sink)
    assert follower.poll() == 12  # 4 ranks x 3 segments
    assert follower.poll() == 0  # each segment once
    (tmp_path / "run" / "steps" / "rank-00001" / "seg-000099.parquet").write_bytes(b"not parquet")
    assert follower.poll() == 0 and follower.poll() == 0  # unreadable: retried, then skipped
    reg = sink.registry
    for r in range(4):
        assert reg.get_sample_value("hyperacc_step_seconds_count", {"rank": str(r)}) == 120
    assert reg.get_sample_value("hyperacc_last_step", {"rank": "2"}) == 119
    assert table.num_rows == 480


def _paged_steps(lo: int, hi: int, rng: np.random.Generator) -> pa.Table:
    """4 ranks' step records; rank 1's CPU time is 1.3x, nearly all of it the kernel's, 1,000 page
    faults a step more than the others (its allocator maps its blocks afresh)."""
    ms = 1_000_000
    cols: dict[str, list[int]] = {k: [] for k in ("rank", "node", "step", "step_ns", "self_ns", "comm_wait_ns",
                                                  "cpu_ns", "sys_cpu_ns", "minor_faults")}  # fmt: skip
    for r in range(4):
        paged = r == 1
        for step in range(lo, hi):
            cpu = (10 + 3 * paged) * ms * np.exp(rng.normal(0, 0.02))
            row = {"rank": r, "node": 0, "step": step, "step_ns": 15 * ms, "self_ns": int(1.05 * cpu),
                   "comm_wait_ns": int(14 * ms - 1.05 * cpu), "cpu_ns": int(cpu),
                   "sys_cpu_ns": int((0.5 + 2.7 * paged) * ms * rng.uniform(0.5, 1.5)),
                   "minor_faults": int(11 + 1000 * paged + rng.integers(0, 3))}  # fmt: skip
            for k, v in row.items():
                cols[k].append(v)
    return pa.table({k: pa.array(v, type=pa.int32() if k in ("rank", "node") else pa.int64()) for k, v in cols.items()})


def test_the_straggler_gauge_judges_the_columns_analyze_judges():
    # the gauge's kind comes from the same rules on the same columns: CPU time, switches, page faults
    rng = np.random.default_rng(2)
    sink = MetricsSink(options=DetectionOptions(window_steps=20, warmup_steps=5))
    for lo in range(0, 200, 20):
        sink(_paged_steps(lo, lo + 20, rng))
    assert sink._flagged == {1: "page_faults"}


def test_each_node_agent_serves_its_own_ranks_and_the_leader_the_jobs_stragglers(tmp_path) -> None:
    """``hyperacc run --metrics-port`` on a job of two nodes sharing one run directory: each node's agent
    serves the metrics of the ranks whose metadata names it, none of the other node's (no training rank
    serves any); the straggler gauge is the live windows' job-wide verdict, exported by the agent that
    holds rank 0, not judged by a sink that sees one node. An agent that holds every rank judges itself."""
    from hyperacc import records
    from hyperacc.agent import MetricsEndpoint
    from hyperacc.schema import RankMeta, steps_dir

    columns = records.columns_of("STEP_SCHEMA")
    for rank in range(4):
        records.write_meta(tmp_path, RankMeta(rank, rank % 2, rank // 2, 4, 2, "host", 10 + rank,
                                              agent=("a:1", "b:2")[rank // 2], nodes=2))  # fmt: skip
        rows = np.full((60, len(columns)), -1, dtype=np.int64)
        for name, values in (("rank", rank), ("node", rank // 2), ("step", np.arange(60)), ("step_ns", 20_000_000),
                             ("self_ns", 15_000_000), ("comm_wait_ns", 5_000_000)):  # fmt: skip
            rows[:, columns.index(name)] = values
        records.RecordWriter(steps_dir(tmp_path, rank), "STEP_SCHEMA").write_int64(rows)
    leader = MetricsEndpoint(tmp_path, agent="a:1", address=f"127.0.0.1:{free_port()}",
                             stragglers=lambda: {3: "compute"}, job_slowdown=lambda: (1.6, "preempted"))  # fmt: skip
    other = MetricsEndpoint(tmp_path, agent="b:2", address=f"127.0.0.1:{free_port()}", stragglers=lambda: {1: "data"},
                            job_slowdown=lambda: (2.0, "compute"))  # fmt: skip
    bodies = {}
    try:
        for part in (leader, other):
            part.pass_once(final=False)
            assert part.endpoint is not None and not part.endpoint.sink.judges
            part.endpoint.follower.poll()
            bodies[part.agent] = urllib.request.urlopen(f"http://{part.address}/metrics", timeout=5).read().decode()
    finally:
        leader.stop()
        other.stop()
    for agent, mine, theirs in (("a:1", (0, 1), (2, 3)), ("b:2", (2, 3), (0, 1))):
        body = bodies[agent]
        assert all(f'hyperacc_last_step{{rank="{r}"}} 59.0' in body for r in mine), body[-1500:]
        assert not any(f'hyperacc_last_step{{rank="{r}"}}' in body or f'hyperacc_step_seconds_count{{rank="{r}"}}' in body
                       for r in theirs)  # fmt: skip
    assert 'hyperacc_straggler{kind="compute",rank="3"} 1.0' in bodies["a:1"]
    assert "hyperacc_straggler{" not in bodies["b:2"]  # only the leader exports the job's verdicts
    # ... and the slowdown of the whole job its live rule says is going on
    assert 'hyperacc_job_slowdown{kind="preempted"} 1.6' in bodies["a:1"]
    assert "hyperacc_job_slowdown{" not in bodies["b:2"]
    assert leader.endpoint is None and other.endpoint is None  # closed with the agent
    # one agent holding every rank (one node) judges the stragglers in its own sink, as before
    for rank in range(4):
        records.write_meta(tmp_path, RankMeta(rank, rank, 0, 4, 4, "host", 10 + rank, agent="a:1", nodes=1))
    alone = MetricsEndpoint(tmp_path, agent="a:1", address=f"127.0.0.1:{free_port()}")
    alone.pass_once(final=False)
    try:
        assert alone.endpoint.sink.judges
    finally:
        alone.stop()


def test_the_job_slowdown_gauge_holds_the_one_going_on_and_falls_to_zero_after() -> None:
    from prometheus_client import generate_latest

    sink = MetricsSink()
    sink.set_job_slowdown((1.75, "preempted"))
    sink.set_job_slowdown((1.5, "compute"))  # another slowdown, another kind: the first's series falls to 0
    body = generate_latest(sink.registry).decode()
    assert 'hyperacc_job_slowdown{kind="preempted"} 0.0' in body and 'hyperacc_job_slowdown{kind="compute"} 1.5' in body
    sink.set_job_slowdown(None)
    assert 'hyperacc_job_slowdown{kind="compute"} 0.0' in generate_latest(sink.registry).decode()
