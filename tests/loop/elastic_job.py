"""An elastic torchrun job on this machine: several agents (simulated nodes) with c10d rendezvous.

Each agent gets its own node name (``HYPERACC_NODE_NAME``) and log directory; the first agent is started
first, so it hosts the rendezvous store. ``wait_for`` polls a condition while the job runs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

from hyperacc.harness import RESULT_DIR_ENV, free_port


@dataclasses.dataclass
class Agent:
    name: str
    proc: subprocess.Popen
    log_dir: Path
    output: Path


class ElasticJob:
    def __init__(self, workdir: Path, script: str, args: Sequence[str], *, names: Sequence[str], nproc: int,
                 nnodes: str, max_restarts: int, env: Mapping[str, str], rdzv_conf: str,
                 agent_env: Mapping[str, Mapping[str, str]] | None = None, bootstrap: bool = False) -> None:  # fmt: skip
        """``agent_env``: extra variables of one agent's ranks (by name); ``bootstrap``: start the ranks
        through ``hyperacc.bootstrap``, as ``hyperacc run`` does (tracing, chaos, remediation)."""
        self.workdir = workdir
        self.results = workdir / "results"
        self.results.mkdir(parents=True, exist_ok=True)
        port = free_port()
        run_id = uuid.uuid4().hex[:8]
        base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", RESULT_DIR_ENV: str(self.results),
                **env}  # fmt: skip
        self.agents: list[Agent] = []
        for i, name in enumerate(names):
            log_dir = workdir / "logs" / name
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                   "--rdzv-conf", rdzv_conf, "--max-restarts", str(max_restarts), "--log-dir", str(log_dir),
                   "--redirects", "3", *(["-m", "hyperacc.bootstrap"] if bootstrap else []), script, *args]  # fmt: skip
            out = workdir / f"agent-{name}.log"
            env_of = {**base, **(agent_env or {}).get(name, {}), "HYPERACC_NODE_NAME": name}
            proc = subprocess.Popen(cmd, env=env_of, stdout=out.open("wb"),
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            self.agents.append(Agent(name, proc, log_dir, out))
            if i == 0:  # let the first agent bind the store's port, so that it is the host
                self.wait_for(functools.partial(_listening, proc.pid, port), 120, "the first agent's store")

    def wait_for(self, cond: Callable[[], object], timeout: float, what: str) -> object:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            value = cond()
            if value:
                return value
            if all(a.proc.poll() is not None for a in self.agents):
                raise AssertionError(f"every agent exited while waiting for {what}\n{self.explain()}")
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{self.explain()}")

    def wait(self, timeout: float) -> dict[str, int | None]:
        end = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        try:
            for a in self.agents:
                try:
                    codes[a.name] = a.proc.wait(timeout=max(end - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    codes[a.name] = None
        finally:
            self.kill()
        return codes

    def kill(self) -> None:
        for a in self.agents:
            try:
                kids = psutil.Process(a.proc.pid).children(recursive=True)
            except psutil.Error:
                kids = []
            for p in [*kids]:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            try:
                os.killpg(a.proc.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
            a.proc.wait(timeout=10)

    def rank_logs(self, name: str, attempt: int) -> list[str]:
        """stdout of every local rank of agent ``name`` in one attempt (torchrun's attempt_N)."""
        agent = next(a for a in self.agents if a.name == name)
        return [p.read_text(errors="replace") for p in sorted(agent.log_dir.glob(f"*/attempt_{attempt}/*/stdout.log"))]

    def losses(self, name: str, attempt: int) -> dict[int, list[float]]:
        """step -> losses printed by the agent's ranks (``--log-every 1``) in that attempt."""
        out: dict[int, list[float]] = {}
        for text in self.rank_logs(name, attempt):
            for m in re.finditer(r"^rank \d+ step (\d+) loss ([0-9.]+) world (\d+)$", text, re.M):
                out.setdefault(int(m.group(1)), []).append(float(m.group(2)))
        return out

    def explain(self) -> str:
        parts = []
        for a in self.agents:
            parts.append(f"--- agent {a.name} (exit {a.proc.poll()}):\n" + a.output.read_text(errors="replace")[-2500:])
            for p in sorted(a.log_dir.glob("*/attempt_*/*/stderr.log")):
                text = p.read_text(errors="replace")
                if text.strip():
                    parts.append(f"--- {p.relative_to(self.workdir)}:\n{text[-1500:]}")
        return "\n".join(parts)


def _listening(pid: int, port: int) -> bool:
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="tcp"))  # fmt: skip
    except psutil.Error:
        return False
