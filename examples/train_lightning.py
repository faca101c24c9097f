"""A PyTorch Lightning job that knows nothing of hyperacc: a tiny GPT-2 on CPU ranks.

    torchrun --standalone --nproc-per-node 4 examples/train_lightning.py --steps 200
    hyperacc run --run-dir runs/pl --nproc-per-node 4 -- examples/train_lightning.py --steps 200

The model is built from a config (no weights are downloaded) inside a LightningModule, DDP runs over
gloo (the Trainer sets it up from torchrun's environment) with automatic optimization, so forward,
backward and the gradient all-reduce run inside ``optimizer.step(closure)``; ``--accum`` batches make
one optimizer step. Under the test harness each rank reports its final parameters' checksum and, with
``--timing``, each step's wall and thread CPU time (a Callback), for bench/overhead.py.
``--trace-dir DIR`` traces it under plain torchrun with ``hyperacc.integrations.lightning.HyperaccCallback``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from hyperacc import harness


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--timing", action="store_true", help="report each step's wall and CPU time")
    p.add_argument("--trace-dir", default=None, help="trace in-process with hyperacc's callback (no hyperacc run)")
    args = p.parse_args()

    import lightning as L
    from transformers import GPT2Config, GPT2LMHeadModel

    class TinyGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            cfg = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=32)
            self.model = GPT2LMHeadModel(cfg)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class StepTimes(L.Callback):
        def __init__(self) -> None:
            self.wall: list[int] = []
            self.cpu: list[int] = []
            self._t = (time.perf_counter_ns(), time.thread_time_ns())

        def on_train_batch_end(self, *args: object, **kwargs: object) -> None:
            now = (time.perf_counter_ns(), time.thread_time_ns())
            self.wall.append(now[0] - self._t[0])
            self.cpu.append(now[1] - self._t[1])
            self._t = now

    times = StepTimes()
    callbacks = []
    if args.trace_dir:
        from hyperacc.integrations.lightning import HyperaccCallback

        callbacks.append(HyperaccCallback(args.trace_dir))
    L.seed_everything(0, verbose=False)
    module = TinyGPT()
    loader = torch.utils.data.DataLoader(Tokens(512, 32, 256), batch_size=4, shuffle=False)
    root = tempfile.mkdtemp(prefix="pl-job-")  # the Trainer's folder (no logger, no checkpoint: stays empty)
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")), strategy="ddp", max_steps=args.steps,
        accumulate_grad_batches=args.accum, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        callbacks=([times] if args.timing else []) + callbacks,
    )  # fmt: skip
    try:
        trainer.fit(module, loader)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    checksum = float(sum(p.detach().double().sum() for p in module.parameters()))
    result = {"rank": int(os.environ.get("RANK", "0")), "checksum": checksum}
    if args.timing:
        result.update(step_ns=times.wall, cpu_ns=times.cpu)
    harness.write_result(result)
    harness.finish()


if __name__ == "__main__":
    main()
