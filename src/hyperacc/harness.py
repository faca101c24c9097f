"""A real multi-rank job on this machine, through torch's own launcher.

``launch`` starts ``python -m torch.distributed.run`` (torchrun) with free ports, gloo-friendly
settings and per-rank stdout/stderr captured, waits with a wall-clock timeout and returns what each
rank reported. With ``nnodes > 1`` it starts one torchrun agent per simulated node on this machine, so
``GROUP_RANK`` differs between them exactly as it would across machines.

Inside a rank, ``write_result(obj)`` writes that rank's result (flushed and fsynced) and ``finish()``
ends the rank the way that survives gloo's exit-time SIGABRT (FACTS.md: barrier, destroy, ``os._exit``).
A rank whose result was written counts as finished even if its interpreter crashed afterwards.

Nothing is left behind: every agent runs in its own session and its whole process group is killed on
timeout and after completion.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hyperacc import process

RESULT_DIR_ENV = "HYPERACC_RESULT_DIR"


@dataclasses.dataclass
class RankResult:
    rank: int
    node: int
    local_rank: int
    result: dict[str, Any] | None
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.result is not None


@dataclasses.dataclass
class JobResult:
    ranks: dict[int, RankResult]
    returncodes: list[int | None]  # one per torchrun agent; None if killed on timeout
    timed_out: bool
    wall_s: float
    workdir: Path
    launcher_output: str  # the agents' own stdout/stderr

    @property
    def ok(self) -> bool:
        """Every rank wrote its result (an exit-time crash after that is not a failure)."""
        return not self.timed_out and bool(self.ranks) and all(r.ok for r in self.ranks.values())

    def results(self) -> list[dict[str, Any]]:
        return [self.ranks[r].result or {} for r in sorted(self.ranks)]

    def explain(self) -> str:
        """A readable account of what went wrong, for assertion messages."""
        lines = [f"timed_out={self.timed_out} returncodes={self.returncodes} wall={self.wall_s:.1f}s"]
        for r in sorted(self.ranks):
            rr = self.ranks[r]
            if not rr.ok:
                lines.append(f"--- rank {r} wrote no result; stderr tail:\n{rr.stderr[-3000:]}")
        lines.append(f"--- launcher output tail:\n{self.launcher_output[-3000:]}")
        return "\n".join(lines)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill the agent's process group and every descendant (torchrun starts ranks in new sessions)."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for child in descendants:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(descendants, timeout=10)


def launch(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    nproc: int = 2,
    nnodes: int = 1,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    workdir: str | os.PathLike | None = None,
    module: bool = False,
    torchrun_args: Sequence[str] = (),
    traced: Mapping[str, str] | None = None,
) -> JobResult:
    """Run ``script`` (or ``-m module`` when ``module``) as ``nnodes x nproc`` ranks and collect results.

    ``traced``: start it through ``hyperacc run`` instead of plain torchrun, with these options of
    ``hyperacc run`` (e.g. ``{"run-dir": ..., "trace": '{"window": 10}', "chaos": ...}``), so a test can
    run the same script both ways and compare.
    """
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"nproc and nnodes must be >= 1 (got nproc={nproc}, nnodes={nnodes})")
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="hyperacc-job-"))
    results_dir = work / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    child_env = dict(os.environ)
    child_env.update(
        {
            RESULT_DIR_ENV: str(results_dir),
            "OMP_NUM_THREADS": child_env.get("OMP_NUM_THREADS", "1"),
            "PYTHONUNBUFFERED": "1",
            "TORCHELASTIC_ERROR_FILE": str(work / "error.json"),
        }
    )
    if env:
        child_env.update(env)

    target = ["-m", str(script)] if module else [str(script)]
    run_id = uuid.uuid4().hex[:8]
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    master_port = free_port()
    for node in range(nnodes):
        log_dir = work / "logs" / f"node{node}"
        if traced is None:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        else:
            cmd = [sys.executable, "-m", "hyperacc", "run", "--nproc-per-node", str(nproc)]
            for name, value in traced.items():
                cmd += [f"--{name}", value]
        if nnodes == 1:
            cmd += ["--standalone"]
        else:
            cmd += [
                "--nnodes", str(nnodes), "--node-rank", str(node),
                "--master-addr", "127.0.0.1", "--master-port", str(master_port),
                "--rdzv-id", run_id,
            ]  # fmt: skip
        cmd += ["--log-dir", str(log_dir), "--redirects", "3", "--max-restarts", "0"]
        if traced is None:
            cmd += [*torchrun_args, *target, *args]
        else:
            cmd += [f"--torchrun-arg={a}" for a in torchrun_args]
            cmd += ["--", *target, *args]
        out = (work / f"launcher-node{node}.log").open("wb")
        procs.append(
            subprocess.Popen(cmd, env=child_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        )
        logs.append(work / f"launcher-node{node}.log")

    start = time.monotonic()
    timed_out = False
    codes: list[int | None] = []
    try:
        for proc in procs:
            remaining = timeout - (time.monotonic() - start)
            try:
                codes.append(proc.wait(timeout=max(remaining, 0.01)))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for proc in procs:
            _kill_tree(proc)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
    codes += [None] * (len(procs) - len(codes))
    wall = time.monotonic() - start

    ranks = _collect(work, results_dir, nproc, nnodes)
    launcher = "\n".join(p.read_text(errors="replace") for p in logs if p.exists())
    return JobResult(ranks, codes, timed_out, wall, work, launcher)


def _collect(work: Path, results_dir: Path, nproc: int, nnodes: int) -> dict[int, RankResult]:
    ranks: dict[int, RankResult] = {}
    for node in range(nnodes):
        for local in range(nproc):
            rank = node * nproc + local
            stdout = stderr = ""
            # torchrun writes <log-dir>/<run_id>/attempt_0/<local_rank>/{stdout,stderr}.log
            for p in (work / "logs" / f"node{node}").glob(f"*/attempt_*/{local}/stdout.log"):
                stdout += p.read_text(errors="replace")
            for p in (work / "logs" / f"node{node}").glob(f"*/attempt_*/{local}/stderr.log"):
                stderr += p.read_text(errors="replace")
            result = None
            path = results_dir / f"rank-{rank}.json"
            if path.exists():
                try:
                    result = json.loads(path.read_text())
                except ValueError:
                    result = None
            ranks[rank] = RankResult(rank, node, local, result, stdout, stderr)
    return ranks


# ---------------------------------------------------------------- inside a rank


def write_result(obj: Mapping[str, Any], rank: int | None = None) -> Path | None:
    """Write this rank's result for the harness (atomic, fsynced). No-op outside the harness."""
    directory = os.environ.get(RESULT_DIR_ENV)
    if not directory:
        return None
    rank = process.place().rank if rank is None else rank
    path = Path(directory) / f"rank-{rank}.json"
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as fh:
        json.dump(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def finish(code: int = 0) -> None:
    """End a rank without gloo's exit-time abort: flush hyperacc's writers, barrier, destroy, ``os._exit``."""
    process.run_exit_hooks()
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
