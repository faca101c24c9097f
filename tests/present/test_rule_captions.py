"""Captions that state the outlier rule are built from the DetectionOptions that ran, not fixed text."""

from __future__ import annotations

from hyperacc.analysis import DetectionOptions, diagnose
from hyperacc.analysis.options import outlier_rule_text
from hyperacc.commands.import_kineto import _render_runtime
from hyperacc.present.kineto import read_runtime_api, runtime_api_outliers
from hyperacc.present.report import build_report

DEFAULT_TEXT = "modified z > 3.5, above the other ranks' Q3 + 1.5 IQR, 5 % and 0.2 us over the median"


def test_the_rule_in_words_carries_every_threshold_in_force():
    assert outlier_rule_text(DetectionOptions(), 200) == DEFAULT_TEXT
    changed = DetectionOptions(z_threshold=4.25, iqr_k=2.0, min_slowdown=0.1, outlier_rule="or")
    assert outlier_rule_text(changed, 1500) == (
        "modified z > 4.25 or above the other ranks' Q3 + 2 IQR; either way 10 % and 1.5 us over the median"
    )


def test_report_note_follows_the_options_the_diagnosis_ran_with(kineto_run, tmp_path):
    default = build_report(kineto_run, tmp_path / "a.html", diagnosis=diagnose(kineto_run, warmup_steps=0).to_dict())
    page = default.path.read_text()
    assert "modified z &gt; 3.5, above the other ranks&#x27; Q3 + 1.5 IQR, 5 % and 0.2 us" in page
    assert "OUTLIER" in page  # rank 2's launch latency (modified z ~20)
    strict = diagnose(kineto_run, warmup_steps=0, z_threshold=30.0).to_dict()
    page = build_report(kineto_run, tmp_path / "b.html", diagnosis=strict).path.read_text()
    assert "modified z &gt; 30, above" in page and "3.5" not in page.split("id='runtime-api'")[1].split("</section>")[0]
    assert "OUTLIER" not in page  # the table was judged by the same options as its note
    few = diagnose(kineto_run, warmup_steps=0, min_ranks=5).to_dict()
    page = build_report(kineto_run, tmp_path / "c.html", diagnosis=few).path.read_text()
    assert "not tested: the cross-rank test needs at least 5 ranks" in page


def test_import_kineto_caption_follows_the_options(kineto_run, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    runtime = read_runtime_api(kineto_run)

    def caption(opts: DetectionOptions) -> str:
        _render_runtime(runtime_api_outliers(runtime, opts=opts).to_pylist(), opts)
        return " ".join(capsys.readouterr().out.split())

    assert DEFAULT_TEXT in caption(DetectionOptions())
    out = caption(DetectionOptions(z_threshold=4.25, outlier_rule="or", launch_floor_ns=1500))
    assert "modified z > 4.25 or above the other ranks' Q3 + 1.5 IQR; either way 5 % and 1.5 us" in out
    assert "not tested: the cross-rank outlier test needs at least 5 ranks" in caption(DetectionOptions(min_ranks=5))
