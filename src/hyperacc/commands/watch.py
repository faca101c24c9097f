"""``hyperacc watch RUN_DIR [RUN_DIR ...]``: the live view of a running (or finished) job, from another
terminal or another node on a shared file system. Several run directories of one job (agents with
local disks) are read together. docs/presentation.md, "Live view".
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from hyperacc.present.live_view import RunFollower, Snapshot

# A window still open is shown once the records have stopped for this long (the job ended, or stalls):
# ranks flush every 5 s by default, so a live job keeps the idle time below it.
SETTLED_S = 12.0
# Above this many ranks, watch shows the windows the leader gathered unless told ``--source records``: a
# view of every rank's records costs a refresh CPU in proportion to the ranks (docs/presentation.md).
RECORDS_MAX_RANKS = 256


def follow(run_dirs: list[Path], *, interval: float, window: int, live: bool, once: bool, idle: float | None,
           as_json: bool = False, source: str = "auto") -> int:  # fmt: skip
    """Refresh the view every ``interval`` seconds until Ctrl-C, ``once``, or ``idle`` seconds without news.

    ``live``: a rich live panel (a terminal); otherwise one line each time a window of steps completes,
    and the latest steps once more when the records stop (a run shorter than a window, the last window of
    a run) or when watching ends (``--idle``, Ctrl-C).

    ``source``: every rank's records, the windows the leader gathered (``present.job_view``), or
    ``auto``: the windows above ``RECORDS_MAX_RANKS`` ranks.
    """
    from hyperacc.present.job_view import follower as make_follower
    from hyperacc.present.live_view import render

    follower = make_follower(run_dirs, keep=max(4 * window, 200), source=source, records_max_ranks=RECORDS_MAX_RANKS)
    cadence = window if follower.source == "records" else 1  # windows: each gathered window once
    where = ", ".join(str(d) for d in run_dirs)
    what = "step records" if follower.source == "records" else "gathered windows (live/windows)"
    if follower.source == "windows" and source == "auto":
        click.echo(f"hyperacc watch: more than {RECORDS_MAX_RANKS} ranks: showing the windows the agent that "
                   "holds rank 0 gathered; --source records reads every rank's records", err=True)  # fmt: skip
    follower.poll()
    if follower.snapshot(window) is None:
        if once:
            click.echo(f"hyperacc watch: no {what} in {where} yet; is the job traced into it "
                       "(hyperacc run --run-dir)?", err=True)  # fmt: skip
            return 1
        click.echo(f"hyperacc watch: waiting for the first {what} in {where} (Ctrl-C to stop)", err=True)
    if live and not once:
        from rich.console import Console
        from rich.live import Live

        console = Console()
        with Live(console=console, refresh_per_second=4, transient=False) as view:
            while True:
                follower.poll()
                snap = follower.snapshot(window)
                if snap is not None:
                    view.update(render(snap))
                if idle is not None and follower_idle(follower) > idle:
                    return 0
                time.sleep(interval)
    printed = -1

    def show(snap: Snapshot) -> None:
        nonlocal printed
        printed = snap.step
        _print(snap, live=live, once=once, as_json=as_json)

    try:
        while True:
            follower.poll()
            snap = follower.snapshot(window)
            quiet = follower_idle(follower)
            if snap is not None and (once or snap.step >= printed + cadence or (quiet >= SETTLED_S and snap.step > printed)):
                show(snap)
            if once:
                return 0
            if idle is not None and quiet > idle:
                return _last(follower, window, printed, show)
            time.sleep(interval)
    except KeyboardInterrupt:
        _last(follower, window, printed, show)
        raise


def _last(follower: RunFollower, window: int, printed: int, show: Callable[[Snapshot], None]) -> int:
    """The steps not shown yet, when watching ends."""
    snap = follower.snapshot(window)
    if snap is not None and snap.step > printed:
        show(snap)
    return 0


def _print(snap: Snapshot, *, live: bool, once: bool, as_json: bool) -> None:
    from hyperacc.present.live_view import line, render

    if as_json:
        click.echo(json.dumps(snap.to_dict()))
    elif once and live:
        from rich.console import Console

        Console().print(render(snap))
    else:
        click.echo(line(snap))
    sys.stdout.flush()


def _not_one_job(dirs: list[Path]) -> str | None:
    """Why the run directories are not of one job (``analysis.columns.merge_layouts``), or None. Directories
    that hold no records yet (a job starting) are not judged."""
    from hyperacc.records import segment_range

    started = [d for d in dirs if any(segment_range(p) for p in d.glob("steps/rank-*/seg-*"))]
    if len(started) < 2:
        return None
    from hyperacc.analysis.columns import discover
    from hyperacc.store import RunDirError

    try:
        discover(started)
    except RunDirError as exc:
        return str(exc)
    return None


def follower_idle(follower: object) -> float:
    snap_idle = getattr(follower, "_last_new", None)
    return time.monotonic() - snap_idle if snap_idle is not None else 0.0


@click.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(0.1, 3600), help="Seconds between refreshes.")
@click.option("--window", default=50, show_default=True, type=click.IntRange(2, 100_000), help="Steps the figures cover.")
@click.option("--once", is_flag=True, help="Show one snapshot and exit (1 when there is nothing to show yet).")
@click.option("--idle", default=None, type=click.FloatRange(0, None), help="Exit after this many seconds without new records.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per snapshot instead of text.")
@click.option("--source", type=click.Choice(["auto", "records", "windows"]), default="auto", show_default=True,
              help="Every rank's step records, or the windows the agent that holds rank 0 gathered (one row "
                   "per rank and window: light at thousands of ranks); auto: the windows above "
                   f"{RECORDS_MAX_RANKS} ranks.")  # fmt: skip
def command(run_dirs: tuple[Path, ...], interval: float, window: int, once: bool, idle: float | None, as_json: bool,
            source: str) -> None:  # fmt: skip
    """Show the live view of the job writing RUN_DIRS (a rich panel in a terminal, else one line per window).

    Several run directories of one job (one per agent on nodes with local disks) are shown as one job,
    given as separate arguments or joined by commas.
    """
    from hyperacc.commands.params import run_dirs_of

    dirs: list[Path] = []
    for d in run_dirs:
        parts = run_dirs_of(str(d))
        dirs += [Path(p) for p in ([parts] if isinstance(parts, str) else parts)]
    for d in dirs:
        if not d.is_dir():
            raise click.BadParameter(f"{d} does not exist; pass the --run-dir of a traced job", param_hint="RUN_DIRS")
    problem = _not_one_job(dirs)
    if problem:
        click.echo(f"hyperacc watch: {problem}", err=True)
        sys.exit(1)
    run_dirs = tuple(dirs)
    live = sys.stdout.isatty() and not as_json
    try:
        code = follow(list(run_dirs), interval=interval, window=window, live=live, once=once, idle=idle, as_json=as_json,
                      source=source)  # fmt: skip
    except KeyboardInterrupt:
        code = 0
    sys.exit(code)
