"""The report's coordination, resources and comparison sections, loaded in headless chromium.

``HYPERACC_UPDATE_SCREENSHOT=1`` saves a screenshot of the three sections (the others hidden) to
docs/img/report-coordination.png."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from hyperacc import store
from hyperacc.analysis.synthetic import SyntheticFault, SyntheticRun, write_run
from hyperacc.present.diagnosis import diagnosis_of
from hyperacc.present.report import build_report
from hyperacc.schema import RESOURCE_SCHEMA

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "img" / "report-coordination.png"
ONLY_NEW = "<style>section:not(#coordination):not(#resources):not(#comparison){display:none}</style>"


def _resources(run: Path, ranks: int, creeping: int) -> None:
    rng = np.random.default_rng(1)
    n = 61
    for rank in range(ranks):
        t = (1_700_000_000 + np.linspace(0, 60, n)) * 1e9
        rss = 2000 + rng.normal(0, 5, n) + (np.linspace(0, 900, n) if rank == creeping else 0)
        store.resource_writer(run, rank).write(pa.table({
            "rank": pa.array([rank] * n, pa.int32()), "node": pa.array([rank // 4] * n, pa.int32()),
            "t_ns": pa.array(t.astype(np.int64)), "step": pa.array(np.arange(n) * 10, pa.int64()),
            "rss_bytes": pa.array((rss * 2**20).astype(np.int64)),
            "cpu_ns": pa.array((np.linspace(0, 60, n) * 1e9).astype(np.int64)),
            "cuda_allocated_bytes": pa.nulls(n, pa.int64()), "cuda_reserved_bytes": pa.nulls(n, pa.int64()),
            "cuda_peak_bytes": pa.nulls(n, pa.int64()),
        }, schema=RESOURCE_SCHEMA))  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sections")
    base = write_run(root / "base", SyntheticRun(ranks=8, steps=600, seed=1))
    faulty = write_run(root / "gc", SyntheticRun(ranks=8, steps=600, seed=2, faults=(
        SyntheticFault("gc", (1, 2, 3), rate=0.05, ms=30.0),)))  # fmt: skip
    _resources(faulty, 8, creeping=2)
    return base, faulty


@pytest.mark.slow  # runs the CLI twice in its own interpreter
def test_sections_hold_the_distribution_failure_modes_creep_and_the_comparison(runs, tmp_path) -> None:
    base, faulty = runs
    page = build_report(faulty, tmp_path / "r.html", diagnosis=diagnosis_of(faulty), baseline=diagnosis_of(base))
    html = page.path.read_text()
    for sid in ("coordination", "resources", "comparison"):
        assert f"<section id='{sid}'>" in html
    for words in ("p99.9", "Lost time by failure mode", "synchronisation amplification", "memory creep on rank 2",
                  "Comparison with the baseline", "spike_rate"):  # fmt: skip
        assert words in html
    # the CLI: --baseline, and a bad baseline in one line
    out = subprocess.run([sys.executable, "-m", "hyperacc", "report", str(faulty), "-o", str(tmp_path / "c.html"),
                          "--baseline", str(base)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0 and "comparison" in (tmp_path / "c.html").read_text()
    bad = subprocess.run([sys.executable, "-m", "hyperacc", "report", str(faulty), "-o", str(tmp_path / "d.html"),
                          "--baseline", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=300)  # fmt: skip
    # a path that does not exist is bad input: 2 (docs/reliability.md, "Exit status")
    assert bad.returncode == 2 and "--baseline" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.browser
def test_sections_render_in_headless_chromium(runs, tmp_path) -> None:
    browser = next((p for n in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(n))), None)
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    base, faulty = runs
    page = build_report(faulty, tmp_path / "r.html", diagnosis=diagnosis_of(faulty), baseline=diagnosis_of(base)).path
    only = tmp_path / "sections.html"
    only.write_text(page.read_text().replace("</head>", ONLY_NEW + "</head>", 1))
    shot = tmp_path / "sections.png"
    cmd = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
        "--virtual-time-budget=20000", "--window-size=1400,2600", f"--screenshot={shot}", "--dump-dom",
        only.as_uri(),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    dom = proc.stdout
    console = [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]
    assert not [ln for ln in console if "Uncaught" in ln or "Error" in ln], "\n".join(console)
    assert '<pre id="js-errors"></pre>' in dom
    expected = int(dom.split('data-plots="')[1].split('"')[0])
    assert f'data-plots-rendered="{expected}"' in dom
    for sid in ("coordination", "resources", "comparison"):
        assert f'id="plot-{sid}"' in dom
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("HYPERACC_UPDATE_SCREENSHOT") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, SCREENSHOT)
