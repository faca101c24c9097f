"""Resumable training: everything a step depends on, saved with torch.distributed.checkpoint at steps
every rank agrees on, so that a restart, a preemption or a drained node loses nothing.

The five lines a training script adds (docs/remediation.md, "Resumable training")::

    from hyperacc.elastic import Checkpointer
    ckpt = Checkpointer("ckpt/", every=50, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
    step = ckpt.resume()        # the step to start from: 0 on a fresh start
        ...                     # in the loop, after optimizer.step() and step += 1:
        ckpt.step_end(step)     # saves every 50 steps; leaves the job there when this node is drained

What is saved: the model and optimizer through ``torch.distributed.checkpoint.state_dict`` (DDP, FSDP
and plain modules alike), the LR scheduler, the step, every rank's RNG states (torch, CUDA, numpy,
Python) and the data position of a ``hyperacc.data.pipeline.Loader`` or an ``OnDemandDistributedSampler``
(through their ``state_dict``). A checkpoint counts once rank 0 has written its ``COMMITTED`` marker;
``resume`` loads the newest committed one. When the job comes back with another number of ranks (an
elastic job after a drain), the data position is carried over so that no sample of the epoch is read
twice: the new ranks start at the first global position not yet read (at most one global batch per new
rank is skipped).

At a boundary the ranks all-reduce ``[step, -step, drain]`` once: a rank whose step differs stops the
job with an error instead of deadlocking in the save, and a pending drain request (read by rank 0) is
agreed by all (``hyperacc.remediation.drain``). Nothing runs between boundaries.

A tracer running in the rank (``hyperacc run``) numbers the steps after ``resume`` as the run it
continues (``Tracer.resume_at``), and does not take the checkpoint's load for a step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import random
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_PREFIX = "step-"
_COMMITTED = "COMMITTED"


def reshard_position(consumed: int, old_world: int, new_world: int) -> int:
    """Where a rank of a ``new_world``-rank job resumes when each of ``old_world`` ranks had consumed
    ``consumed`` units (samples or batches) of the epoch: the first local position whose global position
    (``local * world + rank``) was not read yet. Never reads a unit twice; skips fewer than ``new_world``."""
    if consumed < 0 or old_world < 1 or new_world < 1:
        raise ValueError(f"bad position {consumed} or world sizes {old_world} -> {new_world}")
    return math.ceil(consumed * old_world / new_world)


@contextlib.contextmanager
def _single_process_quiet(distributed: bool) -> Iterator[None]:
    """Without a process group DCP warns on every call that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """Saves at every ``every``-th step and resumes from the newest committed checkpoint."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        loader: Any | None = None,
        keep: int = 2,
        remediation: Any | None = None,
    ) -> None:
        if int(every) < 1:
            raise ValueError(f"every must be >= 1 step (got {every})")
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (got {keep})")
        if loader is not None and not (hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")):
            raise ValueError(
                f"loader {type(loader).__name__} has no state_dict/load_state_dict: pass a "
                "hyperacc.data.pipeline.Loader or an OnDemandDistributedSampler (or loader=None)"
            )
        self.directory = Path(directory)
        self.every = int(every)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loader = loader
        self.keep = keep
        self.resumed_from: int | None = None
        self.last_saved: int | None = None
        self._dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._dist else 0
        self.world_size = dist.get_world_size() if self._dist else 1
        from hyperacc.remediation.config import RemediationConfig

        config = remediation if remediation is not None else RemediationConfig.from_env()
        self.run_dir = config.resolved_run_dir() if config is not None else None
        if self.run_dir is None and os.environ.get("HYPERACC_RUN_DIR", "").strip():
            self.run_dir = Path(os.environ["HYPERACC_RUN_DIR"])
        self._drain = None
        if config is not None and config.mode != "off" and self._dist and os.environ.get("TORCHELASTIC_RUN_ID"):
            from hyperacc.remediation.drain import NodeDrain

            self._drain = NodeDrain(config)  # collective: every rank builds it
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ the boundary

    def step_end(self, step: int) -> None:
        """Call after every optimizer step with the number of steps done. Saves at multiples of ``every``."""
        if step % self.every:
            return
        self._boundary(step)

    def _boundary(self, step: int) -> None:
        drain = self._drain.poll(step) if self._drain is not None else -1
        if self._dist:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            agreed = torch.tensor([step, -step, drain], dtype=torch.int64, device=device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            high, low, drain = int(agreed[0]), -int(agreed[1]), int(agreed[2])
            if high != low:
                raise RuntimeError(
                    f"hyperacc.elastic: ranks disagree on the step at a checkpoint boundary (steps {low} to "
                    f"{high}); call step_end with the same step count on every rank"
                )
        path = self.save(step)
        if drain >= 0 and self._drain is not None:
            self._drain.execute(drain, step, str(path))

    # ------------------------------------------------------------ save

    def _app_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            return {"model": model_sd, "optim": optim_sd}
        return {"model": get_model_state_dict(self.model)}

    def save(self, step: int) -> Path:
        """Save now (every rank must call it with the same step); returns the checkpoint's directory."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        path = self.directory / f"{_PREFIX}{step:09d}"
        state = self._app_state()
        meta = {
            "step": step,
            "world_size": self.world_size,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "data": self.loader.state_dict() if self.loader is not None else None,
        }
        state["meta"] = pickle.dumps(meta)
        state["rng"] = {f"rank{self.rank}": pickle.dumps(_rng_state())}
        with _single_process_quiet(self._dist):
            dcp.save(state, checkpoint_id=str(path), no_dist=not self._dist)
        seconds = time.perf_counter() - t0
        if self.rank == 0:
            marker = {"step": step, "world_size": self.world_size, "time": time.time(), "seconds": seconds}
            tmp = path / f"{_COMMITTED}.tmp"
            tmp.write_text(json.dumps(marker))
            os.replace(tmp, path / _COMMITTED)
            self._prune()
            self._event({"kind": "checkpoint", "status": "saved", "step": step,
                         "detail": {"path": str(path), "world_size": self.world_size, "seconds": round(seconds, 3)}})  # fmt: skip
            log.info("hyperacc.elastic: saved step %d (%d ranks) in %.2f s", step, self.world_size, seconds)
        self.last_saved = step
        return path

    def _committed(self) -> list[tuple[int, Path]]:
        out = []
        if not self.directory.is_dir():
            return out
        for p in self.directory.iterdir():
            if p.name.startswith(_PREFIX) and (p / _COMMITTED).is_file():
                try:
                    out.append((int(p.name[len(_PREFIX) :]), p))
                except ValueError:
                    continue
        return sorted(out)

    def _prune(self) -> None:
        for _step, p in self._committed()[: -self.keep]:
            shutil.rmtree(p, ignore_errors=True)

    def _event(self, event: dict[str, Any]) -> None:
        if self.run_dir is None:
            return
        from hyperacc.remediation import events

        try:
            events.append_event(self.run_dir, event)
        except OSError as exc:
            log.warning("hyperacc.elastic: cannot write the event log in %s (%s)", self.run_dir, exc)

    # ------------------------------------------------------------ resume

    def resume(self) -> int:
        """Load the newest committed checkpoint, if any; returns the step to continue from (0 if none)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        found = self._committed()[-1] if self.rank == 0 and self._committed() else None
        if self._dist:
            box = [None if found is None else (found[0], str(found[1]))]
            dist.broadcast_object_list(box, src=0)
            found = None if box[0] is None else (int(box[0][0]), Path(box[0][1]))
        if found is None:
            return 0
        step, path = found
        # not training: the optimizer state's initialisation (an optimizer step of its own) is no step
        with _tracing_paused():
            t0 = time.perf_counter()
            saved_keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
            state = self._app_state()
            state["meta"] = b""
            rng_key = f"rank{self.rank}"
            if f"rng.{rng_key}" in saved_keys:
                state["rng"] = {rng_key: b""}
            with _single_process_quiet(self._dist):
                dcp.load(state, checkpoint_id=str(path), no_dist=not self._dist)
            if self.optimizer is not None:
                set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            else:
                set_model_state_dict(self.model, state["model"])
        meta = pickle.loads(state["meta"])
        if self.scheduler is not None and meta.get("scheduler") is not None:
            self.scheduler.load_state_dict(meta["scheduler"])
        if self.loader is not None and meta.get("data") is not None:
            self.loader.load_state_dict(self._data_position(meta["data"], int(meta["world_size"])))
        if "rng" in state:
            _set_rng_state(pickle.loads(state["rng"][rng_key]))
        self.resumed_from = step
        self.last_saved = step
        # the tracer of this rank, if one runs, numbers the next step as the run it continues does
        tracing = sys.modules.get("hyperacc.trace.tracer")
        tracer = tracing.current() if tracing is not None else None
        if tracer is not None:
            tracer.resume_at(step)
        if self.rank == 0:
            log.info("hyperacc.elastic: resumed at step %d (saved by %d ranks, now %d) in %.2f s",
                     step, meta["world_size"], self.world_size, time.perf_counter() - t0)  # fmt: skip
            self._event({"kind": "resume", "status": "loaded", "step": step,
                         "detail": {"path": str(path), "saved_world_size": meta["world_size"],
                                    "world_size": self.world_size,
                                    "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}})  # fmt: skip
        return step

    def _data_position(self, saved: dict[str, Any], saved_world: int) -> dict[str, Any]:
        return carry_data_position(saved, saved_world, self.world_size)


def _tracing_paused() -> contextlib.AbstractContextManager[None]:
    """This rank's automatic tracing paused (``AutoTrace.paused``), if ``hyperacc run`` installed it."""
    auto = sys.modules.get("hyperacc.trace.auto")
    installed = auto.installed() if auto is not None else None
    return installed.paused() if installed is not None else contextlib.nullcontext()


def carry_data_position(saved: dict[str, Any], saved_world: int, world: int) -> dict[str, Any]:
    """A loader's or sampler's saved ``state_dict`` made valid for ``world`` ranks (``reshard_position``)."""
    state = dict(saved)
    if saved_world == world:
        return state
    if "batches" in state:  # hyperacc.data.pipeline.Loader
        state["batches"] = reshard_position(int(state["batches"]), saved_world, world)
        state["num_replicas"] = world
    elif "yielded" in state:  # OnDemandDistributedSampler
        state["yielded"] = reshard_position(int(state["yielded"]), saved_world, world)
    else:
        log.warning("hyperacc.elastic: a data position without 'batches' or 'yielded' cannot be carried from "
                    "%d to %d ranks; loaded as saved", saved_world, world)  # fmt: skip
    return state
