"""YUV 4:2:0 (NV12) 1080p -> RGB, with and without resize: torch paths vs OpenCV on one core.

Baseline: what a loader does today, OpenCV ``cvtColor(COLOR_YUV2RGB_NV12)`` per frame on one core
(``cv2.setNumThreads(1)``), then ``cv2.resize(INTER_AREA)`` and float normalisation where the case
asks for it. Ours: ``hyperacc.data.yuv.yuv_to_rgb`` on a batch, CPU with one torch thread, and on the
GPU when one is present (timed with a device synchronisation around each batch), plus the PCIe
saving of copying YUV (1.5 bytes/pixel) instead of RGB (3 bytes/pixel).

    .venv/bin/python bench/yuv.py           # batches of 8 frames, 5 repeats
    .venv/bin/python bench/yuv.py --quick   # batches of 4 frames, 3 repeats (< 60 s)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _machine import describe as machine

from hyperacc.data.yuv import YUVToRGB  # noqa: E402

H, W = 1080, 1920
OUT = (224, 224)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def best_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()  # warm up (allocations, kernels)
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.min(times))  # the least disturbed run: this machine is shared and noisy


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
    ("NV12 -> RGB uint8 (float path)", cv_rgb, {"exact": False}),
    ("NV12 -> RGB 224x224 uint8 (exact + AA resize)", cv_rgb_resized, {"size": OUT}),
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
    args = ap.parse_args()
    batch = args.batch or (4 if args.quick else 8)
    repeats = 3 if args.quick else 5
    cv2.setNumThreads(1)
    torch.set_num_threads(1)

    frames = np.random.default_rng(0).integers(0, 256, (batch, H * 3 // 2, W), dtype=np.uint8)
    x_cpu = torch.from_numpy(frames)
    gpu = torch.cuda.is_available()
    x_gpu = x_cpu.cuda() if gpu else None
    print(f"machine: {machine()}")
    print(
        f"{batch} random 1080p NV12 frames per batch; one CPU thread for OpenCV and torch; best of {repeats}"
    )
    print()
    header = f"{'case':<44} {'OpenCV fps':>10} {'torch CPU fps':>13} {'ratio':>7} {'torch GPU fps':>13} {'ratio':>8}"
    print(header)
    print("-" * len(header))
    for label, baseline, options in CASES:
        cv_fps = batch / best_time(lambda b=baseline: b(frames), repeats)
        conv = YUVToRGB(field=None, **options)
        cpu_fps = batch / best_time(lambda c=conv: c(x_cpu), repeats)
        line = f"{label:<44} {cv_fps:>10.1f} {cpu_fps:>13.1f} {cpu_fps / cv_fps:>6.2f}x"
        if gpu:
            conv_gpu = YUVToRGB(field=None, **options)
            gpu_fps = batch / best_time(lambda c=conv_gpu: c(x_gpu), repeats * 4, torch.cuda.synchronize)
            line += f" {gpu_fps:>13.1f} {gpu_fps / cv_fps:>7.1f}x"
        else:
            line += f" {'skipped':>13} {'':>8}"
        print(line)
    print("ratio = torch fps / OpenCV fps (one core); higher is better.")
    if not gpu:
        print("GPU: skipped (no CUDA device on this machine); the same script measures it on a GPU host.")
        return

    # What crosses PCIe: raw YUV (1.5 B/px) vs decoded RGB (3 B/px), pinned host memory.
    yuv_host = x_cpu.pin_memory()
    rgb_host = torch.empty((batch, 3, H, W), dtype=torch.uint8).pin_memory()
    t_yuv = best_time(lambda: yuv_host.to("cuda", non_blocking=True), repeats * 4, torch.cuda.synchronize)
    t_rgb = best_time(lambda: rgb_host.to("cuda", non_blocking=True), repeats * 4, torch.cuda.synchronize)
    print()
    print(f"{'H2D copy of one batch':<44} {'RGB ms':>10} {'YUV ms':>13} {'ratio':>7}")
    print(f"{'':<44} {t_rgb * 1e3:>10.2f} {t_yuv * 1e3:>13.2f} {t_rgb / t_yuv:>6.2f}x")


if __name__ == "__main__":
    main()
