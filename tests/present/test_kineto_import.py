"""Importing real torch.profiler (Kineto) traces into run directories."""

from __future__ import annotations

import gzip
import json
import statistics
import tracemalloc

import numpy as np
import pytest
from present_inputs import NCCL_TRACE, SINGLE_TRACE, write_rank_trace

from hyperacc import store
from hyperacc.present import kineto
from hyperacc.present.kineto import KinetoTraceError, import_traces, runtime_api_outliers, scan_trace


def _events(doc: dict, **match) -> list[dict]:
    return [e for e in doc["traceEvents"] if all(e.get(k) == v for k, v in match.items())]


def test_real_nccl_trace_maps_steps_phases_and_collectives(nccl_doc):
    tr = scan_trace(NCCL_TRACE)
    steps = tr.steps.to_pylist()
    profiler_steps = sorted(
        (e for e in nccl_doc["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")),
        key=lambda e: e["ts"],
    )
    assert [s["step"] for s in steps] == [int(e["name"].split("#")[1]) for e in profiler_steps]
    assert [s["step_ns"] for s in steps] == [round(e["dur"] * 1000) for e in profiler_steps]
    assert (tr.rank, tr.world_size, tr.backend, tr.device) == (0, 2, "nccl", "cuda")
    for s, e in zip(steps, profiler_steps, strict=True):
        # '## forward ##' annotation on the step's thread is the forward phase
        fwd = [a for a in _events(nccl_doc, name="## forward ##") if e["ts"] <= a["ts"] < e["ts"] + e["dur"]]
        assert s["forward_ns"] == pytest.approx(sum(a["dur"] for a in fwd) * 1000, abs=2000)
        cpu = sum(s[f"{p}_ns"] for p in ("data", "h2d", "forward", "backward", "optimizer", "other"))
        assert cpu == pytest.approx(s["step_ns"], abs=5000)
        assert s["comm_wait_ns"] > 0 and s["self_ns"] == s["step_ns"] - s["comm_wait_ns"]
        assert s["launch_ns"] > 0 and s["gc_ns"] is None  # not observable in a Kineto trace
    # every NCCL kernel becomes one collective event with its duration
    nccl = [e for e in nccl_doc["traceEvents"] if e.get("cat") == "kernel" and e["name"].startswith("nccl")]
    ev = tr.events.filter(np.array(tr.events.column("kind").to_pylist()) == "collective")
    assert ev.num_rows == len(nccl)
    assert sorted(ev.column("duration_ns").to_pylist()) == sorted(round(e["dur"] * 1000) for e in nccl)
    assert sum(s["comm_wait_ns"] for s in steps) == pytest.approx(sum(e["dur"] for e in nccl) * 1000, rel=1e-6)


def test_runtime_api_latency_matches_the_trace(nccl_doc):
    tr = scan_trace(NCCL_TRACE)
    rows = {r["api"]: r for r in tr.runtime.to_pylist()}
    launches = [e["dur"] * 1000 for e in _events(nccl_doc, cat="cuda_runtime", name="cudaLaunchKernel")]
    assert rows["cudaLaunchKernel"]["calls"] == len(launches)
    assert rows["cudaLaunchKernel"]["median_ns"] == pytest.approx(statistics.median(launches))
    assert rows["cudaLaunchKernel"]["p99_ns"] == pytest.approx(float(np.quantile(launches, 0.99)))
    assert rows["cudaMemcpyAsync"]["calls"] == len(_events(nccl_doc, cat="cuda_runtime", name="cudaMemcpyAsync"))


def test_single_rank_trace_imports_with_hostname_and_no_collectives(tmp_path):
    res = import_traces([SINGLE_TRACE], tmp_path / "run")
    assert res.errors == [] and list(res.ranks) == [0]
    meta = store.read_meta(tmp_path / "run")[0]
    assert meta.source == "kineto" and meta.world_size == 1 and meta.hostname.startswith("twshared")
    steps = store.read_steps(tmp_path / "run")
    assert steps.column("step").to_pylist() == [101, 102, 103, 104, 105]
    assert set(steps.column("comm_wait_ns").to_pylist()) == {0}


def test_chunk_boundaries_do_not_change_the_result(monkeypatch, tmp_path):
    # A trace with whitespace and numbers split across every possible chunk boundary.
    doc = {
        "schemaVersion": 1,
        "distributedInfo": {"rank": 3, "world_size": 8},
        "baseTimeNanoseconds": 1700000000000000000,
        "traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "pid": 1, "tid": 1, "ts": 100.5, "dur": 1000.25},
            {"ph": "X", "cat": "user_annotation", "name": "## forward ##", "pid": 1, "tid": 1, "ts": 110, "dur": 300},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 120, "dur": 7.5, "args": {"correlation": 9}},
            {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", "pid": 0, "tid": 7, "ts": 900, "dur": 50, "args": {"correlation": 9}},
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#8", "pid": 1, "tid": 1, "ts": 1100.75, "dur": 900},
        ],
        "traceName": "x \" \\u00e9 ]}",
    }  # fmt: skip
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc, indent=3))
    whole = scan_trace(path)
    monkeypatch.setattr(kineto, "_CHUNK_CHARS", 3)
    split = scan_trace(path)
    assert whole.steps.equals(split.steps) and whole.events.equals(split.events)
    s = whole.steps.to_pylist()
    assert [r["step"] for r in s] == [7, 8] and whole.rank == 3
    assert s[0]["t_start_ns"] == 1700000000000000000 + 100500
    assert s[0]["comm_wait_ns"] == 50_000 and s[1]["comm_wait_ns"] == 0
    assert s[0]["forward_ns"] == 300_000 and s[0]["launch_ns"] == 7_500
    assert whole.events.column("detail").to_pylist() == ["AllReduce"]


def test_scanning_keeps_memory_bounded(monkeypatch, tmp_path):
    # Memory is bounded by the chunk, not the document: events are inspected and dropped chunk by chunk.
    monkeypatch.setattr(kineto, "_CHUNK_CHARS", 1 << 16)
    plain = tmp_path / "single.json"
    with gzip.open(SINGLE_TRACE, "rb") as src:
        plain.write_bytes(src.read())
    size = plain.stat().st_size
    tracemalloc.start()
    try:
        scan_trace(plain)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 0.15 * size, f"peak {peak / 1e6:.1f} MB while scanning a {size / 1e6:.1f} MB trace"


def test_cross_rank_test_flags_the_slow_launch_rank(kineto_run):
    runtime = kineto.read_runtime_api(kineto_run)
    flagged = runtime_api_outliers(runtime).to_pylist()
    launch = {r["rank"]: r for r in flagged if r["api"] == "cudaLaunchKernel"}
    assert sorted(launch) == [0, 1, 2, 3]
    assert [r for r in launch if launch[r]["outlier"]] == [2]
    assert launch[2]["excess"] == pytest.approx(0.3, abs=0.01)
    # identical ranks are never flagged on the other APIs
    assert not any(r["outlier"] for r in flagged if r["api"] != "cudaLaunchKernel")
    steps = store.read_steps(kineto_run, columns=["rank", "launch_ns"])
    by_rank = {r: [] for r in range(4)}
    for row in steps.to_pylist():
        by_rank[row["rank"]].append(row["launch_ns"])
    assert min(by_rank[2]) > max(by_rank[0])  # the per-step launch probe shows it too
    assert {m.source for m in store.read_meta(kineto_run).values()} == {"kineto"}


def test_corrupt_and_truncated_files_are_named_and_the_rest_imported(nccl_text, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    write_rank_trace(nccl_text, src / "rank0.json.gz", 0, 3)
    text = nccl_text.replace('"rank": 0', '"rank": 1', 1)
    (src / "rank1.json").write_text(text[: len(text) // 2])  # truncated mid-array
    with gzip.open(src / "rank2.json.gz", "wb") as f:
        f.write(text.encode())
    raw = (src / "rank2.json.gz").read_bytes()
    (src / "rank2.json.gz").write_bytes(raw[: len(raw) // 3])  # truncated gzip stream
    (src / "rank3.json").write_text('{"traceEvents": [ {"ph": "X",, } ]}')  # syntax error
    res = import_traces([src], tmp_path / "run")
    assert list(res.ranks) == [0]
    failed = {p.name: msg for p, msg in res.errors}
    assert set(failed) == {"rank1.json", "rank2.json.gz", "rank3.json"}
    for name, msg in failed.items():
        assert name in msg and ("truncated or corrupt" in msg)
    assert store.read_steps(tmp_path / "run").num_rows == 3


def test_bad_inputs_get_clear_errors(tmp_path):
    (tmp_path / "nosteps.json").write_text('{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 2}]}')
    with pytest.raises(KinetoTraceError, match="nosteps.json: no ProfilerStep#N"):
        scan_trace(tmp_path / "nosteps.json")
    with pytest.raises(KinetoTraceError, match="no such trace file"):
        scan_trace(tmp_path / "missing.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(KinetoTraceError, match="no trace files"):
        import_traces([tmp_path / "empty"], tmp_path / "run")


def test_duplicate_ranks_keep_the_first_and_report_the_second(tmp_path):
    res = import_traces([NCCL_TRACE, SINGLE_TRACE], tmp_path / "run")
    assert list(res.ranks) == [0] and len(res.errors) == 1
    assert "rank 0 is also claimed" in res.errors[0][1]
    with pytest.raises(KinetoTraceError, match="already holds step records"):
        import_traces([NCCL_TRACE], tmp_path / "run")


def test_cpu_profiler_trace_from_this_torch(tmp_path):
    """A trace recorded here by torch.profiler (CPU build, gloo) imports: steps and annotated phases."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    path = tmp_path / "cpu_rank0.json"
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=1, active=4),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    ) as prof:
        for _ in range(5):
            with record_function("data_load"):
                x = torch.randn(16, 64)
            with record_function("forward"):
                loss = model(x).sum()
            with record_function("backward"):
                loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    tr = scan_trace(path)
    steps = tr.steps.to_pylist()
    assert len(steps) == 4 and tr.device == "cpu"
    for s in steps:
        assert s["data_ns"] > 0 and s["forward_ns"] > 0 and s["backward_ns"] > 0 and s["optimizer_ns"] > 0
        assert s["comm_wait_ns"] is None and s["launch_ns"] is None
