"""A Hugging Face Trainer job that knows nothing of hyperacc: a tiny GPT-2 on CPU ranks.

    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --steps 200
    hyperacc run --run-dir runs/hf --nproc-per-node 4 -- examples/train_hf.py --steps 200

The model is built from a config (no weights are downloaded), the data are deterministic tokens, DDP
runs over gloo (the Trainer sets it up from torchrun's environment), ``--accum`` micro-batches make one
optimizer step. Under the test harness each rank reports its final parameters' checksum and, with
``--timing``, each step's wall and thread CPU time (a TrainerCallback), for bench/overhead.py.
``--trace-dir DIR`` traces it under plain torchrun with ``hyperacc.integrations.hf.HyperaccCallback``.
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

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--timing", action="store_true", help="report each step's wall and CPU time")
    p.add_argument("--trace-dir", default=None, help="trace in-process with hyperacc's callback (no hyperacc run)")
    args = p.parse_args()

    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.wall: list[int] = []
            self.cpu: list[int] = []
            self._t = (time.perf_counter_ns(), time.thread_time_ns())

        def on_step_end(self, *args: object, **kwargs: object) -> None:
            now = (time.perf_counter_ns(), time.thread_time_ns())
            self.wall.append(now[0] - self._t[0])
            self.cpu.append(now[1] - self._t[1])
            self._t = now

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=32)
    model = GPT2LMHeadModel(config)
    out = tempfile.mkdtemp(prefix="hf-job-")
    targs = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=args.accum,
        max_steps=args.steps, learning_rate=1e-3, logging_steps=10_000, save_strategy="no", report_to=[],
        use_cpu=True, ddp_backend="gloo", seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    times = StepTimes()
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(512, 32, 256))
    if args.timing:
        trainer.add_callback(times)
    if args.trace_dir:
        from hyperacc.integrations.hf import HyperaccCallback

        trainer.add_callback(HyperaccCallback(args.trace_dir))
    try:
        trainer.train()
    finally:
        shutil.rmtree(out, ignore_errors=True)  # the Trainer's output folder (nothing is saved in it)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    result = {"rank": int(os.environ.get("RANK", "0")), "checksum": checksum}
    if args.timing:
        result.update(step_ns=times.wall, cpu_ns=times.cpu)
    harness.write_result(result)
    harness.finish()


if __name__ == "__main__":
    main()
