"""Helpers of the reliability suite: small run directories, the one-line-error check, real jobs.

Real jobs run ``examples/train_ddp.py`` through ``hyperacc run`` (traced) and through torchrun
directly (the same job without hyperacc), each in its own session so a signal can reach the launcher,
one rank, or the whole process group.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil
from click.testing import Result

from hyperacc.analysis.synthetic import SyntheticRun, write_run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
JOBS = Path(__file__).resolve().parent / "jobs"

# The small run every option fuzz and segment test starts from: 4 ranks x 300 steps on 2 nodes.
SMALL = SyntheticRun(ranks=4, steps=300, ranks_per_node=2, seed=5, segment_steps=100)


def small_run(path: Path) -> Path:
    return write_run(path, SMALL)


def check_cli_result(result: Result, allowed: Sequence[int] = (0, 1, 2)) -> None:
    """The promise for every command and input: exit 0, 1 or 2; a failure is one line; no traceback."""
    out = result.output
    exc = result.exception
    assert exc is None or isinstance(exc, SystemExit), (
        f"uncaught {type(exc).__name__}: {exc}\n{out[-2000:]}"
    )
    assert result.exit_code in allowed, f"exit {result.exit_code}:\n{out[-2000:]}"
    assert "Traceback" not in out, out[-3000:]
    if result.exit_code != 0:
        errors = [line for line in out.splitlines() if line.strip() and not _is_warning(line)]
        assert len(errors) == 1, f"exit {result.exit_code} with {len(errors)} lines:\n{out[-2000:]}"


def _is_warning(line: str) -> bool:
    # data warnings name a skipped file; they come before the one error line, on stderr
    return line.startswith(("skipping ", "cannot list ")) or " were left out" in line


# ------------------------------------------------------------------ real jobs


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "src"), **extra})
    return env


@dataclasses.dataclass
class JobOutcome:
    code: int | None  # the launcher's exit status (negative: killed by that signal); None: it hung
    exit_s: float | None  # seconds from the fault to the launcher's exit
    ranks_left: list[int]  # rank processes still running when the launcher had exited
    log: str


def ddp_command(run_dir: Path | None, steps: int, nproc: int = 2, trace: str | None = None) -> list[str]:
    script = [str(EXAMPLE), "--steps", str(steps), "--features", "64", "--hidden", "64"]
    if run_dir is None:  # the same job without hyperacc
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                "--max-restarts", "0", *script]  # fmt: skip
    opts = ["--trace", trace] if trace else []
    return [sys.executable, "-m", "hyperacc", "run", "--run-dir", str(run_dir), "--nproc-per-node", str(nproc),
            "--max-restarts", "0", *opts, "--", *script]  # fmt: skip


def rank_processes(launcher: psutil.Process) -> list[psutil.Process]:
    """The launcher's rank processes (they run the training script), ordered by pid."""
    try:
        kids = launcher.children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for child in kids:
        try:
            if str(EXAMPLE) in " ".join(child.cmdline()) and "torch.distributed.run" not in child.cmdline():
                out.append(child)
        except psutil.Error:
            continue
    return sorted(out, key=lambda c: c.pid)


def run_with_fault(
    cmd: list[str],
    workdir: Path,
    fault: Callable[[subprocess.Popen, list[psutil.Process]], None],
    ready: Callable[[], bool],
    *,
    nproc: int = 2,
    delay_s: float = 0.0,
    timeout: float = 240.0,
) -> JobOutcome:
    """Start ``cmd`` in its own session, wait until its ranks run and ``ready()``, wait ``delay_s``,
    apply ``fault(launcher, ranks)``, then wait for the launcher. Everything left is killed after."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "launcher.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=job_env(HYPERACC_RESULT_DIR=str(workdir)), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    launcher = psutil.Process(proc.pid)
    ranks: list[psutil.Process] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            ranks = rank_processes(launcher)
            if len(ranks) == nproc and ready():
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"the job never got ready:\n{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(delay_s)
        t0 = time.monotonic()
        fault(proc, ranks)
        try:
            code: int | None = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
            exit_s: float | None = time.monotonic() - t0
        except subprocess.TimeoutExpired:
            code, exit_s = None, None
        left = [r.pid for r in ranks if _alive(r)]
    finally:
        _kill_everything(proc, ranks)
    return JobOutcome(code, exit_s, left, log_path.read_text(errors="replace"))


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill_everything(proc: subprocess.Popen, ranks: list[psutil.Process]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for r in ranks:
        try:
            r.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(ranks, timeout=10)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def side_by_side(traced: Callable[[], JobOutcome], plain: Callable[[], JobOutcome]) -> tuple[JobOutcome, JobOutcome]:
    """Run the traced job and the same job without hyperacc at the same time; both outcomes."""
    box: dict[str, JobOutcome | BaseException] = {}

    def run(name: str, fn: Callable[[], JobOutcome]) -> None:
        try:
            box[name] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below in the test's thread
            box[name] = exc

    threads = [threading.Thread(target=run, args=(n, f)) for n, f in (("traced", traced), ("plain", plain))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in ("traced", "plain"):
        if isinstance(box[name], BaseException):
            raise box[name]  # type: ignore[misc]
    return box["traced"], box["plain"]  # type: ignore[return-value]


def seeded(name: str) -> random.Random:
    """A generator seeded from the test's name: random moments, the same on every run
    (``HYPERACC_FAULT_SEED`` picks other moments; bench/soak.py runs several)."""
    return random.Random(f"hyperacc-reliability-{name}-{os.environ.get('HYPERACC_FAULT_SEED', '0')}")


def flushes(rank_dir: Path) -> int:
    """How many segments a rank has flushed into ``rank_dir`` so far (the highest segment number on disk:
    a compaction rolls several into one file but keeps their numbers)."""
    from hyperacc import store

    ranges = [r for p in rank_dir.glob("seg-*") if (r := store.segment_range(p)) is not None] if rank_dir.is_dir() else []
    return max((hi for _, hi in ranges), default=0)
