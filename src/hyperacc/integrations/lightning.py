"""PyTorch Lightning: ``Trainer(..., callbacks=[HyperaccCallback("runs/exp1")])``.

The callback installs automatic tracing when it is created, which is before the strategy wraps the
model in DDP, so the gradient collectives are timed as under ``hyperacc run``; it flushes when
training ends. A run resumed from a checkpoint (``fit(..., ckpt_path=...)``) numbers its steps from the
checkpoint's ``global_step``, as the run it continues (``Tracer.resume_at``). Under ``hyperacc run``
(tracing already installed) it does nothing more.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L

from hyperacc.analysis import live_aggregate
from hyperacc.trace import install_auto


class HyperaccCallback(L.Callback):
    def __init__(self, run_dir: str | os.PathLike | None = None, **trace_options: Any) -> None:
        super().__init__()
        live_aggregate.install()  # live window summaries, as under ``hyperacc run``
        self.auto = install_auto(run_dir, **trace_options)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_step:  # the checkpoint is restored by now
            self.auto.tracer.resume_at(trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.auto.tracer.flush()
