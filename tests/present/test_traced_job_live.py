"""A real 4-rank traced job: Prometheus scraped over loopback while it trains, then its HTML report
loaded in headless chromium (no JavaScript errors, every plot drawn, a screenshot)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hyperacc import harness
from hyperacc.chaos import read_ground_truth

HERE = Path(__file__).resolve().parent
SCREENSHOT = HERE.parents[1] / "docs" / "img" / "report.png"
RANKS = 4
STEPS = 320
CHAOS = {
    "seed": 7,
    "faults": [
        {"kind": "slowdown", "ranks": [2], "factor": 2.0},
        {"kind": "spike", "ranks": [1], "rate": 0.04, "ms": 80},
    ],
}


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _value(m: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in m.items() if n == name and want <= set(lab))


@pytest.fixture(scope="module")
def live_job(tmp_path_factory):
    """Runs the job, scrapes every endpoint mid-run, lets it finish. Returns (run_dir, scrapes, job)."""
    work = tmp_path_factory.mktemp("live")
    run_dir, ready, go = work / "run", work / "ready", work / "go"
    ready.mkdir()
    ports = [harness.free_port() for _ in range(RANKS)]
    agg_port = harness.free_port()
    env = {"HYPERACC_CHAOS": json.dumps({**CHAOS, "run_dir": str(run_dir)}), "PYTHONPATH": str(HERE.parents[1] / "src")}
    box: dict = {}

    def run() -> None:
        box["job"] = harness.launch(
            HERE / "rank_live_metrics.py",
            [str(run_dir), ",".join(map(str, ports)), str(agg_port), str(ready), str(go), str(STEPS)],
            nproc=RANKS, timeout=240, env=env,
        )  # fmt: skip

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    scrapes: dict = {}
    try:
        deadline = time.monotonic() + 200
        while len(list(ready.iterdir())) < RANKS:
            if not thread.is_alive() or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        else:
            # every rank has flushed its first STEPS steps; rank 0's follower picks them up within ~1 s.
            # The ranks train on meanwhile: on a host loaded by the rest of the suite the straggler rules
            # may need a window or two more to confirm the slowed rank, so wait for that as well (the
            # test still fails if it never comes, or if any other rank is ever flagged)
            while time.monotonic() < deadline:
                agg = _scrape(agg_port)
                counted = all(_value(agg, "hyperacc_step_seconds_count", rank=str(r)) >= STEPS for r in range(RANKS))
                if counted and _value(agg, "hyperacc_straggler", rank="2") >= 1:
                    break
                time.sleep(0.3)
            scrapes = {"job": _scrape(agg_port), **{r: _scrape(ports[r]) for r in range(RANKS)}}
    finally:
        go.touch()
        thread.join(timeout=260)
    job = box.get("job")
    assert job is not None and job.ok, job.explain() if job else "the job did not finish"
    assert scrapes, "the ranks never became ready:\n" + job.explain()
    return run_dir, scrapes, job


@pytest.mark.multirank
def test_prometheus_scraped_during_a_real_run(live_job):
    run_dir, scrapes, job = live_job
    assert all(r["extra_steps"] >= 0 for r in job.results())
    # per rank: each endpoint serves its own rank's records
    for r in range(RANKS):
        m = scrapes[r]
        assert _value(m, "hyperacc_step_seconds_count", rank=str(r)) >= STEPS
        assert {dict(lab).get("rank") for (n, lab) in m if n == "hyperacc_step_seconds_count"} == {str(r)}
        assert _value(m, "hyperacc_phase_seconds_total", rank=str(r), phase="forward") > 0
    # the in-band view (rank 0's records): every rank's share of the steps in which it arrived last, and
    # the slowed rank last more often than the typical rank. Arrival order is timing: on a host loaded
    # by the rest of the suite other ranks, descheduled, were last about as often ({'2': 0.32, '3': 0.34,
    # others 0.17}; {'2': 0.31, '0': 0.29, '1': 0.21, '3': 0.19}), so the verdict is the straggler flag
    # below, judged by the analysis' rules, and this checks the metric, not the ranking.
    share = {dict(lab)["rank"]: v for (n, lab), v in scrapes[0].items() if n == "hyperacc_culprit_share"}
    assert set(share) == {str(r) for r in range(RANKS)} and sum(share.values()) == pytest.approx(1.0, abs=0.02), share
    others = sorted(v for r, v in share.items() if r != "2")
    assert share["2"] > others[len(others) // 2], share
    # aggregated on rank 0: every rank, the straggler confirmed by the analysis' rules, spikes by cause
    job_m = scrapes["job"]
    flagged = {dict(lab)["rank"] for (n, lab), v in job_m.items() if n == "hyperacc_straggler" and v == 1}
    assert flagged == {"2"}, f"straggler flags {flagged}"
    injected = [t for t in read_ground_truth(run_dir) if t["rank"] == 1 and t["kind"] == "spike" and 10 <= t["step"] < STEPS - 60]
    assert len(injected) >= 4
    assert _value(job_m, "hyperacc_spikes_total", rank="1") >= len(injected) / 2
    assert _value(job_m, "hyperacc_spike_seconds_total", rank="1") > 0.04 * len(injected) / 2


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.mark.multirank
@pytest.mark.browser
def test_report_loads_in_headless_chromium(live_job, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    from hyperacc.present.diagnosis import diagnosis_of
    from hyperacc.present.report import build_report

    run_dir, _, _ = live_job
    diag = diagnosis_of(run_dir)
    page = build_report(run_dir, tmp_path / "report.html", diagnosis=diag).path
    shot = tmp_path / "report.png"
    cmd = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
        "--virtual-time-budget=20000", "--window-size=1400,2400", f"--screenshot={shot}", "--dump-dom",
        page.as_uri(),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    dom = proc.stdout
    console = [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]
    assert not [ln for ln in console if "Uncaught" in ln or "Error" in ln], "\n".join(console)
    assert '<pre id="js-errors"></pre>' in dom, dom[dom.find('id="js-errors"') - 20 :][:500]
    expected = int(dom.split('data-plots="')[1].split('"')[0])
    assert expected >= 6
    assert f'data-plots-rendered="{expected}"' in dom
    assert dom.count('class="main-svg"') >= expected  # plotly drew an SVG per plot
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "straggler" in (diag or {}).get("verdict", "")
    if os.environ.get("HYPERACC_UPDATE_SCREENSHOT") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, SCREENSHOT)
