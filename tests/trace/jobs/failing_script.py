"""A script that fails in its backward, for the bootstrap's fidelity test: it prints what Python gave it
(``__file__``, ``sys.path[0]``, ``sys.argv``) and raises from a custom autograd function's backward, the
error wrapped by the script (a chained exception), through a module's forward and ``backward()``; in
mode ``record`` the step is decorated with torchelastic's ``@record``, which writes the error file
named by ``TORCHELASTIC_ERROR_FILE``."""

import sys

import torch

print(repr(__file__), repr(sys.path[0]), repr(sys.argv), flush=True)


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        raise ValueError("boom in backward")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 3:
            raise KeyError("bad batch")  # raised inside the model's forward
        return Boom.apply(self.lin(x))


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):  # complete steps first, so that the tracer's forward wrapper is in place
    model(torch.randn(2, 4)).sum().detach()
    opt.step()
mode = sys.argv[1]


def step() -> None:
    if mode == "forward":
        model(torch.randn(3, 4))
    else:
        model(torch.randn(2, 4)).sum().backward()


if mode == "record":  # torchelastic's decorator (torchtitan's main has it): it writes the error file
    from torch.distributed.elastic.multiprocessing.errors import record

    step = record(step)
try:
    step()
except (ValueError, KeyError) as exc:
    raise RuntimeError(f"step failed in {mode}") from exc
