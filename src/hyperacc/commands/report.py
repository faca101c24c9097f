"""``hyperacc report RUN_DIR``: one self-contained HTML page of a run (opens offline)."""

from __future__ import annotations

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from hyperacc.commands.params import OneLineCommand, OutputFile, existing_run_dirs, run_dirs_of
from hyperacc.store import MAX_RANKS, RunDirError


@click.command(cls=OneLineCommand)
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("-o", "--output", default=None, type=OutputFile(),
              help="Where to write the HTML (default: RUN_DIR/report.html).")  # fmt: skip
@click.option("--max-ranks", default=64, show_default=True, type=click.IntRange(1, MAX_RANKS),
              help="Most ranks drawn one by one (flagged first, then the spikiest, then the slowest).")  # fmt: skip
@click.option("--step-bins", default=600, show_default=True, type=click.IntRange(10, 10_000),
              help="Most step columns in the heatmap and timeline (longer runs are binned).")  # fmt: skip
@click.option("--baseline", default=None, metavar="RUN",
              help="Add a comparison with this run (the figures of `hyperacc compare`).")  # fmt: skip
@click.option("--batch-size", type=click.IntRange(1, 1 << 40), default=None,
              help="Samples per rank and step, for samples/s.")  # fmt: skip
def command(run_dir: str, output: str | None, max_ranks: int, step_bins: int, baseline: str | None,
            batch_size: int | None) -> None:  # fmt: skip
    """Write a self-contained HTML report of RUN_DIR and print its path: verdict, heatmap of self-time,
    step time with spikes by cause, distributions, spike rates, time lost per cause, projection,
    stabilizer and pacing events.

    RUN_DIR may list the run directories of one job's agents joined by commas (local disks).
    Example: hyperacc report runs/job1 -o job1.html --baseline runs/job0
    """
    from hyperacc.present.diagnosis import diagnosis_of
    from hyperacc.present.report import ReportError, build_report

    dirs = existing_run_dirs(run_dir, "RUN_DIR")
    if baseline is not None:
        existing_run_dirs(baseline, "--baseline")
    console = Console(stderr=True)
    try:
        with Progress(
            TextColumn("{task.description:<24}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
            console=console, transient=True,
        ) as bar:  # fmt: skip
            task = bar.add_task("analysing", total=1.0)
            diagnosis = diagnosis_of(dirs, batch_size=batch_size)
            base = None
            if baseline is not None:
                bar.update(task, description="analysing the baseline")
                try:
                    base = diagnosis_of(run_dirs_of(baseline), batch_size=batch_size)
                except RunDirError as exc:
                    raise click.ClickException(f"--baseline: {exc}") from None
            result = build_report(
                dirs, output, diagnosis=diagnosis, step_bins=step_bins, max_ranks=max_ranks, baseline=base,
                progress=lambda stage, done: bar.update(task, description=stage, completed=done),
            )  # fmt: skip
    except (ReportError, RunDirError) as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:  # a full disk, a file system gone read-only while writing
        where = exc.filename or output or run_dir
        raise click.ClickException(f"cannot write the report ({where}): {exc.strerror or exc}") from None
    click.echo(f"{result.path}  ({result.bytes / 1e6:.1f} MB, {result.ranks} ranks, {result.steps} steps)")
