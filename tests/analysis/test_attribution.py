"""Causes of spikes from hand-made step columns of one rank."""

import numpy as np
import pytest

from hyperacc.analysis.attribution import attribute_spikes
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.spikes import detect_spikes, spike_metric

MS = 1e6
N = 400


def base_columns(seed=0):
    rng = np.random.default_rng(seed)

    def phase(ms):
        return ms * MS * rng.lognormal(0, 0.02, N)

    cols = {
        "step": np.arange(N),
        "data_ns": phase(2),
        "h2d_ns": phase(0.5),
        "forward_ns": phase(10),
        "backward_ns": phase(20),
        "optimizer_ns": phase(3),
        "other_ns": phase(1),
        "comm_wait_ns": phase(2),
        "gc_ns": np.zeros(N),
        "alloc_retries": np.zeros(N),
        "sync_all_streams": np.zeros(N),
        "major_faults": np.zeros(N),
        "invol_ctx_switches": rng.poisson(3, N).astype(float),
    }
    return cols


def finish(cols):
    cols["self_ns"] = cols["data_ns"] + cols["h2d_ns"] + cols["forward_ns"] + cols["backward_ns"]
    cols["step_ns"] = cols["self_ns"] + cols["comm_wait_ns"] + cols["optimizer_ns"] + cols["other_ns"]
    return cols


def causes_at(cols, steps):
    opts = DetectionOptions()
    x = spike_metric(finish(cols), opts)
    sp = detect_spikes(x, opts)
    idx = np.flatnonzero(sp.spike)
    assert idx.tolist() == sorted(steps), "the injected steps are the spikes"
    causes, phases = attribute_spikes(cols, idx, sp.excess[idx], x, opts)
    return dict(zip(idx.tolist(), causes.tolist(), strict=True)), dict(
        zip(idx.tolist(), phases.tolist(), strict=True)
    )


def test_each_cause_from_the_phase_that_grew_and_the_signals():
    cols = base_columns()
    cols["data_ns"][50] += 40 * MS  # a data stall
    cols["forward_ns"][100] += 30 * MS  # a GC pause inside forward
    cols["gc_ns"][100] = 30 * MS
    cols["backward_ns"][150] += 25 * MS  # allocator retry
    cols["alloc_retries"][150] = 1
    cols["forward_ns"][200] += 25 * MS  # preempted: far more involuntary switches than 25 ms explains
    cols["invol_ctx_switches"][200] = 60
    cols["backward_ns"][250] += 25 * MS  # compute grew, nothing coincided
    causes, phases = causes_at(cols, [50, 100, 150, 200, 250])
    assert causes == {50: "data", 100: "gc", 150: "allocator", 200: "host", 250: "compute"}
    assert phases[50] == "data_ns" and phases[250] == "backward_ns"


def test_a_longer_step_at_the_usual_switch_rate_is_not_a_host_problem():
    cols = base_columns()
    cols["invol_ctx_switches"] = cols["invol_ctx_switches"] * 0 + 6.0
    cols["backward_ns"][120] += 40 * MS  # 36 -> 76 ms: about twice the switches at the same rate
    cols["invol_ctx_switches"][120] = 13.0
    causes, _ = causes_at(cols, [120])
    assert causes == {120: "compute"}


def test_unknown_when_nothing_explains_the_spike():
    cols = base_columns()
    for name in ("data_ns", "h2d_ns", "forward_ns", "backward_ns"):
        cols[name][:] = np.nan  # only self-time is recorded
    finish(cols)
    cols["self_ns"] = 33 * MS * np.random.default_rng(2).lognormal(0, 0.02, N)
    cols["self_ns"][77] += 30 * MS
    opts = DetectionOptions()
    sp = detect_spikes(cols["self_ns"], opts)
    idx = np.flatnonzero(sp.spike)
    causes, phases = attribute_spikes(cols, idx, sp.excess[idx], cols["self_ns"], opts)
    assert idx.tolist() == [77] and causes.tolist() == ["unknown"] and phases.tolist() == [None]


def test_two_small_growths_that_do_not_explain_half_stay_unknown():
    cols = base_columns()
    cols["data_ns"][60] += 6 * MS
    cols["forward_ns"][60] += 6 * MS
    finish(cols)
    cols["self_ns"][60] += 12 * MS  # 24 ms of excess, 6 + 6 explained by two different groups
    opts = DetectionOptions()
    sp = detect_spikes(cols["self_ns"], opts)
    idx = np.flatnonzero(sp.spike)
    causes, _ = attribute_spikes(cols, idx, sp.excess[idx], cols["self_ns"], opts)
    assert causes.tolist() == ["unknown"]


@pytest.mark.parametrize("signal", ["major_faults", "sync_all_streams"])
def test_counters_coinciding_with_unexplained_growth(signal):
    cols = base_columns()
    cols["forward_ns"][90] += 30 * MS
    cols[signal][90] = 3
    causes, _ = causes_at(cols, [90])
    assert causes == {90: "host" if signal == "major_faults" else "allocator"}


def _with_cpu(cols, seed=1):
    rng = np.random.default_rng(seed)
    cols["cpu_ns"] = (cols["forward_ns"] + cols["backward_ns"]) * 0.95
    cols["sys_cpu_ns"] = 0.2 * MS * rng.lognormal(0, 0.1, N)
    cols["minor_faults"] = rng.poisson(2, N).astype(float)
    cols["vol_ctx_switches"] = np.full(N, 2.0)
    return cols


def _worked(cols, step, sys_ms=0.0, faults=0, blocked=0):
    """30 ms more work in the forward at ``step``, ``sys_ms`` of it in the kernel."""
    cols["forward_ns"][step] += 30 * MS
    cols["cpu_ns"][step] += 30 * MS
    cols["sys_cpu_ns"][step] += sys_ms * MS
    if "minor_faults" in cols:
        cols["minor_faults"][step] += faults
    cols["vol_ctx_switches"][step] += blocked


def test_work_whose_extra_cpu_time_is_the_kernels_faulting_in_pages_is_page_faults():
    cols = _with_cpu(base_columns())
    _worked(cols, 60, sys_ms=24, faults=150)  # a fresh 300 MB buffer: the kernel zeroes its pages
    _worked(cols, 120)  # the same work in user space (no kernel time, no faults): compute
    _worked(cols, 180, sys_ms=6, faults=150)  # faults, but the kernel's share is small (then computed on)
    _worked(cols, 240, sys_ms=24)  # kernel time without more faults (a system call's work, not paging)
    # a checkpoint written and flushed: kernel time, the serialised buffer's faults, and the thread
    # blocked on the flush: not paging
    _worked(cols, 300, sys_ms=24, faults=4000, blocked=20)
    _worked(cols, 360, sys_ms=24, faults=1)  # one fault cannot account for 24 ms (a large write)
    causes, _ = causes_at(cols, [60, 120, 180, 240, 300, 360])
    assert causes == {60: "page_faults", 120: "compute", 180: "compute", 240: "compute", 300: "compute", 360: "compute"}


def test_page_faults_need_the_kernel_time_and_the_faults_columns():
    cols = _with_cpu(base_columns())
    del cols["minor_faults"]  # records written before the column: the rule abstains
    _worked(cols, 60, sys_ms=24)
    causes, _ = causes_at(cols, [60])
    assert causes == {60: "compute"}
