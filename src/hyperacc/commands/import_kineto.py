"""``hyperacc import-kineto DIR_OR_FILES --run-dir OUT``: torch.profiler traces -> a run directory, analysed.

One trace per rank (``.json`` or ``.json.gz``). The traces become step records in OUT (the mapping is in
docs/presentation.md, "Kineto import"); then the same analysis as ``hyperacc analyze`` runs, followed by
the CUDA runtime API latency per rank and the cross-rank outlier test. Files that cannot be read are
named and skipped; the other ranks are still imported.
"""

from __future__ import annotations

import json
import math
import sys
from typing import TYPE_CHECKING, Any

import click

from hyperacc.stats import median
from hyperacc.store import RunDirError

if TYPE_CHECKING:
    from hyperacc.analysis.options import DetectionOptions


@click.command()
@click.argument("inputs", nargs=-1, required=True, type=click.Path())
@click.option("--run-dir", required=True, type=click.Path(file_okay=False),
              help="New run directory to write the imported step records to.")  # fmt: skip
@click.option("--ranks-per-node", type=click.IntRange(1), default=None,
              help="Node of each rank = rank // this (default: from the traces' host names).")  # fmt: skip
@click.option("--warmup-steps", type=click.IntRange(0), default=0, show_default=True,
              help="Leading steps left out of the analysis (profiler windows are usually already warm).")  # fmt: skip
@click.option("--window-steps", type=click.IntRange(1), default=None,
              help="Steps per straggler window (default 50; a profiling window of few steps needs fewer).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the import, diagnosis and latency table as JSON.")
def command(
    inputs: tuple[str, ...], run_dir: str, ranks_per_node: int | None, warmup_steps: int,
    window_steps: int | None, as_json: bool,
) -> None:  # fmt: skip
    """Import torch.profiler (Kineto) traces, one per rank, and analyse them.

    Example: hyperacc import-kineto traces/ --run-dir runs/imported
    """
    from rich.console import Console

    from hyperacc.analysis.options import DetectionOptions
    from hyperacc.present.diagnosis import diagnosis_of
    from hyperacc.present.kineto import KinetoTraceError, import_traces, runtime_api_outliers

    err = Console(stderr=True)
    try:
        with err.status("reading traces ...") as status:
            result = import_traces(
                inputs, run_dir, ranks_per_node=ranks_per_node,
                progress=lambda f: status.update(f"read {f.name}"),
            )  # fmt: skip
    except (KinetoTraceError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    for _path, msg in result.errors:
        err.print(f"[yellow]skipped[/yellow] {msg}", highlight=False, soft_wrap=True)
    for msg in result.warnings:
        err.print(f"[yellow]note[/yellow] {msg}", highlight=False, soft_wrap=True)
    try:
        diagnosis = diagnosis_of(run_dir, warmup_steps=warmup_steps, window_steps=window_steps)
    except (RunDirError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    opts = DetectionOptions.from_mapping((diagnosis or {}).get("options") or {})  # the rules the analysis used
    runtime = runtime_api_outliers(result.runtime, opts=opts)
    rows = runtime.to_pylist()

    if as_json:
        doc: dict[str, Any] = {
            "import": {
                "run_dir": str(result.run_dir),
                "ranks": {str(r): str(p) for r, p in result.ranks.items()},
                "errors": [{"file": str(p), "error": m} for p, m in result.errors],
                "warnings": list(result.warnings),
                "steps": result.steps,
                "events_seen": result.events_seen,
            },
            "diagnosis": diagnosis,
            "runtime_api": [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
                            for r in rows],
        }  # fmt: skip
        click.echo(json.dumps(doc, indent=2, allow_nan=False))
        return

    click.echo(
        f"imported {len(result.ranks)} rank(s), {result.steps} steps ({result.events_seen:,} trace events) "
        f"into {result.run_dir}" + (f"; {len(result.errors)} file(s) skipped" if result.errors else "")
    )
    if diagnosis is not None:
        from hyperacc.commands.analyze import _render

        _render(diagnosis)
    _render_runtime(rows, opts)
    sys.stdout.flush()


def _render_runtime(rows: list[dict[str, Any]], opts: DetectionOptions) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from hyperacc.analysis.options import outlier_rule_text
    from hyperacc.present.kineto import KEY_RUNTIME_APIS

    con = Console()
    if not rows:
        con.print("No CUDA runtime calls in the traces (a CPU-only profile).")
        return
    by_api: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_api.setdefault(r["api"], []).append(r)
    order = [a for a in KEY_RUNTIME_APIS if a in by_api]
    order += sorted((a for a in by_api if a not in KEY_RUNTIME_APIS), key=lambda a: -sum(r["calls"] for r in by_api[a]))
    ranks = len({r["rank"] for r in rows})
    t = Table(title=f"CUDA runtime API latency, us ({ranks} ranks)", box=box.SIMPLE_HEAD)
    t.add_column("API", no_wrap=True, max_width=24, overflow="ellipsis")
    for col, width in (("calls", 7), ("median", 7), ("p99", 7), ("slowest rank", 12)):
        t.add_column(col, justify="right", no_wrap=True, min_width=width)
    t.add_column("outliers", min_width=8)
    for api in order[:16]:
        rs = by_api[api]
        med = median(r["median_ns"] for r in rs)
        slow = max(rs, key=lambda r: r["median_ns"])
        out = [r for r in rs if r["outlier"]]
        excess = slow["excess"]
        t.add_row(
            api, f"{sum(r['calls'] for r in rs):,}", _us(med), _us(max(r["p99_ns"] for r in rs)),
            f"{slow['rank']}" + ("" if excess is None or not math.isfinite(excess) else f" ({100 * excess:+.0f} %)"),
            (", ".join(f"rank {r['rank']}" for r in out) or "-") if any(r.get("judged") for r in rs) else "not tested",
        )  # fmt: skip
    if ranks < opts.min_ranks:
        t.caption = (f"not tested: the cross-rank outlier test needs at least {opts.min_ranks} ranks "
                     f"(the other ranks' fence needs three of them); these traces have {ranks}")  # fmt: skip
    else:
        t.caption = (f"outlier: the straggler rule on one window ({outlier_rule_text(opts, opts.launch_floor_ns)}; "
                     "docs/detection.md)")  # fmt: skip
    con.print(t)
    flagged = [r for r in rows if r["outlier"]]
    for r in flagged[:10]:
        con.print(
            f"[bold red]rank {r['rank']}[/bold red]: {r['api']} median {_us(r['median_ns'])} us, "
            f"{100 * r['excess']:+.0f} % against the other ranks (modified z {r['z']:.1f})",
            highlight=False,
        )


def _us(ns: float) -> str:
    return f"{ns / 1e3:,.2f}"
