"""``hyperacc export RUN_DIR --chrome out.json``: a timeline for Perfetto / chrome://tracing."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hyperacc.commands.params import OneLineCommand, OutputFile, existing_run_dirs
from hyperacc.store import RunDirError


def _steps(ctx: click.Context, param: click.Parameter, text: str | None) -> tuple[int | None, int | None]:
    from hyperacc.present.chrome import ExportError, parse_steps

    try:
        return parse_steps(text)
    except ExportError as exc:
        raise click.UsageError(str(exc)) from None  # the message names --steps


@click.command(cls=OneLineCommand)
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--chrome", "chrome_out", required=True, type=OutputFile(),
              help="Write a Chrome / Perfetto trace (JSON) to this file.")  # fmt: skip
@click.option("--steps", default=None, metavar="A:B", callback=_steps,
              help="Export steps A (inclusive) to B (exclusive) only; either side may be empty.")  # fmt: skip
@click.option("--ranks", "ranks_text", default=None, metavar="LIST",
              help="Export these ranks only: ranks and ranges, e.g. 0-7,12.")  # fmt: skip
@click.option("--no-diagnosis", is_flag=True, help="Do not run the analysis to mark spikes and their causes.")
def command(
    run_dir: str, chrome_out: str, steps: tuple[int | None, int | None], ranks_text: str | None, no_diagnosis: bool
) -> None:
    """Export RUN_DIR as a trace: one process per rank, phases as slices, spikes and GC pauses as
    instant events, collective waits in their own track. Open it in https://ui.perfetto.dev.

    RUN_DIR may list the run directories of one job's agents joined by commas (local disks).
    Example: hyperacc export runs/job1 --chrome job1.json --steps 100:200 --ranks 0-7
    """
    from hyperacc.analysis.columns import discover
    from hyperacc.present.chrome import ExportError, export_chrome, parse_ranks
    from hyperacc.present.diagnosis import diagnosis_of

    try:
        chosen = parse_ranks(ranks_text)
    except ExportError as exc:
        raise click.UsageError(str(exc)) from None
    console = Console(stderr=True)
    window = steps
    run_dir = existing_run_dirs(run_dir, "RUN_DIR")  # the run directories of one job's agents may be joined by commas
    try:
        ranks = len(discover(run_dir).sources) if chosen is None else len(chosen)
        diagnosis = None if no_diagnosis else diagnosis_of(run_dir)
        with Progress(
            TextColumn("exporting"), BarColumn(), MofNCompleteColumn(), TextColumn("ranks"), TimeElapsedColumn(),
            console=console, transient=True,
        ) as bar:  # fmt: skip
            task = bar.add_task("export", total=ranks)
            with _sigterm_as_exit():  # the half-written trace is removed on SIGTERM too, not only on Ctrl-C
                result = export_chrome(run_dir, chrome_out, steps=window, ranks=chosen, diagnosis=diagnosis,
                                       progress=lambda _r: bar.advance(task))  # fmt: skip
    except (ExportError, RunDirError) as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:  # a full disk, a file system gone read-only while writing
        raise click.ClickException(
            f"cannot write the trace ({exc.filename or chrome_out}): {exc.strerror or exc}"
        ) from None
    click.echo(
        f"{result.path}  ({result.ranks} ranks, {result.steps} step records, {result.trace_events} trace events, "
        f"{result.bytes / 1e6:.1f} MB); open it in https://ui.perfetto.dev"
    )


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) while the trace is written, so the writer's cleanup runs (the
    default action would end the process at once and leave ``out.tmp`` behind)."""
    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread: nothing to install
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
