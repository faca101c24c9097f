"""YUV 4:2:0 (NV12) 1080p -> RGB, with and without resize: hyperacc's paths against OpenCV on one core.

Baseline: what a loader does today, OpenCV ``cvtColor(COLOR_YUV2RGB_NV12)`` per frame, then
``cv2.resize(INTER_AREA)`` and float normalisation where the case asks for it. Candidates:
``hyperacc.data.yuv.yuv_to_rgb`` with its CPU default (OpenCV's conversion, then torch's resize) and
with the tensor path forced (``backend="torch"``, the code that runs on a device), and on the GPU when
one is present (timed with a device synchronisation around each batch), plus the PCIe saving of
copying YUV (1.5 bytes/pixel) instead of RGB (3 bytes/pixel).

Method: one batch of random frames, touched once before timing and reused by every case; OpenCV and
torch both on one thread; every function warmed up 3 times; then the baseline and the candidate
alternate for ``--repeats`` rounds (so background load falls on both); fps is the median with the
range in brackets, a ratio is the median of the per-round ratios (calls made moments apart). A baseline shared by several rows is measured once per row, so the rows
show how stable it is. Wrap the run in ``flock /tmp/hyperacc-timing.lock``.

    .venv/bin/python bench/yuv.py           # batches of 8 frames, 9 rounds
    .venv/bin/python bench/yuv.py --quick   # batches of 4 frames, 5 rounds
    .venv/bin/python bench/yuv.py --hold    # with the memory stabilizer's hold (glibc mmap threshold)

Each call returns a fresh batch buffer (6 MB per 1080p frame); glibc maps blocks above its mmap
threshold fresh each time, so first-touch page faults are part of every call unless the host allocator
holds freed memory (``--hold``, what ``hyperacc.stabilize`` does by default).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _machine import describe as machine  # noqa: E402

from hyperacc.data.yuv import YUVToRGB  # noqa: E402

H, W = 1080, 1920
OUT = (224, 224)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
WARMUP = 3


def alternate(fns: list[Callable[[], object]], rounds: int, sync: Callable[[], None] = lambda: None) -> list[list[float]]:
    """Seconds per call of each function, the functions taking turns in every round."""
    for fn in fns:
        for _ in range(WARMUP):
            fn()
        sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            sync()
            times[i].append(time.perf_counter() - t0)
    return times


def fps(batch: int, times: list[float]) -> tuple[float, float, float]:
    """(median, lowest, highest) frames per second."""
    rates = [batch / t for t in times]
    return statistics.median(rates), min(rates), max(rates)


def paired(base: list[float], other: list[float]) -> float:
    """Median over rounds of base time / other time: each ratio compares calls made moments apart."""
    return statistics.median(b / o for b, o in zip(base, other, strict=True))


def fmt(r: tuple[float, float, float]) -> str:
    return f"{r[0]:7.1f} [{r[1]:.0f}-{r[2]:.0f}]"


# ----------------------------------------------------------------------------- OpenCV baselines


def cv_rgb(frames: np.ndarray) -> list[np.ndarray]:
    return [cv2.cvtColor(f, cv2.COLOR_YUV2RGB_NV12) for f in frames]


def cv_rgb_resized(frames: np.ndarray) -> list[np.ndarray]:
    return [
        cv2.resize(cv2.cvtColor(f, cv2.COLOR_YUV2RGB_NV12), OUT[::-1], interpolation=cv2.INTER_AREA)
        for f in frames
    ]


def cv_normalised(frames: np.ndarray) -> np.ndarray:
    mean = np.array(MEAN, np.float32) * 255
    inv = 1 / (np.array(STD, np.float32) * 255)
    out = np.empty((len(frames), 3, *OUT), np.float32)
    for i, rgb in enumerate(cv_rgb_resized(frames)):
        out[i] = ((rgb.astype(np.float32) - mean) * inv).transpose(2, 0, 1)
    return out


CASES = [
    # label, OpenCV baseline, yuv_to_rgb options
    ("NV12 -> RGB uint8 (exact)", cv_rgb, {}),
    ("NV12 -> RGB uint8 (exact, same baseline)", cv_rgb, {}),
    ("NV12 -> RGB uint8 (exact=False)", cv_rgb, {"exact": False}),
    ("NV12 -> RGB 224x224 uint8 (AA resize)", cv_rgb_resized, {"size": OUT}),
    (
        "NV12 -> RGB 224x224 float32 normalised",
        cv_normalised,
        {"size": OUT, "dtype": torch.float32, "mean": MEAN, "std": STD},
    ),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None, help="alternating rounds per case")
    ap.add_argument("--hold", action="store_true", help="hold freed memory as hyperacc.stabilize does")
    args = ap.parse_args()
    held = "host allocator as is"
    if args.hold:
        from hyperacc.stabilize import memory

        held = memory.hold_freed_memory(memory.detect_host_allocator())
    batch = args.batch or (4 if args.quick else 8)
    rounds = args.repeats or (5 if args.quick else 9)
    cv2.setNumThreads(1)
    torch.set_num_threads(1)

    frames = np.random.default_rng(0).integers(0, 256, (batch, H * 3 // 2, W), dtype=np.uint8)
    frames += 0  # touch every page before any timing
    x_cpu = torch.from_numpy(frames)
    gpu = torch.cuda.is_available()
    x_gpu = x_cpu.cuda() if gpu else None
    print(f"machine: {machine()}")
    print(
        f"{batch} random 1080p NV12 frames per batch, the same frames for every case; one thread for OpenCV "
        f"and torch; {WARMUP} warm-up calls, then {rounds} alternating rounds; fps = median [lowest-highest]"
    )
    print(f"memory: {held}")
    print()
    header = (
        f"{'case':<42} {'OpenCV fps':>19} {'hyperacc CPU fps':>19} {'ratio':>6} {'tensor path CPU':>19} "
        f"{'ratio':>6} {'GPU fps':>10} {'ratio':>7}"
    )
    print(header)
    print("-" * len(header))
    for label, baseline, options in CASES:
        default = YUVToRGB(field=None, **options)
        tensor = YUVToRGB(field=None, backend="torch", **options)
        t_cv, t_default, t_tensor = alternate(
            [lambda b=baseline: b(frames), lambda c=default: c(x_cpu), lambda c=tensor: c(x_cpu)], rounds
        )
        cv, ours, tens = fps(batch, t_cv), fps(batch, t_default), fps(batch, t_tensor)
        r_ours, r_tens = paired(t_cv, t_default), paired(t_cv, t_tensor)
        line = f"{label:<42} {fmt(cv):>19} {fmt(ours):>19} {r_ours:>5.2f}x {fmt(tens):>19} {r_tens:>5.2f}x"
        if gpu:
            conv_gpu = YUVToRGB(field=None, **options)
            (t_gpu,) = alternate([lambda c=conv_gpu: c(x_gpu)], rounds * 4, torch.cuda.synchronize)
            g = fps(batch, t_gpu)
            line += f" {g[0]:>10.1f} {g[0] / cv[0]:>6.1f}x"
        else:
            line += f" {'skipped':>10} {'':>7}"
        print(line)
    print("ratio = median over rounds of (OpenCV time / this time) within the same round; higher is better.")
    print("hyperacc CPU = yuv_to_rgb's default on a CPU (OpenCV's conversion when it is exact, then torch's")
    print("resize); tensor path = backend='torch', the arithmetic that runs on a device.")
    if not gpu:
        print("GPU: skipped (no CUDA device on this machine); the same script measures it on a GPU host.")
        return

    # What crosses PCIe: raw YUV (1.5 B/px) vs decoded RGB (3 B/px), pinned host memory.
    yuv_host = x_cpu.pin_memory()
    rgb_host = torch.empty((batch, 3, H, W), dtype=torch.uint8).pin_memory()
    t_yuv, t_rgb = alternate(
        [lambda: yuv_host.to("cuda", non_blocking=True), lambda: rgb_host.to("cuda", non_blocking=True)],
        rounds * 4,
        torch.cuda.synchronize,
    )
    print()
    print(f"{'H2D copy of one batch':<42} {'RGB ms':>10} {'YUV ms':>13} {'ratio':>7}")
    ms_rgb, ms_yuv = statistics.median(t_rgb) * 1e3, statistics.median(t_yuv) * 1e3
    print(f"{'':<42} {ms_rgb:>10.2f} {ms_yuv:>13.2f} {ms_rgb / ms_yuv:>6.2f}x")


if __name__ == "__main__":
    main()
