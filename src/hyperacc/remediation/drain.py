"""Draining a node out of an elastic torchrun job, at a checkpoint boundary, on torch's own machinery.

A drain is asked for with a request file, ``RUN_DIR/remediation/drain-request.json`` (``request_drain``),
written by the remediation executor when the policy decides one, or by a person. Every rank of the job
runs a ``NodeDrain`` (``hyperacc.elastic.Checkpointer`` does it for the script); at each checkpoint
boundary rank 0 reads the request, checks the bounds again, and the ranks agree on it in the same
small all-reduce that agrees on the step. After the checkpoint is saved:

1. rank 0 records the drain (event log), adds the node's name to the exclusion file and closes the
   request, then every rank meets at a barrier (the checkpoint is committed);
2. the drained node's local rank 0 sets a key in the workers' store, then sends SIGTERM to its torchrun
   agent. torchrun stops its workers and exits *without* closing the rendezvous (it does that only on a
   death signal), so the job lives on. (The key comes first: the agent's SIGTERM to its workers can stop
   that rank at once, and a key never set left the survivors waiting ``signal_timeout_s``);
3. the other ranks wait for that key and exit with
   ``RESTART_EXIT_CODE``; their agents restart them (one of ``--max-restarts``), re-rendezvous without
   the drained node once its heartbeat expires (``keep_alive_interval`` x ``keep_alive_max_attempt``
   of ``--rdzv-conf``), and the script resumes from the checkpoint.

The node that hosts the c10d rendezvous store (its agent listens on the endpoint's port) is never
drained: the job cannot survive its loss. Nor is any node when torchrun shares its store with the
workers (the default): with torch 2.13 a restarted worker group then reads the previous group's
addresses and fails (pytorch#135712); ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's
environment avoids it. Rules, bounds and events: docs/remediation.md.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from hyperacc import process
from hyperacc.remediation import events
from hyperacc.remediation.config import RemediationConfig
from hyperacc.remediation.exclusion import add_exclusions, node_name
from hyperacc.remediation.policy import drain_refusal

log = logging.getLogger(__name__)

REQUEST_FILE = "drain-request.json"
MEMBERSHIP_FILE = "membership.json"
RESTART_EXIT_CODE = 75  # EX_TEMPFAIL: "try again"; torchrun restarts the worker group


def request_drain(
    run_dir: str | os.PathLike,
    node: str,
    *,
    reason: str,
    rule: str = "manual",
    step: int | None = None,
    finding: dict[str, Any] | None = None,
) -> Path:
    """Ask the job to drain ``node`` at its next checkpoint boundary (atomic write; replaces a pending one)."""
    path = events.remediation_dir(run_dir) / REQUEST_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"action": "drain", "node": node, "reason": reason, "rule": rule, "requested_step": step,
            "finding": finding, "id": uuid.uuid4().hex[:12], "time": time.time()}  # fmt: skip
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, default=str))
    os.replace(tmp, path)
    return path


def read_request(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    path = events.remediation_dir(run_dir) / REQUEST_FILE
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        log.warning("hyperacc: unreadable drain request %s; ignored", path)
        return None
    return body if isinstance(body, dict) and body.get("node") else None


def close_request(run_dir: str | os.PathLike, request: dict[str, Any], status: str) -> None:
    """Move the request aside with its outcome, so it is never acted on twice (not after a restart)."""
    path = events.remediation_dir(run_dir) / REQUEST_FILE
    try:
        os.replace(path, path.with_name(f"drain-request.{request.get('id', 'x')}.{status}.json"))
    except FileNotFoundError:
        pass


def read_membership(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The nodes of the job's current round as rank 0 last wrote them (name, ranks, drainable, why not)."""
    try:
        return json.loads((events.remediation_dir(run_dir) / MEMBERSHIP_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None


def _agent() -> tuple[int | None, str | None]:
    """The torchrun agent that started this process, or why there is none."""
    import psutil

    try:
        parent = psutil.Process(os.getppid())
        cmdline = " ".join(parent.cmdline())
    except psutil.Error as exc:
        return None, f"cannot inspect the parent process ({exc})"
    if "torch.distributed.run" in cmdline or "torchrun" in cmdline:
        return parent.pid, None
    return None, "not started by a torchrun agent"


def _rdzv_port(agent: int) -> int | None:
    """The port of ``--rdzv-endpoint`` (or ``PET_RDZV_ENDPOINT``) the agent was started with."""
    import psutil

    try:
        proc = psutil.Process(agent)
        args = proc.cmdline()
        value = None
        for i, arg in enumerate(args):
            for flag in ("--rdzv-endpoint", "--rdzv_endpoint"):
                if arg == flag and i + 1 < len(args):
                    value = args[i + 1]
                elif arg.startswith(flag + "="):
                    value = arg.split("=", 1)[1]
        if value is None:
            value = proc.environ().get("PET_RDZV_ENDPOINT")
    except psutil.Error:
        return None
    if not value or ":" not in value:
        return None
    try:
        return int(value.rsplit(":", 1)[1])
    except ValueError:
        return None


def _hosts_store(agent: int) -> bool:
    """Whether the agent hosts the rendezvous store: it listens on the endpoint's port (on any port when
    the endpoint cannot be read: then it might)."""
    import psutil

    try:
        conns = psutil.Process(agent).net_connections(kind="tcp")
    except psutil.Error:
        return True
    port = _rdzv_port(agent)
    return any(c.status == psutil.CONN_LISTEN and c.laddr and (port is None or c.laddr.port == port) for c in conns)


def _why_not_drainable(agent: int | None, why: str | None) -> str | None:
    """Why this node cannot be drained (None: it can). Checked once, by each node's local rank 0."""
    if why is not None or agent is None:
        return why or "not started by a torchrun agent"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torch's workers then share the agent's store across restarts and a restarted worker group
        # reads the old group's addresses (pytorch#135712; measured with torch 2.13 and gloo here).
        return (
            "torchrun shares its store with the workers and cannot restart them cleanly; start torchrun "
            "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
        )
    if _hosts_store(agent):
        return "its torchrun agent hosts the rendezvous store (the job cannot outlive it)"
    return None


class NodeDrain:
    """In every rank: knows the job's nodes, reads drain requests at boundaries, carries a drain out."""

    def __init__(self, config: RemediationConfig) -> None:
        import torch.distributed as dist

        self.config = config
        self.run_dir = config.resolved_run_dir()
        self.rank = dist.get_rank()
        self.local_rank = process.env_int("LOCAL_RANK", 0)
        self.group_rank = process.env_int("GROUP_RANK", 0)
        self.restarts_left = process.env_int("TORCHELASTIC_MAX_RESTARTS", 0) - process.env_int(
            "TORCHELASTIC_RESTART_COUNT", 0
        )
        me: dict[str, Any] = {"rank": self.rank, "name": node_name(), "group_rank": self.group_rank,
                              "local_rank": self.local_rank, "why_not": None}  # fmt: skip
        self._agent: int | None = None
        if self.local_rank == 0:
            self._agent, why = _agent()
            me["why_not"] = _why_not_drainable(self._agent, why)
        table: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(table, me)
        nodes: dict[int, dict[str, Any]] = {}
        for row in table:
            node = nodes.setdefault(row["group_rank"], {"name": row["name"], "group_rank": row["group_rank"],
                                                         "ranks": [], "why_not": None})  # fmt: skip
            node["ranks"].append(row["rank"])
            if row["local_rank"] == 0:
                node["why_not"] = row["why_not"]
        names = [n["name"] for n in nodes.values()]
        for node in nodes.values():
            if names.count(node["name"]) > 1:
                node["why_not"] = (
                    f"several nodes are called {node['name']!r}; give each its own HYPERACC_NODE_NAME"
                )
        self.members = [nodes[g] for g in sorted(nodes)]
        if self.rank == 0 and self.run_dir is not None:
            body = {"nodes": self.members, "world_size": dist.get_world_size(), "time": time.time(),
                    "restart_count": process.env_int("TORCHELASTIC_RESTART_COUNT", 0),
                    "restarts_left": self.restarts_left}  # fmt: skip
            path = events.remediation_dir(self.run_dir) / MEMBERSHIP_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(body))
            os.replace(tmp, path)

    # ------------------------------------------------------------ rank 0, at a boundary

    def poll(self, step: int) -> int:
        """Rank 0: the index (in ``members``) of the node to drain at this boundary, or -1."""
        if self.rank != 0 or self.run_dir is None:
            return -1
        request = read_request(self.run_dir)
        if request is None:
            return -1
        name = str(request["node"])
        index = next((i for i, n in enumerate(self.members) if n["name"] == name), None)
        history = events.read_events(self.run_dir)
        done = sum(1 for e in history if e.get("kind") == "drain" and e.get("status") == "executed")
        why = drain_refusal(
            self.config,
            nodes=len(self.members),
            drains_done=done,
            restarts_left=self.restarts_left,
            why_not=None if index is None else self.members[index]["why_not"],
        )
        if index is None:
            why = f"{name} is not a node of this job (nodes: {', '.join(n['name'] for n in self.members)})"
        if why is not None or not self.config.acting:
            status = "refused" if why is not None else "would"
            events.append_event(self.run_dir, {
                "kind": "drain", "action": "drain", "status": status, "step": step, "target": name,
                "rule": request.get("rule"), "mode": self.config.mode,
                "reason": why or f"dry-run: would drain {name} here", "detail": {"request": request},
            })  # fmt: skip
            log.warning("hyperacc: drain of %s %s: %s", name, status, why or "dry-run")
            close_request(self.run_dir, request, status)
            return -1
        self._request = request
        return index

    # ------------------------------------------------------------ every rank, after the checkpoint

    def execute(self, index: int, step: int, checkpoint: str | None = None) -> NoReturn:
        """Carry out an agreed drain of ``members[index]``; never returns (see the module docstring)."""
        import torch.distributed as dist

        target = self.members[index]
        if self.rank == 0 and self.run_dir is not None:
            request = getattr(self, "_request", {}) or {}
            exclude = self.config.resolved_exclude_file()
            added = add_exclusions(exclude, [target["name"]]) if exclude else []
            events.append_event(self.run_dir, {
                "kind": "drain", "action": "drain", "status": "executed", "step": step,
                "target": target["name"], "rule": request.get("rule"), "mode": self.config.mode,
                "reason": request.get("reason"),
                "detail": {"checkpoint": checkpoint, "nodes_before": len(self.members),
                           "nodes_after": len(self.members) - 1, "ranks": target["ranks"],
                           "exclude_file": str(exclude) if exclude else None, "excluded": added},
            })  # fmt: skip
            close_request(self.run_dir, request, "executed")
        key = f"hyperacc/drain/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/" \
              f"{process.env_int('TORCHELASTIC_RESTART_COUNT', 0)}/{step}"  # fmt: skip
        try:  # connected before the barrier: the store's host may be among the ranks about to stop
            store = _store(self.config.signal_timeout_s)
        except Exception as exc:  # noqa: BLE001 - without it the survivors just do not wait
            log.warning("hyperacc: cannot reach the workers' store (%s)", exc)
            store = None
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        if self.group_rank == target["group_rank"]:
            if self.local_rank == 0 and self._agent is not None:
                log.warning("hyperacc: draining this node (%s) at step %d: stopping its torchrun agent",
                            target["name"], step)  # fmt: skip
                # the word first: the agent's SIGTERM to its workers can stop this process at once, and
                # without the word the survivors wait the whole signal_timeout_s before they restart
                if store is not None:
                    store.set(key, "signalled")
                os.kill(self._agent, signal.SIGTERM)
            time.sleep(self.config.signal_timeout_s)  # the agent stops this process before then
            log.error("hyperacc: the agent did not stop this drained rank; restarting it instead")
            process.run_exit_hooks()
            os._exit(RESTART_EXIT_CODE)
        try:
            if store is not None:
                store.wait([key], timedelta(seconds=self.config.signal_timeout_s))
        except Exception as exc:  # noqa: BLE001 - exit and restart all the same
            log.warning("hyperacc: no word from the drained node (%s); restarting anyway", exc)
        process.run_exit_hooks()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(RESTART_EXIT_CODE)


def _store(timeout_s: float) -> Any:
    """A client of the job's store (torchrun's agent store at MASTER_ADDR:MASTER_PORT)."""
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        process.env_int("MASTER_PORT", 29500),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
