"""Triple-buffer prefetch vs the usual loop: step-time p50/p99 (CPU), H2D bandwidth and step p99 (GPU).

CPU part (always): a DataLoader whose batches cost ``--load-ms`` to produce, with a storage stall of
``--stall-ms`` every ``--stall-every`` batches, feeding a step that keeps the CPU idle for
``--compute-ms`` (as while a GPU computes). Baseline: iterate the DataLoader directly. Ours: the same
DataLoader wrapped in ``DevicePrefetcher(..., "cpu")`` (a bounded queue filled by one thread).

GPU part (when CUDA is present): batches of uint8 images moved to the GPU.
  * H2D bandwidth: ``DataLoader(pin_memory=True)`` + ``.to(device, non_blocking=True)`` (a fresh pinned
    tensor per batch, copy on the compute stream) vs ``DevicePrefetcher(DataLoader(), "cuda")``
    (reused pinned slots, copy on a side stream).
  * Step time: the same two pipelines feeding a fixed GPU workload; per-step device times from CUDA
    events recorded on the compute stream (no host synchronisation inside the loop).

    .venv/bin/python bench/prefetch.py           # 400 steps
    .venv/bin/python bench/prefetch.py --quick   # 150 steps (< 60 s)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _machine import describe as machine

from hyperacc.data.prefetch import DevicePrefetcher  # noqa: E402


class SlowBatches(Dataset):
    """Each item is a whole batch (use with batch_size=None): a tensor of ``shape`` that took
    ``load_ms`` to produce, and ``stall_ms`` more every ``stall_every`` items (a cold read)."""

    def __init__(
        self, n: int, shape: tuple[int, ...], load_ms: float, stall_ms: float, stall_every: int
    ) -> None:
        self.n, self.shape = n, shape
        self.load_s, self.stall_s, self.stall_every = load_ms / 1e3, stall_ms / 1e3, stall_every

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        delay = self.load_s + (self.stall_s if self.stall_every and i % self.stall_every == 0 and i else 0.0)
        time.sleep(delay)  # I/O-like wait: the GIL is free for the training thread meanwhile
        x = torch.full(self.shape, i % 251, dtype=torch.uint8)
        return x, torch.tensor(i)


def pct(values: list[float] | np.ndarray) -> tuple[float, float, float]:
    a = np.asarray(values, dtype=np.float64)
    return float(np.percentile(a, 50)), float(np.percentile(a, 99)), float(a.max())


# ----------------------------------------------------------------------------- CPU


def cpu_loop(source, compute_s: float) -> tuple[list[float], list[float]]:
    steps, waits = [], []
    it = iter(source)
    t_prev = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        _ = batch[0][0, 0]  # touch the batch
        time.sleep(compute_s)
        t2 = time.perf_counter()
        waits.append((t1 - t0) * 1e3)
        steps.append((t2 - t_prev) * 1e3)
        t_prev = t2
    return steps[1:], waits[1:]  # the first step includes start-up


def cpu_part(args) -> None:
    ds = SlowBatches(args.steps, (64, 3, 32, 32), args.load_ms, args.stall_ms, args.stall_every)
    print(
        f"CPU: {args.steps} steps; batch produced in {args.load_ms} ms (+{args.stall_ms} ms every "
        f"{args.stall_every}); step computes {args.compute_ms} ms with the CPU idle"
    )
    rows = []
    for workers in (0, 1):
        loader = DataLoader(ds, batch_size=None, num_workers=workers)
        base_steps, base_waits = cpu_loop(loader, args.compute_ms / 1e3)
        loader = DataLoader(ds, batch_size=None, num_workers=workers)
        our_steps, our_waits = cpu_loop(DevicePrefetcher(loader, "cpu", slots=3), args.compute_ms / 1e3)
        rows.append((workers, pct(base_steps), pct(our_steps), pct(base_waits), pct(our_waits)))
    header = (
        f"{'DataLoader workers':>18} | {'step p50 ms':>15} {'step p99 ms':>15} {'step max ms':>15} | "
        f"{'data-wait p99 ms':>17} | {'p99 ratio':>9}"
    )
    print(f"{'':>18} | {'DataLoader / DataLoader+DevicePrefetcher(cpu)':^49} |")
    print(header)
    print("-" * len(header))
    for workers, b, o, bw, ow in rows:
        print(
            f"{workers:>18} | {b[0]:>7.2f} /{o[0]:>6.2f} {b[1]:>7.2f} /{o[1]:>6.2f} {b[2]:>7.2f} /{o[2]:>6.2f} | "
            f"{bw[1]:>7.2f} /{ow[1]:>7.2f} | {b[1] / o[1]:>8.2f}x"
        )
    print("p99 ratio = baseline step p99 / prefetched step p99 (higher is better).")


# ----------------------------------------------------------------------------- GPU


class ImageBatches(Dataset):
    """Items are whole batches of uint8 images (batch_size=None), produced fresh each time as a
    DataLoader's collate would."""

    def __init__(self, n: int, shape: tuple[int, ...]) -> None:
        self.n, self.shape = n, shape
        self.src = torch.randint(0, 256, shape, dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.src.clone()


def gpu_bandwidth(shape: tuple[int, ...], batches: int, device: torch.device) -> tuple[float, float]:
    nbytes = int(np.prod(shape))
    ds = ImageBatches(batches, shape)

    def run(make_iter) -> float:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        last = None
        for x in make_iter():
            last = x
        del last
        torch.cuda.synchronize(device)
        return batches * nbytes / (time.perf_counter() - t0) / 1e9

    def baseline():
        for x in DataLoader(ds, batch_size=None, pin_memory=True, num_workers=0):
            yield x.to(device, non_blocking=True)

    def ours():
        return DevicePrefetcher(DataLoader(ds, batch_size=None, num_workers=0), device)

    run(baseline)  # warm up allocators and pinned pools
    run(ours)
    return run(baseline), run(ours)


def gpu_steps(
    shape: tuple[int, ...], steps: int, device: torch.device, work: int
) -> tuple[list[float], list[float]]:
    ds = ImageBatches(steps, shape)
    weight = torch.randn(work, work, device=device)

    def step(x: torch.Tensor) -> None:
        y = weight * x[:8].float().mean()  # depends on the batch, so it waits for its copy
        for _ in range(2):
            y = torch.tanh(y @ weight)

    def timed(batches) -> list[float]:
        events = []
        for x in batches:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            events.append(ev)
            step(x)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        events.append(end)
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) for a, b in zip(events[1:-1], events[2:], strict=True)]

    def baseline():
        for x in DataLoader(ds, batch_size=None, pin_memory=True, num_workers=0):
            yield x.to(device, non_blocking=True)

    timed(baseline())
    base = timed(baseline())
    ours = timed(DevicePrefetcher(DataLoader(ds, batch_size=None, num_workers=0), device))
    return base, ours


def gpu_part(args) -> None:
    if not torch.cuda.is_available():
        print("GPU: skipped (no CUDA device on this machine); run this script on a GPU host for H2D figures.")
        return
    device = torch.device("cuda", torch.cuda.current_device())
    shape = (64, 3, 224, 224) if args.quick else (256, 3, 224, 224)
    mb = int(np.prod(shape)) / 1e6
    base_bw, our_bw = gpu_bandwidth(shape, 20 if args.quick else 60, device)
    print(f"GPU: {torch.cuda.get_device_name(device)}; batches of {shape} uint8 ({mb:.1f} MB)")
    print(f"{'':<40} {'pin_memory+to()':>16} {'DevicePrefetcher':>17} {'ratio':>7}")
    print(f"{'H2D throughput GB/s':<40} {base_bw:>16.2f} {our_bw:>17.2f} {our_bw / base_bw:>6.2f}x")
    base, ours = gpu_steps(shape, args.steps, device, 4096)
    b, o = pct(base), pct(ours)
    print(f"{'step p50 ms (CUDA events)':<40} {b[0]:>16.3f} {o[0]:>17.3f} {b[0] / o[0]:>6.2f}x")
    print(f"{'step p99 ms (CUDA events)':<40} {b[1]:>16.3f} {o[1]:>17.3f} {b[1] / o[1]:>6.2f}x")
    print(f"{'step max ms (CUDA events)':<40} {b[2]:>16.3f} {o[2]:>17.3f} {b[2] / o[2]:>6.2f}x")
    print("ratios: throughput = ours / baseline; step times = baseline / ours (higher is better).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--load-ms", type=float, default=3.0)
    ap.add_argument("--stall-ms", type=float, default=15.0)
    ap.add_argument("--stall-every", type=int, default=25)
    ap.add_argument("--compute-ms", type=float, default=5.0)
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 150 if args.quick else 400
    print(f"machine: {machine()}")
    print()
    cpu_part(args)
    print()
    gpu_part(args)


if __name__ == "__main__":
    main()
