"""``make gpu-check``: the CUDA paths of hyperacc on one GPU, checked in a few minutes, as one table.

What it checks (each row: pass/FAIL and the numbers behind it):

1. device-clock columns with 60+ gradient buckets: a world-size-1 NCCL DDP job through the tracer's
   communication hook; every step gets ``dev_step_ns``, ``dev_self_ns`` and ``dev_comm_wait_ns`` from a
   fixed event budget, whatever the bucket count; gradients bit-identical to an untraced DDP twin
   (the hook's future semantics on NCCL);
2. no device synchronisation per step: the traced steps run under ``torch.cuda.set_sync_debug_mode
   ("error")``, so any synchronising call inside the tracer raises;
3. allocator counters: ``device_allocs`` and ``alloc_retries`` read every ``alloc_every`` steps;
4. the pinned prefetcher: batches on the device equal the loader's, in order;
5. YUV -> RGB on the device: bit-exact with OpenCV's BT.601 conversion on the CPU;
6. the device-side pacing delay: a collective launched inside ``PacingHook.delayed(5 ms)`` starts on
   the device about 5 ms later while the host returns at once, and the first use (which starts the
   clock calibration) does not wait for the device either;
7. per-step cost: median step time of the traced model against an untraced twin, and with one part
   of the tracer off at a time (device events, signals, probe and allocator counters, resource
   sampler), alternating blocks;
8. end to end: the unmodified ``examples/train_ddp.py`` on NCCL through ``hyperacc run`` (default
   tracing; then in-band exchange, pacing and the stabilizers together), each with the same final
   checksum as plain torchrun, device-clock columns in the run's records, and ``hyperacc analyze``
   reading the run.

Without a CUDA device it says so and exits 0 (this is no test: CI has no GPU). Run it with the Python
that holds a CUDA build of torch: ``PYTHONPATH=src python3 bench/gpu_check.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

Result = tuple[bool, str]


def ddp_pair(buckets: int) -> tuple[nn.Module, nn.Module, float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(buckets)]).cuda()

    cap = 64 * 65 * 4 / 2**20  # one layer per bucket
    return DDP(build(), bucket_cap_mb=cap), DDP(build(), bucket_cap_mb=cap), cap


def check_device_columns(state: dict) -> Result:
    from hyperacc.trace import Tracer

    run_dir = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    tracer = Tracer(run_dir, rank=0, world_size=1, window=0, probe_every=0, alloc_every=5)
    state["tracer"], state["run_dir"] = tracer, run_dir
    traced, twin, _ = ddp_pair(64)
    tracer.attach_ddp(traced)
    opt = torch.optim.SGD(traced.parameters(), lr=0.01)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.01)
    state.update(traced=traced, twin=twin, opt=opt, twin_opt=twin_opt)
    exact = []
    for step in range(30):
        x = torch.randn(32, 64, device="cuda", generator=None)
        with tracer.step(step):
            opt.zero_grad(set_to_none=False)  # at the start, so the step's gradients stay to be compared
            loss = traced(x).square().mean()
            loss.backward()
            opt.step()
        twin_opt.zero_grad(set_to_none=False)
        twin(x).square().mean().backward()
        exact.append(all(torch.equal(a.grad, b.grad) for a, b in zip(traced.parameters(), twin.parameters(), strict=True)))
        twin_opt.step()
    tracer.flush()
    torch.cuda.synchronize()
    state["exact"] = all(exact)
    timer = tracer._dev
    return True, f"{len(list(traced.parameters()))} parameters, budget {timer.budget if timer else '-'} events/step"


def check_no_sync(state: dict) -> Result:
    tracer, traced, opt = state["tracer"], state["traced"], state["opt"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(30, 60):
            x = torch.randn(32, 64, device="cuda")
            with tracer.step(step):
                traced(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return True, "30 traced steps under sync debug mode 'error'"


def check_rows(state: dict) -> Result:
    from hyperacc import store

    tracer = state["tracer"]
    tracer.close()
    rows = store.read_steps(state["run_dir"]).to_pylist()
    dev = [r for r in rows if r["dev_step_ns"] is not None]
    comm = [r for r in rows if r["dev_comm_wait_ns"] is not None and r["dev_self_ns"] is not None]
    ok = len(rows) == 60 and len(dev) >= 55 and len(comm) >= 55 and state["exact"]
    med = statistics.median(r["dev_comm_wait_ns"] for r in comm) / 1e3 if comm else float("nan")
    return ok, (
        f"{len(rows)} rows, {len(dev)} with device step time, {len(comm)} with device wait/self "
        f"(median wait {med:.1f} us); gradients bit-identical to the untraced twin: {state['exact']}"
    )


def check_allocator(state: dict) -> Result:
    from hyperacc import store

    rows = store.read_steps(state["run_dir"]).to_pylist()
    read = [r for r in rows if r["device_allocs"] is not None]
    ok = 8 <= len(read) <= 16 and all(r["alloc_retries"] is not None for r in read)
    return ok, f"counters read on {len(read)} of {len(rows)} steps (every 5th), retries {sum(r['alloc_retries'] or 0 for r in read)}"


def check_prefetch(state: dict) -> Result:
    from hyperacc.data.prefetch import DevicePrefetcher

    data = torch.utils.data.TensorDataset(torch.arange(4096, dtype=torch.float32).reshape(256, 16))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    seen = [b[0] for b in DevicePrefetcher(loader, device="cuda")]
    ok = len(seen) == 32 and all(s.is_cuda for s in seen)
    ok = ok and all(torch.equal(s.cpu(), b[0]) for s, b in zip(seen, loader, strict=True))
    return ok, f"{len(seen)} batches on {seen[0].device if seen else '-'}, equal and in order"


def check_yuv(state: dict) -> Result:
    import cv2
    import numpy as np

    from hyperacc.data.yuv import yuv_to_rgb

    rng = np.random.default_rng(0)
    frame = rng.integers(0, 256, (1080 * 3 // 2, 1920), dtype=np.uint8)
    want = cv2.cvtColor(frame, cv2.COLOR_YUV2RGB_NV12)
    got = yuv_to_rgb(torch.from_numpy(frame).cuda(), "nv12").permute(1, 2, 0).cpu().numpy()
    diff = int(np.abs(got.astype(np.int16) - want.astype(np.int16)).max())
    return diff == 0, f"1080p NV12, max difference to OpenCV {diff}"


def check_pacing(state: dict) -> Result:
    import torch.distributed as dist

    from hyperacc.pacing.runtime import PacingHook

    hook = PacingHook(rank=0, world_size=1)
    t = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # 50 ms or more of queued work: a host that waited for it would show it
    h0 = time.perf_counter()
    with hook.delayed(1_000_000, t.device):  # first use: starts the clock calibration, must not wait for it
        work = dist.all_reduce(t, async_op=True)
    first_host_ms = (time.perf_counter() - h0) * 1e3
    work.wait()
    torch.cuda.synchronize()
    rate = hook._sleeper.rate(t.device.index)  # the calibration has finished: read it back
    device_ms, host_ms = [], []
    for delay in (0, 5_000_000, 0, 5_000_000):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        h0 = time.perf_counter()
        with hook.delayed(delay, t.device):
            work = dist.all_reduce(t, async_op=True)
        host_ms.append((time.perf_counter() - h0) * 1e3)
        work.wait()  # outside the block, as DDP waits on its hook's future: the current stream waits for it
        end.record()
        end.synchronize()
        device_ms.append(start.elapsed_time(end))
    extra = min(device_ms[1], device_ms[3]) - min(device_ms[0], device_ms[2])
    ok = 4.0 <= extra <= 6.5 and max(host_ms) < 1.0 and first_host_ms < 40.0
    return ok, (f"delay 5 ms: device +{extra:.2f} ms, host at most {max(host_ms):.2f} ms inside the context; "
                f"first use {first_host_ms:.2f} ms on the host with 50+ ms queued (no wait); "
                f"{rate:.3f} cycles/ns")  # fmt: skip


# The per-step cost, and what each part of the tracer adds to it on a GPU: every arm is the same
# 8-bucket DDP model (its own copy), timed in alternating blocks of 20 steps.
COST_ARMS: dict[str, dict | None] = {
    "untraced": None,
    "default": {},
    "no device events": {"device_timing": False},
    "no signals": {"signals": False},
    "no probe, no allocator counters": {"probe_every": 0, "alloc_every": 1_000_000},
    "no resource sampler": {"resources_every_s": 0},
}


def check_cost(state: dict) -> Result:
    from hyperacc.trace import Tracer

    arms = {}
    for name, options in COST_ARMS.items():
        tracer = None
        if options is not None:
            tracer = Tracer(Path(tempfile.mkdtemp(prefix="gpu-check-cost-")), rank=0, world_size=1, window=0, **options)
        model, _, _ = ddp_pair(8)
        if tracer is not None:
            tracer.attach_ddp(model)
        arms[name] = (tracer, model, torch.optim.SGD(model.parameters(), lr=0.01))
    times: dict[str, list[float]] = {name: [] for name in arms}
    x = torch.randn(256, 64, device="cuda")
    names = list(arms)
    for block in range(24):
        for name in names[block % len(names):] + names[: block % len(names)]:
            tracer, model, opt = arms[name]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                if tracer is not None:
                    tracer.begin_step()
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
                if tracer is not None:
                    tracer.end_step()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / 20 * 1e6)
    for tracer, _, _ in arms.values():
        if tracer is not None:
            tracer.close()
    base = statistics.median(times["untraced"][2:])  # the first blocks warm up
    parts = [f"{name} {statistics.median(t[2:]):.1f} us ({statistics.median(t[2:]) / base:.3f})" for name, t in times.items()]
    return True, "explicit API, 8 buckets, median step: " + "; ".join(parts)


def check_end_to_end(state: dict) -> Result:
    import json
    import subprocess

    from hyperacc import harness, store

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    script = ROOT / "examples" / "train_ddp.py"
    args = ["--steps", "300", "--device", "cuda", "--sampler", "ondemand", "--prefetch", "--workers", "2"]
    base = Path(tempfile.mkdtemp(prefix="gpu-check-e2e-"))
    plain = harness.launch(script, args, nproc=1, timeout=240)
    if not plain.ok:
        return False, f"plain torchrun failed: {plain.explain()[-400:]}"
    want = plain.results()[0]["checksum"]
    arms = {
        "default": {},
        "inband+pace+stabilize": {"trace": '{"inband": true}', "pace": "1", "stabilize": "1"},
    }
    parts = []
    ok = True
    for name, extra in arms.items():
        run_dir = base / name.replace("+", "-")
        job = harness.launch(script, args, nproc=1, timeout=240, traced={"run-dir": str(run_dir), **extra})
        if not job.ok:
            return False, f"{name}: hyperacc run failed: {job.explain()[-400:]}"
        same = job.results()[0]["checksum"] == want
        rows = store.read_steps(run_dir, ["step", "dev_step_ns", "dev_self_ns", "dev_comm_wait_ns"]).to_pylist()
        dev = sum(r["dev_step_ns"] is not None for r in rows)
        wait = sum(r["dev_comm_wait_ns"] is not None for r in rows)
        analyzed = subprocess.run([sys.executable, "-m", "hyperacc", "analyze", str(run_dir), "--json"],
                                  capture_output=True, text=True, timeout=120)  # fmt: skip
        verdict = json.loads(analyzed.stdout).get("verdict", "") if analyzed.returncode == 0 else analyzed.stderr[-200:]
        ok = ok and same and len(rows) == 300 and dev >= 290 and wait >= 290 and analyzed.returncode == 0
        parts.append(f"{name}: checksum equal {same}, {len(rows)} rows, device step/wait on {dev}/{wait}, "
                     f"analyze rc {analyzed.returncode} ({str(verdict)[:60]!r})")  # fmt: skip
    return ok, "; ".join(parts)


CHECKS: list[tuple[str, Callable[[dict], Result]]] = [
    ("device columns, 64 buckets", check_device_columns),
    ("no device sync per step", check_no_sync),
    ("rows and gradients", check_rows),
    ("allocator counters", check_allocator),
    ("pinned prefetcher", check_prefetch),
    ("YUV on the device", check_yuv),
    ("device-side pacing delay", check_pacing),
    ("per-step cost", check_cost),
    ("end to end, hyperacc run", check_end_to_end),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="accepted for make bench; the check is always short")
    p.parse_args()
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here: nothing to check (run it on a machine with a GPU)")
        return 0
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    print(f"gpu-check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}")
    state: dict = {}
    failed = 0
    t_all = time.monotonic()
    for name, fn in CHECKS:
        t0 = time.monotonic()
        try:
            ok, detail = fn(state)
        except Exception as exc:  # noqa: BLE001 - one failing check must not hide the others
            ok, detail = False, f"{type(exc).__name__}: {exc}"
            traceback.print_exc(limit=3)
        failed += not ok
        print(f"{'pass' if ok else 'FAIL':<5} {name:<28} {detail}  ({time.monotonic() - t0:.1f} s)", flush=True)
    print(f"{len(CHECKS) - failed} of {len(CHECKS)} checks passed in {time.monotonic() - t_all:.0f} s")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
