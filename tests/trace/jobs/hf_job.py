"""Rank script: a Hugging Face Trainer run on CPU ranks, with no hyperacc in it.

A tiny GPT-2 built from a config (no weights are downloaded), deterministic token data, DDP over gloo
(the Trainer sets it up from torchrun's environment), ``--accum`` micro-batches per optimizer step.
Each rank reports its final parameters' checksum and its own step times.
"""

from __future__ import annotations

import argparse
import os
import tempfile

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
    args = p.parse_args()

    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

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
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(512, 32, 256))
    trainer.train()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    harness.write_result({"rank": int(os.environ.get("RANK", "0")), "checksum": checksum})
    harness.finish()


if __name__ == "__main__":
    main()
