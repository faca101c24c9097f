"""Device prefetch: order, structure, exhaustion, producer errors, early exit, bounded depth."""

from __future__ import annotations

import gc
import threading
import time
import traceback
from collections import namedtuple

import pytest
import torch

from hyperacc.data.prefetch import DevicePrefetcher

Pair = namedtuple("Pair", ["x", "label"])


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hyperacc-prefetch"]


def _wait_no_threads(timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _prefetch_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    assert not _prefetch_threads(), "a prefetch thread was left behind"


def _batches(n: int, fail_at: int | None = None, produced: list[int] | None = None):
    for i in range(n):
        if i == fail_at:
            raise ValueError(f"source failed at batch {i}")
        if produced is not None:
            produced.append(i)
        # changing shapes, nested structures, non-tensor leaves
        yield {
            "x": torch.full((i % 4 + 1, 3), float(i)),
            "pair": Pair(torch.arange(i + 1), i),
            "tag": f"b{i}",
        }


def test_order_structure_and_changing_shapes_are_kept():
    out = list(DevicePrefetcher(_batches(20), "cpu"))
    assert [b["tag"] for b in out] == [f"b{i}" for i in range(20)]
    for i, b in enumerate(out):
        assert b["x"].shape == (i % 4 + 1, 3) and torch.all(b["x"] == i)
        assert isinstance(b["pair"], Pair) and b["pair"].label == i
        assert torch.equal(b["pair"].x, torch.arange(i + 1))
    _wait_no_threads()


def test_exhaustion_is_final_and_the_wrapper_can_be_iterated_again():
    pf = DevicePrefetcher([torch.tensor(1), torch.tensor(2)], "cpu")
    it = iter(pf)
    assert [int(x) for x in it] == [1, 2]
    with pytest.raises(StopIteration):
        next(it)
    assert [int(x) for x in pf] == [1, 2]
    assert len(pf) == 2
    _wait_no_threads()


def test_producer_exception_reraised_with_original_traceback():
    pf = DevicePrefetcher(_batches(10, fail_at=4), "cpu")
    got = []
    with pytest.raises(ValueError, match="failed at batch 4") as info:
        for b in pf:
            got.append(b["tag"])
    assert got == ["b0", "b1", "b2", "b3"]
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "_batches" in frames  # the frame that raised, in the producer thread
    _wait_no_threads()


def test_early_break_leaves_no_thread_behind():
    for _ in range(3):
        for b in DevicePrefetcher(_batches(1000), "cpu"):
            if b["pair"].label == 2:
                break
    _wait_no_threads()


def test_close_while_producer_is_blocked_on_a_full_queue():
    produced: list[int] = []
    it = iter(DevicePrefetcher(_batches(1000, produced=produced), "cpu", slots=2))
    next(it)
    time.sleep(0.3)
    it.close()
    assert not any(t.is_alive() for t in _prefetch_threads())
    assert len(produced) < 10
    with pytest.raises(StopIteration):
        next(it)


def test_depth_is_bounded_by_slots():
    produced: list[int] = []
    slots = 3
    it = iter(DevicePrefetcher(_batches(100, produced=produced), "cpu", slots=slots))
    next(it)
    time.sleep(0.5)  # give the producer every chance to run ahead
    # one consumed, `slots` waiting in the queue, at most one more in the producer's hand
    assert len(produced) <= 1 + slots + 1
    it.close()
    _wait_no_threads()


def test_transform_runs_in_the_producer():
    seen = []

    def transform(batch):
        seen.append(threading.current_thread().name)
        return batch * 2

    out = [int(x) for x in DevicePrefetcher([torch.tensor(i) for i in range(5)], "cpu", transform=transform)]
    assert out == [0, 2, 4, 6, 8]
    assert set(seen) == {"hyperacc-prefetch"}
    _wait_no_threads()


def test_wraps_a_multiworker_dataloader():
    ds = torch.utils.data.TensorDataset(torch.arange(64).float().view(64, 1), torch.arange(64))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2)
    labels = torch.cat([y for _, y in DevicePrefetcher(loader, "cpu")])
    assert torch.equal(labels, torch.arange(64))
    _wait_no_threads()


def test_bad_arguments():
    with pytest.raises(ValueError, match="slots"):
        DevicePrefetcher([], "cpu", slots=0)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            DevicePrefetcher([], "cuda")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_batches_arrive_on_device_in_order_through_reused_pinned_slots():
    pf = DevicePrefetcher(_batches(30), "cuda", slots=3)
    it = iter(pf)
    out = []
    for b in it:
        assert b["x"].is_cuda and b["pair"].x.is_cuda
        out.append((b["x"].sum().item(), b["pair"].label))
    assert out == [(float(i * (i % 4 + 1) * 3), i) for i in range(30)]
    slots = list(it._pipe.free.queue)
    # Pinned memory is allocated once per slot for batches of this size, never per batch.
    assert sum(s.grows for s in slots) <= 3


@cuda
def test_cuda_consumer_on_a_side_stream_reads_correct_data():
    src = [torch.full((256, 256), float(i)) for i in range(20)]
    stream = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(stream):
        for x in DevicePrefetcher(src, "cuda"):
            sums.append((x * 1.0).sum())
    torch.cuda.synchronize()
    assert [float(s) for s in sums] == [float(i * 256 * 256) for i in range(20)]


@cuda
def test_cuda_transform_runs_after_the_copy():
    from hyperacc.data.yuv import YUVToRGB, yuv_to_rgb

    frames = [torch.randint(0, 256, (2, 12, 8), dtype=torch.uint8) for _ in range(4)]
    out = [x.cpu() for x in DevicePrefetcher(frames, "cuda", transform=YUVToRGB(field=None))]
    for f, o in zip(frames, out, strict=True):
        assert torch.equal(o, yuv_to_rgb(f))


def test_consumer_wait_is_the_traced_steps_data_phase(tmp_path):
    """Under a running tracer, each step's data phase is the wait the consumer saw in __next__."""
    from hyperacc.store import read_steps
    from hyperacc.trace import Tracer

    def slow(n: int):
        for i in range(n):
            time.sleep(0.01 if i % 3 == 0 else 0.0)  # every third batch comes late
            yield torch.full((2,), float(i))

    tracer = Tracer(tmp_path)
    try:
        it = iter(DevicePrefetcher(slow(12), "cpu", slots=1))
        got = []
        for _ in range(12):
            with tracer.step():
                got.append(float(next(it)[0]))
        # The wait for the end marker below happens outside any step: not part of the comparison.
        waited, waits = it.wait_ns, it.waits
        with pytest.raises(StopIteration):
            next(it)
    finally:
        tracer.close()
    assert got == [float(i) for i in range(12)]
    data = read_steps(tmp_path, columns=["step", "data_ns"]).column("data_ns").to_pylist()
    assert len(data) == 12 and None not in data  # measured on every step, 0 when the batch was ready
    assert sum(data) == waited > 0
    assert sum(1 for d in data if d > 0) == waits
