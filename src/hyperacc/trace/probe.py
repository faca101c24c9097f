"""Launch-latency probe: how long the host takes to enqueue a fixed burst of tiny device operations.

Every ``probe_every`` steps (the tracer's option; the same steps on every rank, so the cost is aligned across the job) the probe
issues ``ops`` in-place additions on one-element tensors and records the mean host time per operation.
On a GPU that is the kernel-launch path (a slow or contended host shows longer launches, the seed's
cudaLaunchKernel signal); on a CPU it is torch's operator dispatch. The burst never synchronises: on a
GPU the kernels are only enqueued. docs/tracing.md, "Launch-latency probe".
"""

from __future__ import annotations

from time import perf_counter_ns

import torch


class LaunchProbe:
    def __init__(self, ops: int = 32) -> None:
        self.ops = ops
        self._device: torch.device | None = None
        self._a: torch.Tensor | None = None
        self._b: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._range = range(ops)

    def _prepare(self, device: torch.device) -> None:
        self._device = device
        self._a = torch.zeros(1, device=device)
        self._b = torch.ones(1, device=device)
        self._out = torch.empty(1, device=device)
        self._burst()  # the first dispatch of an op is slow; keep it out of the measurements

    def _burst(self) -> None:
        a, b, out = self._a, self._b, self._out
        for _ in self._range:
            torch.add(a, b, out=out)

    def measure(self, device: torch.device) -> int:
        """Mean host nanoseconds to enqueue one tiny op."""
        if device != self._device:
            self._prepare(device)
        with torch.no_grad():
            t0 = perf_counter_ns()
            self._burst()
            return (perf_counter_ns() - t0) // self.ops
