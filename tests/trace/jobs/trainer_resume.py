"""Job script: a trainer with hyperacc's callback trains 8 steps, saving at step 4, then a second
trainer in the same process resumes from that checkpoint (as a restarted job would) and trains steps
4-7 again. One process, no torchrun: ``python trainer_resume.py hf|lightning RUN_DIR WORK_DIR``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

framework, run_dir, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 256, (256, 32), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=256, n_positions=32))


if framework == "hf":
    from transformers import Trainer, TrainingArguments

    from hyperacc.integrations.hf import HyperaccCallback

    class LMTokens(Tokens):
        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def trainer() -> Trainer:
        args = TrainingArguments(
            output_dir=str(work), per_device_train_batch_size=4, max_steps=8, save_strategy="steps", save_steps=4,
            learning_rate=1e-3, logging_steps=10_000, report_to=[], use_cpu=True, seed=0,
            dataloader_num_workers=0, disable_tqdm=True,
        )  # fmt: skip
        return Trainer(model=gpt2(), args=args, train_dataset=LMTokens(), callbacks=[HyperaccCallback(run_dir)])

    trainer().train()
    trainer().train(resume_from_checkpoint=str(work / "checkpoint-4"))
else:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from hyperacc.integrations.lightning import HyperaccCallback

    class TinyGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = gpt2()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def fit(ckpt_path: str | None) -> None:
        saves = ModelCheckpoint(dirpath=work, every_n_train_steps=4, save_top_k=-1)
        t = L.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[HyperaccCallback(run_dir), saves])  # fmt: skip
        t.fit(TinyGPT(), torch.utils.data.DataLoader(Tokens(), batch_size=4), ckpt_path=ckpt_path)

    fit(None)
    fit(str(next(work.glob("*step=4.ckpt"))))
