"""Hugging Face Trainer: ``Trainer(..., callbacks=[HyperaccCallback("runs/exp1")])``.

The callback installs automatic tracing when it is created, which is before ``Trainer.train()`` wraps
the model in DDP, so the gradient collectives are timed as under ``hyperacc run``; it flushes when
training ends. A run resumed from a checkpoint (``train(resume_from_checkpoint=...)``) numbers its steps
from the checkpoint's ``global_step``, as the run it continues (``Tracer.resume_at``). Under
``hyperacc run`` (tracing already installed) it does nothing more.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback

from hyperacc.analysis import live_aggregate
from hyperacc.trace import install_auto


class HyperaccCallback(TrainerCallback):
    def __init__(self, run_dir: str | os.PathLike | None = None, **trace_options: Any) -> None:
        live_aggregate.install()  # live window summaries, as under ``hyperacc run``
        self.auto = install_auto(run_dir, **trace_options)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step:  # the Trainer has loaded its checkpoint by now
            self.auto.tracer.resume_at(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.auto.tracer.flush()
