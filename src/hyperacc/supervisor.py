"""What ``hyperacc run`` does while torchrun runs: it starts torchrun as its child, shows the live view of
the run directory, does the node agent's work for its node's ranks (``hyperacc.agent``: live window
aggregation and detection, rolling their record segments into Parquet), and ends with torchrun's own
exit status.

- In a terminal (stdout is a tty, no ``--quiet``): a rich live panel refreshed every ``interval``
  seconds (``present.live_view.render``), with the job's own output printed above it line by line.
- Not a terminal (a log, a pipe, a batch system): the job's output goes straight to the same file
  descriptors, untouched, and one line per completed window of steps (``present.live_view.line``).
- ``--quiet``: the job's output untouched, no view (the node agent still runs).

Signals: torchrun runs in its own process group, so every signal meant for the job reaches this process
alone and is passed on exactly once: the terminal's Ctrl-C and Ctrl-\\ (which go to the terminal's
foreground group, this process), and SIGINT, SIGTERM, SIGHUP and SIGQUIT sent with ``kill`` to this
process or to its process group (a scheduler, ``timeout``). torchrun then stops its workers as it does
when started by hand (its workers run in sessions of their own either way). Should this process be
killed outright (SIGKILL), torchrun gets SIGKILL too (``PR_SET_PDEATHSIG``), as torchrun started by hand
and killed would. The exit status is torchrun's (128 + N when it died of
signal N). The view reads only what the ranks already write; it never touches the job, and a failure in
it switches the view off with one line while the job goes on. docs/presentation.md, "Live view".
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger("hyperacc.run")

VIEWS = ("panel", "lines", "off")


def choose_view(quiet: bool, stream: TextIO | None = None) -> str:
    """``off`` with --quiet, ``panel`` on a terminal, else ``lines``."""
    if quiet:
        return "off"
    stream = stream if stream is not None else sys.stdout
    try:
        return "panel" if stream.isatty() and os.environ.get("TERM", "") != "dumb" else "lines"
    except (AttributeError, ValueError):
        return "lines"


def exit_status(returncode: int) -> int:
    """A child's return code as a shell reports it (128 + N for signal N)."""
    return 128 - returncode if returncode < 0 else returncode


# The signals passed on to torchrun: those it stops its workers on (torch.distributed.elastic).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _own_group_child(parent: int) -> Any:
    """The ``preexec_fn`` that puts torchrun in a process group of its own (the terminal's signals then
    reach this process only, which passes each on once) and has it killed with this process."""
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child
        except (OSError, AttributeError):
            prctl = None

    def setup() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:  # this process died before the prctl: go with it
                os.kill(os.getpid(), signal.SIGKILL)

    return setup


class Supervisor:
    """Runs ``cmd`` (torchrun) with ``env`` and shows the live view of ``run_dir`` until it exits."""

    def __init__(
        self,
        cmd: Sequence[str],
        env: dict[str, str],
        run_dir: Path,
        *,
        view: str = "lines",
        interval: float = 2.0,
        window: int = 50,
        out: TextIO | None = None,
        agent: Any = None,
    ) -> None:
        if view not in VIEWS:
            raise ValueError(f"view must be one of {VIEWS} (got {view!r})")
        self.cmd = list(cmd)
        self.env = env
        self.run_dir = Path(run_dir)
        self.view = view
        self.interval = interval
        self.window = window
        self.out = out if out is not None else sys.stdout
        self.agent = agent  # agent.NodeAgent: compaction and live aggregation for this node's ranks
        self.proc: subprocess.Popen[bytes] | None = None
        self._previous: dict[int, Any] = {}
        self._early: list[int] = []  # signals that came before torchrun was started

    # ------------------------------------------------------------------ process

    def run(self) -> int:
        """Start torchrun, follow it, return its exit status."""
        piped = self.view == "panel"
        self._forward_signals()  # before the start: a signal in between is passed on once torchrun runs
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdout=subprocess.PIPE if piped else None,
            stderr=subprocess.STDOUT if piped else None,
            preexec_fn=_own_group_child(os.getpid()),
        )
        for signum in self._early:
            self._send(signum)
        self._early.clear()
        if self.agent is not None:
            self.agent.start()
        try:
            if self.view == "panel":
                self._panel()
            elif self.view == "lines":
                self._lines()
            status = exit_status(self._wait())
        finally:
            self._restore_signals()
        self._final_pass()
        return status

    def _final_pass(self) -> None:
        """The job has ended: judge its last windows and roll what its ranks left into Parquet (Ctrl-C
        stops it; the records stay readable as written)."""
        if self.agent is None:
            return
        try:
            self.agent.stop()
        except KeyboardInterrupt:
            log.warning("hyperacc run: final compaction interrupted; the records stay as written")

    def _wait(self) -> int:
        assert self.proc is not None
        return self.proc.wait()

    def _send(self, signum: int) -> None:
        if self.proc is None:
            self._early.append(signum)
        elif self.proc.poll() is None:
            self.proc.send_signal(signum)

    def _forward_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def forward(signum: int, _frame: Any) -> None:
            self._send(signum)

        for sig in FORWARDED:
            self._previous[sig] = signal.signal(sig, forward)

    def _restore_signals(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _sleep(self, seconds: float) -> None:
        """Sleep until the next refresh or until torchrun exits, whichever comes first."""
        end = time.monotonic() + seconds
        while self._running() and time.monotonic() < end:
            time.sleep(min(0.1, max(end - time.monotonic(), 0.0)))

    # ------------------------------------------------------------------ views

    def _follower(self) -> Any:
        from hyperacc.present.live_view import RunFollower
        from hyperacc.trace.options import ENV_NODE_AGENT

        # this node's ranks (the ranks whose metadata names this hyperacc run), on a shared run directory too
        agent = self.env.get(ENV_NODE_AGENT) or None
        return RunFollower([self.run_dir], keep=max(4 * self.window, 200), agent=agent)

    def _lines(self) -> None:
        from hyperacc.present.live_view import line

        follower = self._follower()
        printed = -1
        while True:
            running = self._running()
            try:
                follower.poll()
                snap = follower.snapshot(self.window)
                if snap is not None and (snap.step >= printed + self.window or (not running and snap.step > printed)):
                    printed = snap.step
                    print(line(snap), file=self.out, flush=True)
            except Exception as exc:  # noqa: BLE001 - the view is a convenience; the job goes on
                log.warning("hyperacc run: live view switched off: %r", exc)
                return
            if not running:
                return
            self._sleep(self.interval)

    def _panel(self) -> None:
        from rich.console import Console
        from rich.live import Live

        from hyperacc.present.live_view import render

        assert self.proc is not None and self.proc.stdout is not None
        console = Console(file=self.out)
        follower = self._follower()
        on = True
        with Live(console=console, refresh_per_second=4, transient=False, redirect_stdout=False) as live:
            pump = threading.Thread(target=self._pump, args=(self.proc.stdout, live), daemon=True)
            pump.start()
            while True:
                running = self._running()
                if on:
                    try:
                        follower.poll()
                        snap = follower.snapshot(self.window)
                        if snap is not None:
                            live.update(render(snap))
                    except Exception as exc:  # noqa: BLE001
                        on = False
                        live.console.print(f"hyperacc run: live view switched off: {exc!r}", markup=False)
                if not running:
                    break
                self._sleep(self.interval)
            pump.join(timeout=5)

    @staticmethod
    def _pump(stream: Any, live: Any) -> None:
        """The job's output, line by line, above the panel (progress bars redrawn with a carriage return
        show their latest state when their line ends)."""
        lines = OutputLines()
        fd = stream.fileno()
        while chunk := os.read(fd, READ_BYTES):
            for text in lines.feed(chunk):
                live.console.print(text, markup=False, highlight=False, soft_wrap=True)
            if len(chunk) < READ_BYTES:
                # A job that flushes every redraw of a progress bar would otherwise cost a wake-up and a
                # read per redraw; a few milliseconds let them gather in the pipe (a job writing faster
                # than the pipe holds is read again at once).
                time.sleep(GATHER_S)
        for text in lines.close():
            live.console.print(text, markup=False, highlight=False, soft_wrap=True)
        stream.close()


READ_BYTES = 65536  # one read of the job's output: a Linux pipe's default capacity
GATHER_S = 0.005  # after a short read, wait this long for more output (at most 200 reads a second)


class OutputLines:
    """Bytes of a job's output -> the lines to print above the panel.

    A line ends at a newline; a carriage return starts it again (a progress bar redrawing itself), so
    only what follows the last carriage return of a line is kept. Undecodable bytes are replaced.

    Linear in what the job prints: a redraw drops what it overwrites as it arrives, so a progress bar
    redrawn 20,000 times on one line costs 20,000 small appends, not 20,000 copies of a growing line."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def feed(self, chunk: bytes) -> list[str]:
        pieces = chunk.split(b"\n")
        self._add(pieces[0])
        done = []
        for piece in pieces[1:]:
            done.append(self._text(b"".join(self._parts)))
            self._parts.clear()
            self._add(piece)
        return done

    def close(self) -> list[str]:
        text = self._text(b"".join(self._parts))
        self._parts.clear()
        return [text] if text else []

    def _add(self, piece: bytes) -> None:
        if not piece:
            return
        cr = piece.rfind(b"\r", 0, len(piece) - 1)  # a final one may still be half of a CRLF
        if cr >= 0 or (self._parts and self._parts[-1].endswith(b"\r")):
            self._parts.clear()  # a carriage return followed by more text: what came before is redrawn
        self._parts.append(piece[cr + 1 :])

    @staticmethod
    def _text(line: bytes) -> str:
        if line.endswith(b"\r"):
            line = line[:-1]  # a CRLF line end
        return line.rsplit(b"\r", 1)[-1].decode(errors="replace")
