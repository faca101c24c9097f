"""One process traced as the bootstrap traces it, fed by a DataLoader with a worker and
``persistent_workers=False`` over several epochs: each epoch makes its iterator again, which starts the
worker and plans the epoch (here a sampler that takes ``SLEEP_S`` to draw its order) before the first
``__next__``. Then one pass over a DataLoader without workers (its fetch runs on the training thread:
``data_own``). The last epoch's sampler raises, as a broken one would, and the script catches it.

argv: RUN_DIR EPOCHS SLEEP_S; prints one JSON line: the steps and what the script saw.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from hyperacc.trace import install_auto


class SlowPlan(Sampler[int]):
    def __init__(self, n: int, sleep_s: float, fail_on: int) -> None:
        self.n, self.sleep_s, self.fail_on, self.epoch = n, sleep_s, fail_on, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):  # noqa: ANN204
        self.epoch += 1
        time.sleep(self.sleep_s)  # the epoch's order, drawn when the iterator is made
        if self.epoch == self.fail_on:
            raise LookupError(f"no order for epoch {self.epoch}")
        yield from range(self.n)


def main() -> None:
    run_dir, epochs, sleep_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    auto = install_auto(run_dir, window=0, handle_sigterm=False)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(12, 8), torch.randn(12, 1))
    loader = DataLoader(data, batch_size=4, sampler=SlowPlan(12, sleep_s, fail_on=epochs + 1), num_workers=1)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(epochs):
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    for x, y in DataLoader(data, batch_size=4, num_workers=0):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    try:
        iter(loader)
        error = None
    except LookupError as exc:  # the sampler's own exception, unchanged
        error = str(exc)
    auto.tracer.close()
    print(json.dumps({"error": error, "tracing": auto._on, "weight": model.weight.sum().item()}))


if __name__ == "__main__":
    main()
