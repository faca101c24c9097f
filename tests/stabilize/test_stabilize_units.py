"""Stabilizer parts in one process: configuration, GC schedule, memory release, allocator settings,
sync audit patching."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import inspect
import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap
import time
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from hyperacc import stabilize as S
from hyperacc.stabilize import allocator, memory
from hyperacc.stabilize.gc_schedule import NO_FULL, GCSchedule


@pytest.fixture(autouse=True)
def restore_gc():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if enabled:
        gc.enable()


@pytest.fixture(autouse=True)
def restore_allocator_environment():
    """A stabilizer's allocator settings go into this process's environment, as they must before CUDA
    starts: put them back, or every later process this pytest worker starts inherits them."""
    names = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
    before = {name: os.environ.get(name) for name in names}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# ------------------------------------------------------------------ configuration


def test_defaults_and_parts_on_off() -> None:
    cfg = S.config_from_dict({})
    assert cfg.gc is not None and cfg.gc.interval == "auto" and cfg.gc.generation == 2
    assert cfg.release_interval() == cfg.gc.max_interval == 400  # memory follows auto's ceiling
    assert cfg.memory is not None and cfg.allocator is not None
    assert cfg.affinity is None and cfg.sync_audit is None
    assert cfg.gc.young == "automatic" and cfg.gc.cost_budget_frac == 0.01
    cfg = S.config_from_dict({"gc": {"interval": 50, "young": "scheduled", "generation": 1}, "memory": False, "affinity": True,
                              "sync_audit": {"enabled": False}})  # fmt: skip
    assert cfg.gc.interval == 50 and cfg.gc.generation == 1
    assert cfg.memory is None and cfg.affinity is not None and cfg.sync_audit is None


def test_bad_configuration_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['gcc'\]"):
        S.config_from_dict({"gcc": True})
    with pytest.raises(ValueError, match=r"unknown gc option\(s\) \['every'\]"):
        S.config_from_dict({"gc": {"every": 5}})
    with pytest.raises(ValueError, match="gc.interval must be a whole number of steps >= 1 or 'auto'"):
        S.config_from_dict({"gc": {"interval": 0}})
    with pytest.raises(ValueError, match="gc.interval must be"):
        S.config_from_dict({"gc": {"interval": "sometimes"}})
    with pytest.raises(ValueError, match="gc.pause_budget_ms must be > 0"):
        S.config_from_dict({"gc": {"pause_budget_ms": -1}})
    with pytest.raises(ValueError, match="affinity.main_cores must be >= 1"):
        S.config_from_dict({"affinity": {"main_cores": 0}})
    with pytest.raises(ValueError, match="memory.interval must be"):
        S.config_from_dict({"memory": {"interval": 0}})
    with pytest.raises(ValueError, match="gc.workers must be one of"):
        S.config_from_dict({"gc": {"workers": "never"}})
    with pytest.raises(ValueError, match="gc.young must be one of"):
        S.config_from_dict({"gc": {"young": "never"}})
    with pytest.raises(ValueError, match="gc.generation 1 needs gc.young 'scheduled'"):
        S.config_from_dict({"gc": {"generation": 1}})


def test_config_files(tmp_path: Path) -> None:
    toml = tmp_path / "stab.toml"
    toml.write_text("[stabilize.gc]\ninterval = 200\nyoung = \"scheduled\"\ngeneration = 1\n\n[stabilize.memory]\nenabled = false\n")
    values = S.load_config(toml)
    cfg = S.config_from_dict(values)
    assert cfg.gc.interval == 200 and cfg.gc.generation == 1 and cfg.memory is None
    js = tmp_path / "stab.json"
    js.write_text(json.dumps({"gc": {"interval": 30}, "sync_audit": True}))
    cfg = S.config_from_dict(S.load_config(js))
    assert cfg.gc.interval == 30 and cfg.sync_audit is not None
    bad = tmp_path / "bad.toml"
    bad.write_text("[gc\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        S.load_config(bad)
    with pytest.raises(ValueError, match="cannot read stabilizer config"):
        S.load_config(tmp_path / "missing.toml")


def test_from_env(tmp_path: Path) -> None:
    assert S.from_env({}) is None
    assert S.from_env({S.ENV_VAR: "0"}) is None
    stab = S.from_env({S.ENV_VAR: json.dumps({"gc": {"interval": 7, "valve": False}, "memory": False})})
    try:
        assert stab.config.gc.interval == 7 and stab.config.memory is None
        assert gc.isenabled() and gc.get_threshold()[2] == NO_FULL  # full collections on the schedule only
    finally:
        stab.close()
    assert gc.isenabled()
    with pytest.raises(ValueError, match="HYPERACC_STABILIZE is not valid JSON"):
        S.from_env({S.ENV_VAR: "{gc: 1}"})
    with pytest.raises(ValueError, match="neither JSON"):
        S.from_env({S.ENV_VAR: str(tmp_path / "nope.toml")})
    path = tmp_path / "s.toml"
    path.write_text("[gc]\ninterval = 11\nvalve = false\n")
    stab = S.from_env({S.ENV_VAR: str(path)})
    try:
        assert stab.config.gc.interval == 11
    finally:
        stab.close()


def test_launch_env_round_trips() -> None:
    env = S.launch_env(gc={"interval": 123}, affinity={"workers_per_rank": 2})
    assert env["TCMALLOC_RELEASE_RATE"] == "0"
    assert "expandable_segments:True" in env["PYTORCH_ALLOC_CONF"]
    assert env["PYTORCH_ALLOC_CONF"] == env["PYTORCH_CUDA_ALLOC_CONF"]
    cfg = S.config_from_dict(json.loads(env[S.ENV_VAR]))
    assert cfg.gc.interval == 123 and cfg.affinity.workers_per_rank == 2


# ------------------------------------------------------------------ allocator settings


def test_alloc_conf_parse_and_merge() -> None:
    text = "roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:False"
    assert allocator.parse_alloc_conf(text) == {
        "roundup_power2_divisions": "[256:1,512:2,>:4]",
        "expandable_segments": "False",
    }
    value, notes = allocator.merged_alloc_conf({}, {"expandable_segments": "True"})
    assert value == "expandable_segments:True" and notes == []
    value, notes = allocator.merged_alloc_conf(
        {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"}, {"expandable_segments": "True"}
    )
    assert value == "max_split_size_mb:256,expandable_segments:True"
    value, notes = allocator.merged_alloc_conf({"PYTORCH_ALLOC_CONF": text}, {"expandable_segments": "True"})
    assert "expandable_segments:False" in value and any("kept the user's" in n for n in notes)
    value, notes = allocator.merged_alloc_conf(
        {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64,backend:native"},
        {"expandable_segments": "True"},
    )  # fmt: skip
    assert value == "max_split_size_mb:128,backend:native,expandable_segments:True"
    assert any("differ" in n for n in notes)
    with pytest.raises(ValueError, match="PYTORCH_ALLOC_CONF='garbage'"):
        allocator.merged_alloc_conf({"PYTORCH_ALLOC_CONF": "garbage"}, {})


def test_configure_writes_both_variables_and_counters_are_empty_on_cpu() -> None:
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"}
    done = allocator.configure(env)
    assert env["PYTORCH_ALLOC_CONF"] == env["PYTORCH_CUDA_ALLOC_CONF"] == done["value"]
    assert done["too_late"] is False
    if not torch.cuda.is_available():
        assert allocator.stall_counters() == {}
        assert allocator.StallCounterDeltas().delta() == {}


# ------------------------------------------------------------------ memory release


def test_host_allocator_detection() -> None:
    alloc = memory.detect_host_allocator()
    libc = ctypes.CDLL(None)
    if hasattr(libc, "gnu_get_libc_version") and not os.environ.get("LD_PRELOAD"):
        assert alloc.name == "glibc"
    # release() calls the allocator's release function and returns how long the call took: a real call
    # takes time (the return of freed memory itself is measured in RSS by the probes below); an
    # allocator with nothing to call gives 0.
    ns = memory.release(alloc)
    assert ns > 0 if alloc.can_release else ns == 0, (alloc.name, ns)
    none = memory.detect_host_allocator(types.SimpleNamespace())  # a symbol table without any allocator
    assert none.name == "none" and memory.release(none) == 0
    assert memory.hold_freed_memory(none).startswith("no known allocator")
    assert memory.rss_bytes() > 0


RELEASE_PROBE = textwrap.dedent(
    """
    import json
    from hyperacc.stabilize import memory
    alloc = memory.detect_host_allocator()
    held = memory.hold_freed_memory(alloc)
    blocks = [bytearray(64 * 1024) for _ in range(4000)]  # ~256 MB in heap-sized blocks
    for b in blocks:
        b[::4096] = b"x" * len(b[::4096])
    peak = memory.rss_bytes()
    del blocks
    held_rss = memory.rss_bytes()
    ns = memory.release(alloc)
    print(json.dumps({"name": alloc.name, "held": held, "peak": peak, "held_rss": held_rss,
                      "after": memory.rss_bytes(), "ns": ns}))
    """
)


def _probe(env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True, timeout=60,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_glibc_holds_freed_memory_until_the_scheduled_release() -> None:
    res = _probe()
    if res["name"] != "glibc":
        pytest.skip(f"host allocator is {res['name']}")
    mb = 2**20
    assert res["peak"] - res["held_rss"] < 64 * mb, res  # freed memory stays resident (held) ...
    assert res["held_rss"] - res["after"] > 128 * mb, res  # ... until the release returns it


def test_gperftools_tcmalloc_is_detected_and_released() -> None:
    lib = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if lib is None:
        pytest.skip("gperftools tcmalloc not installed (apt-get install libtcmalloc-minimal4)")
    path = next(
        (
            p
            for p in (f"/usr/lib/x86_64-linux-gnu/{lib}", f"/lib/x86_64-linux-gnu/{lib}")
            if os.path.exists(p)
        ),
        lib,
    )
    res = _probe({"LD_PRELOAD": path, "TCMALLOC_RELEASE_RATE": "0"})
    assert res["name"] == "tcmalloc-gperftools"
    assert "release rate 0" in res["held"]
    assert res["held_rss"] - res["after"] > 64 * 2**20, res


# ------------------------------------------------------------------ deterministic GC


def run_steps(stab: S.Stabilizer, steps: range, pause: float = 0.0) -> None:
    for step in steps:
        stab.step(step)
        if pause:
            time.sleep(pause)


def test_scheduled_collections_at_multiples_of_the_interval() -> None:
    stab = S.stabilize(gc={"interval": 10, "young": "scheduled", "generation": 1, "valve": False},
                       memory={"interval": 15})  # fmt: skip
    try:
        assert not gc.isenabled()
        run_steps(stab, range(0, 36))
        assert gc.get_freeze_count() > 0
    finally:
        summary = stab.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    kinds = [(r["kind"], r["step"]) for r in stab.records if r["step"] >= 0]
    assert kinds[0] == ("gc_freeze", 0)
    assert [s for k, s in kinds if k == "gc_collect"] == [10, 20, 30]
    assert [s for k, s in kinds if k == "memory_release"] == [15, 30]
    assert all(r["detail"].startswith("scheduled gen=1 young=") for r in stab.records if r["kind"] == "gc_collect")
    assert summary["gc"]["scheduled"] == 3 and summary["gc"]["scheduled_ms_max"] >= 0


def test_resumed_run_keeps_the_global_alignment() -> None:
    stab = S.stabilize(gc={"interval": 100, "freeze": False, "valve": False}, memory=False)
    try:
        run_steps(stab, range(1234, 1420))
    finally:
        stab.close()
    assert [r["step"] for r in stab.records if r["kind"] == "gc_collect"] == [1300, 1400]


def test_valve_collects_early_when_garbage_piles_up() -> None:
    stab = S.stabilize(
        gc={"interval": 10_000, "young": "scheduled", "valve_objects": 20_000, "valve_rss_mb": None, "valve_poll_s": 0.02,
            "valve_lead_steps": 2, "valve_lead_s": 0.0},
        memory=False,
    )  # fmt: skip
    keep = []
    try:
        for step in range(2000):  # stops as soon as the valve collected
            stab.step(step)
            if step == 5:  # the garbage of step 5, made once the step is under way (the valve's thread
                # polls every 20 ms: garbage made before stab.step(5) can be seen while step 4 is the last)
                for _ in range(30_000):
                    a: list = []
                    a.append(a)
            time.sleep(0.005)
            if any(r["kind"] == "gc_collect" for r in stab.records):
                break
        keep.append(gc.get_count())
    finally:
        stab.close()
    valve = [r for r in stab.records if r["kind"] == "gc_collect"]
    assert valve and valve[0]["detail"].startswith("valve proposer=0"), stab.records
    assert valve[0]["value"] >= 29_000  # it collected the cycles (the last one is still referenced)
    proposed = [r for r in stab.records if r["kind"] == "gc_valve_proposed"][0]
    assert proposed["step"] >= 5
    # collected at the proposed step, or (a thread descheduled on a loaded machine) one step later, said so
    assert valve[0]["step"] == proposed["value"] or "late" in valve[0]["detail"]


def test_no_store_warning_before_the_process_group_starts(monkeypatch, caplog) -> None:
    """``hyperacc run --stabilize`` starts the stabilizer before the script's init_process_group: the GC
    thread finds no store at first, which is no reason to say it will decide alone (it finds it later)."""
    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level(logging.WARNING, logger="hyperacc.stabilize"):
        stab = S.stabilize(gc={"interval": 10, "valve_poll_s": 0.01}, memory=False)
        try:
            for step in range(30):
                stab.step(step)
                time.sleep(0.01)
        finally:
            stab.close()
    assert stab.world_size == 2
    assert "no c10d store" not in caplog.text, caplog.text


def test_cost_model_fits_fixed_and_per_object_cost() -> None:
    from hyperacc.stabilize.gc_schedule import choose_interval, fit_cost_model

    # pause = 2 ms + 100 ns per object; 10k objects per step; 20 ms of work per step
    samples, t = [], 0
    for k in (1, 1, 4, 1, 4, 8):
        n = 10_000 * k
        d = 2_000_000 + 100 * n
        t += k * 20_000_000
        samples.append((t, n, d, k))
        t += d
    model = fit_cost_model(samples)
    assert model is not None
    assert model.fixed_ns == pytest.approx(2e6, rel=1e-6) and model.per_object_ns == pytest.approx(100, rel=1e-6)
    assert model.objects_per_step == pytest.approx(10_000) and model.step_ns == pytest.approx(20e6, rel=1e-6)
    # budget 10 ms: 2 ms + 1 ms per step of interval -> 8 steps; the pause fits, one more does not
    assert choose_interval(model, 10e6, 400) == 8
    assert model.pause_ns(8) <= 10e6 < model.pause_ns(9)
    assert model.cost_per_step_ns(8) == pytest.approx(2e6 / 8 + 1e6)  # a longer interval spreads the fixed part
    assert choose_interval(model, 1e12, 400) == 400  # capped
    # fixed cost above the budget: where the per-object part equals it (pause ~ 2x fixed)
    assert choose_interval(model, 1e6, 400) == 2
    # one interval only (calibration): proportional model, which over-predicts a longer interval's pause
    flat = fit_cost_model([(i * 30_000_000, 10_000, 3_000_000, 1) for i in range(10)])
    assert flat.fixed_ns == 0 and flat.per_object_ns == pytest.approx(300)
    assert choose_interval(flat, 10e6, 400) == 3
    assert fit_cost_model([(0, 10, 5, 1)]) is None


def make_cycles(n: int, held: list | None = None) -> None:
    """``n`` reference cycles; with ``held``, each kept alive there until all ``n`` are made (long
    enough for young collections to promote some), then dropped."""
    for _ in range(n):
        a: list = []
        a.append(a)
        if held is not None:
            held.append(a)
    if held is not None:
        held.clear()


def run_until_agreed(stab: S.Stabilizer, make_garbage: Callable[[], None]) -> tuple[int, dict]:
    """Steps (2 ms each, with ``make_garbage``) until an auto interval is agreed and 200 steps ran; the
    last step and the summary. Closes the stabilizer."""
    try:
        step = 0
        while step < 3000:
            make_garbage()
            stab.step(step)
            time.sleep(0.002)
            if stab.summary()["gc"]["agreements"] and step > 200:
                break
            step += 1
        return step, stab.summary()
    finally:
        stab.close()


@pytest.mark.parametrize(("budget_ms", "expected", "freeze"), [(1e6, 40, True), (1e-6, 1, True), (1e6, 40, False)])
def test_auto_interval_follows_the_budget_in_one_process(budget_ms: float, expected: int, freeze: bool) -> None:
    stab = S.stabilize(
        gc={"interval": "auto", "young": "scheduled", "pause_budget_ms": budget_ms, "max_interval": 40,
            "calibration_steps": 5,
            "valve": False, "valve_poll_s": 0.01, "freeze": freeze},
        memory=False, allocator=False,
    )  # fmt: skip
    step, summary = run_until_agreed(stab, lambda: make_cycles(500))
    assert summary["gc"]["agreements"] == 1 and summary["gc"]["interval"] == expected
    plan = [r for r in stab.records if r["kind"] == "gc_auto_interval"]
    assert len(plan) == 1 and plan[0]["value"] == expected and "per_object_ns=" in plan[0]["detail"]
    start = summary["gc"]["plan_start"]
    steps = [r["step"] for r in stab.records if r["kind"] == "gc_collect"]
    assert steps[:5] == [1, 2, 3, 4, 5]  # calibration: every step after the first (and its freeze)
    before = [s for s in steps if s < start]
    assert before == list(range(1, start))  # every step until the agreed plan starts
    assert [s for s in steps if s >= start] == list(range(start, step + 1, expected))


def test_cost_floor_keeps_a_collection_from_repeating_its_fixed_part() -> None:
    from hyperacc.stabilize.gc_schedule import CostModel, choose_interval

    # a full collection: 5 ms walking what lives, + 0.5 ms per step of interval; 10 ms steps
    model = CostModel(fixed_ns=5e6, per_object_ns=0.5e6, objects_per_step=1.0, step_ns=10e6, samples=6)
    assert choose_interval(model, 0.5e6, 400) == 10  # pause rule alone: pause 2 x fixed, 0.5 ms per step
    # the fixed part spread over the interval at most 1 % of a step: every 50 steps (0.1 ms per step)
    assert choose_interval(model, 0.5e6, 400, cost_frac=0.01) == 50
    assert choose_interval(model, 0.5e6, 40, cost_frac=0.01) == 40  # never past max_interval
    # a budget the pause fits at a longer interval: that one (it costs less still)
    assert choose_interval(model, 60e6, 400, cost_frac=0.01) == 110


def test_a_full_collection_model_never_loses_its_fixed_part() -> None:
    from hyperacc.stabilize.gc_schedule import choose_interval, fit_cost_model

    # full collections that freed few objects, the pause mostly fixed but a noisy, steep line (fixed < 0)
    samples, t = [], 0
    for k, n, pause_ms in ((1, 40, 0.9), (2, 60, 1.0), (4, 90, 1.6), (8, 100, 2.0), (16, 110, 2.2)):
        t += k * 6_000_000
        samples.append((t, n, int(pause_ms * 1e6), k))
        t += int(pause_ms * 1e6)
    proportional = fit_cost_model(samples)
    assert proportional.fixed_ns == 0  # young objects scheduled: the proportional model (safe there)
    model = fit_cost_model(samples, flat="fixed")
    assert model.fixed_ns == pytest.approx(0.9e6) and model.per_object_ns > 0
    # the cost rule keeps the smallest pause under 1 % of a 6 ms step: not a full collection every step
    assert choose_interval(model, 0.3e6, 400, cost_frac=0.01) >= 15
    assert choose_interval(proportional, 0.3e6, 400, cost_frac=0.01) == 1


def test_young_collections_stay_with_cpython_and_full_ones_follow_the_schedule() -> None:
    before = gc.get_threshold()
    stab = S.stabilize(gc={"interval": 10, "valve": False}, memory=False, allocator=False)
    full_before = gc.get_stats()[2]["collections"]
    held: list = []
    try:
        for step in range(45):
            for _ in range(3000):  # cycles alive for a step: promoted by young collections, freed by a full one
                a: list = []
                a.append(a)
                held.append(a)
            if step % 2:
                held.clear()
            stab.step(step)
            assert gc.isenabled() and gc.get_threshold() == (before[0], before[1], NO_FULL)
        young_collections = gc.get_stats()[0]["collections"]
        full = gc.get_stats()[2]["collections"] - full_before
    finally:
        stab.close()
    assert gc.get_threshold() == before and gc.isenabled()
    collected = [r for r in stab.records if r["kind"] == "gc_collect"]
    assert [r["step"] for r in collected] == [10, 20, 30, 40]
    assert full == 1 + len(collected)  # the freeze's collection and the scheduled ones, none of CPython's own
    assert young_collections > 100  # CPython kept collecting the young generations itself
    assert sum(r["value"] for r in collected) > 10_000  # the promoted cycles were freed on the schedule


def test_auto_with_young_collections_automatic_calibrates_at_doubling_intervals() -> None:
    stab = S.stabilize(
        gc={"interval": "auto", "max_interval": 64, "calibration_steps": 16, "valve": False, "valve_poll_s": 0.01},
        memory=False, allocator=False,
    )  # fmt: skip
    held: list = []
    step, summary = run_until_agreed(stab, lambda: make_cycles(2000, held))
    steps = [r["step"] for r in stab.records if r["kind"] == "gc_collect"]
    assert steps[:5] == [1, 2, 4, 8, 16]  # what accumulates over 1 to 16 steps: the fixed part and the growth
    plans = [int(r["value"]) for r in stab.records if r["kind"] == "gc_auto_interval"]
    assert plans and all(1 <= p <= 64 for p in plans) and plans == sorted(plans, reverse=True)
    first = next(r for r in stab.records if r["kind"] == "gc_auto_interval")
    fixed_ms, step_ms = (float(first["detail"].split(f"{k}=")[1].split()[0]) for k in ("fixed_ms", "step_ms"))
    # the fixed part spread over the interval fits the cost budget (1 % of a step), or the ceiling holds
    assert plans[0] == 64 or fixed_ms / plans[0] <= 0.01 * step_ms * 1.01
    rate = float(first["detail"].split("objects_per_step=")[1].split()[0])
    assert rate > 100  # garbage that outlived young collections reached the full ones (2,000 cycles a step)
    start, interval = summary["gc"]["plan_start"], summary["gc"]["interval"]
    assert [s for s in steps if s >= start] == list(range(start, step + 1, interval))


def test_forked_children_get_cpythons_thresholds_back() -> None:
    before = gc.get_threshold()
    stab = S.stabilize(gc={"valve": False}, memory=False, allocator=False)
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            os.write(w, json.dumps([gc.isenabled(), *gc.get_threshold()]).encode())
            os._exit(0)
        os.close(w)
        state = json.loads(os.read(r, 200))
        os.close(r)
        os.waitpid(pid, 0)
    finally:
        stab.close()
    assert state == [True, *before]


def test_forked_children_get_automatic_gc_back() -> None:
    def child_gc_state(policy: str) -> bool:
        stab = S.stabilize(gc={"workers": policy, "young": "scheduled", "valve": False}, memory=False,
                               allocator=False)  # fmt: skip
        try:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                os.write(w, b"1" if gc.isenabled() else b"0")
                os._exit(0)
            os.close(w)
            state = os.read(r, 1)
            os.close(r)
            os.waitpid(pid, 0)
            return state == b"1"
        finally:
            stab.close()

    assert child_gc_state("enable") is True
    assert child_gc_state("inherit") is False


class GCProbe(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[bool, bool]:
        return gc.isenabled(), bool(os.environ.get("HYPERACC_TEST_USER_INIT"))


def mark_user_init(worker_id: int) -> None:
    os.environ["HYPERACC_TEST_USER_INIT"] = "1"


def test_dataloader_workers_compose_with_the_users_init() -> None:
    stab = S.stabilize(gc={"valve": False}, memory=False, allocator=False)
    try:
        loader = DataLoader(GCProbe(), batch_size=None, num_workers=2, worker_init_fn=mark_user_init,
                            multiprocessing_context="fork")  # fmt: skip
        stab.attach(loader)
        assert isinstance(loader.worker_init_fn, S.WorkerInit)
        got = list(loader)
    finally:
        stab.close()
    assert [list(g) for g in got] == [[True, True]] * 4  # GC on in every worker, user init ran
    # spawn/forkserver workers receive the worker_init_fn pickled
    clone = pickle.loads(pickle.dumps(loader.worker_init_fn))
    assert clone.user_fn is mark_user_init and clone.gc_policy == "enable"


def test_internal_error_switches_the_part_off_with_one_line(monkeypatch, caplog) -> None:
    def broken(self, step, reason):
        raise RuntimeError("boom")

    monkeypatch.setattr(GCSchedule, "collect", broken)
    stab = S.stabilize(gc={"interval": 2, "freeze": False, "valve": False}, memory={"interval": 3})
    with caplog.at_level(logging.WARNING, logger="hyperacc"):
        run_steps(stab, range(0, 12))
    summary = stab.close()
    assert list(summary["disabled"]) == ["gc"]
    assert gc.isenabled()  # the switched-off part gave automatic GC back
    lines = [r for r in caplog.records if "switched off" in r.getMessage()]
    assert len(lines) == 1 and "gc" in lines[0].getMessage()
    assert [r["step"] for r in stab.records if r["kind"] == "memory_release"] == [3, 6, 9]  # the rest goes on


def test_records_are_written_as_events(tmp_path: Path) -> None:
    from hyperacc.store import read_events

    (tmp_path / "meta").mkdir()  # a run directory (the tracer writes meta/ and steps/ beside the events)
    stab = S.stabilize(gc={"interval": 3, "valve": False}, memory=False, run_dir=str(tmp_path))
    run_steps(stab, range(0, 7))
    stab.close()
    events = read_events(tmp_path).to_pylist()
    assert [(e["kind"], e["step"]) for e in events if e["kind"] == "gc_collect"] == [
        ("gc_collect", 3),
        ("gc_collect", 6),
    ]
    assert all(e["rank"] == 0 for e in events)


# ------------------------------------------------------------------ sync audit (one process)


def _audited_loop(stab: S.Stabilizer, steps: int = 5) -> tuple[int, dict]:
    """A loop with the host syncs a user writes, plus Adam and a shuffling DataLoader (whose own
    internal .item() calls are not the user's). Returns the line of the first sync and the report."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(list(range(20)), batch_size=4, shuffle=True)
    x = torch.ones(3)
    line = 0
    for step, _batch in enumerate(loader):
        if step == steps:
            break
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        x.sum().item()
        line = inspect.currentframe().f_lineno - 1
        if x.sum() > 0:  # bool(tensor)
            pass
        float(x.sum())
        int(x.sum())
        x.cpu()
        stab.step(step)
    return line, stab.audit_report()


def test_audit_counts_no_host_sync_of_cpu_tensors_and_says_what_it_sees(cpu_job: None) -> None:
    original_item, original_barrier = torch.Tensor.item, dist.barrier
    stab = S.stabilize(gc=False, memory=False, allocator=False, sync_audit=True)
    try:
        _, report = _audited_loop(stab)
    finally:
        stab.close()
    assert [s for s in report["sites"] if s["kind"] == "host_sync"] == []  # nothing here waits on a device
    assert report["visibility"].startswith("CPU-only run")
    assert "cpu_as_device" in report["visibility"]
    assert torch.Tensor.item is original_item and "item" not in vars(torch.Tensor)
    assert dist.barrier is original_barrier


def test_audit_dry_run_lists_the_users_host_syncs_only(cpu_job: None) -> None:
    stab = S.stabilize(gc=False, memory=False, allocator=False, sync_audit={"cpu_as_device": True})
    try:
        line, report = _audited_loop(stab)
    finally:
        stab.close()
    here = __file__
    sites = {(s["kind"], s["site"]): s for s in report["sites"]}
    for offset in (0, 2, 4, 5):  # .item(), bool(), float(), int(); .cpu() of a CPU tensor copies nothing
        assert sites[("host_sync", f"{here}:{line + offset}")]["calls"] == 5, sites
    # AdamW's and the sampler's own .item() calls (inside torch) are not reported
    assert all(s["site"].startswith(here) for s in report["sites"]), report["sites"]
    assert len(sites) == 4
    assert report["visibility"].startswith("dry run")
    recorded = [r["detail"] for r in stab.records if r["kind"] == "sync_site"]
    assert any(f"host_sync {here}:{line} calls=5" in d for d in recorded)  # the report lands in the events


def test_to_host_blocking_reads_every_form_of_to() -> None:
    from hyperacc.stabilize.sync_audit import _to_host_blocking

    assert _to_host_blocking(("cpu",), {})
    assert _to_host_blocking((torch.device("cpu"), torch.float32), {})
    assert _to_host_blocking((), {"device": "cpu"})
    assert _to_host_blocking((torch.ones(1),), {})
    assert not _to_host_blocking(("cpu",), {"non_blocking": True})
    assert not _to_host_blocking(("cpu", torch.float16, True), {})
    assert not _to_host_blocking((torch.float16,), {})
    assert not _to_host_blocking(("meta",), {})


def test_only_one_audit_at_a_time() -> None:
    stab = S.stabilize(gc=False, memory=False, allocator=False, sync_audit=True)
    try:
        other = S.stabilize(gc=False, memory=False, allocator=False, sync_audit=True)
        assert "sync_audit" in other.disabled
        other.close()
    finally:
        stab.close()


def test_records_go_through_an_active_tracer_once(tmp_path: Path) -> None:
    from hyperacc.store import read_events
    from hyperacc.trace.tracer import Tracer

    tracer = Tracer(tmp_path)
    stab = S.stabilize(gc={"interval": 3, "valve": False}, memory=False, run_dir=str(tmp_path))
    try:
        run_steps(stab, range(0, 7))
    finally:
        stab.close()
        tracer.close()
    kinds = [(e["kind"], e["step"]) for e in read_events(tmp_path).to_pylist()]
    assert kinds.count(("gc_collect", 3)) == 1 and kinds.count(("gc_collect", 6)) == 1


def test_from_env_twice_is_one_stabilizer_and_repeated_steps_are_ignored() -> None:
    env = {S.ENV_VAR: json.dumps({"gc": {"interval": 2, "valve": False}, "memory": False})}
    first = S.from_env(env)
    try:
        assert S.from_env(env) is first  # e.g. `hyperacc run` bootstrap, then the script itself
        for step in range(5):
            first.step(step)
            first.step(step)  # the tracer's step hook and the script both call it
    finally:
        first.close()
    assert [r["step"] for r in first.records if r["kind"] == "gc_collect"] == [2, 4]
    second = S.from_env(env)
    try:
        assert second is not first  # a closed one is not handed out again
    finally:
        second.close()
