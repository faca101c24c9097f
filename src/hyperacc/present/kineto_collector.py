"""The Kineto event collector: each event of a trace inspected once and dropped, the few fields the
import needs kept in compact typed arrays (steps, annotations, runtime calls, collective kernels)."""

from __future__ import annotations

import array
import re
from typing import Any

_RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver", "runtime", "driver", "Runtime", "Driver"})


# Annotation name -> phase, first match wins (case-insensitive). Time covered by no matching
# annotation is ``other``; nested annotations count for the innermost one.
PHASE_PATTERNS: tuple[tuple[str, str], ...] = (
    ("data", r"dataloader|data[ _]?load|\bdata\b|next_batch|get_batch"),
    ("h2d", r"\bh2d\b|htod|to_device|copy_to_device|host_to_device"),
    ("backward", r"backward"),
    ("forward", r"forward"),
    ("optimizer", r"optimizer|optim\b|zero_grad|\.step#|\bopt_step\b"),
)


_PHASE_RES = tuple(re.compile(p, re.IGNORECASE) for _, p in PHASE_PATTERNS)

_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")

_COLLECTIVE_PREFIXES = ("nccl", "rccl")

_HOST_COLLECTIVE_PREFIXES = ("gloo:",)

_FIELDS = frozenset({"distributedInfo", "host_name", "hostname", "baseTimeNanoseconds"})  # top-level keys kept


class _Collector:
    """Keeps the few fields the import needs from each event, in typed arrays."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.n = 0
        self.step_num = array.array("q")
        self.step_ts = array.array("d")
        self.step_dur = array.array("d")
        self.step_tid = array.array("q")
        self.pid = -1
        self.ann_ts = array.array("d")
        self.ann_dur = array.array("d")
        self.ann_tid = array.array("q")
        self.ann_phase = array.array("b")
        self.rt_name = array.array("i")
        self.rt_ts = array.array("d")
        self.rt_dur = array.array("d")
        self.rt_corr = array.array("q")
        self.k_ts = array.array("d")
        self.k_dur = array.array("d")
        self.k_corr = array.array("q")
        self.k_label = array.array("i")
        self.k_elems = array.array("d")
        self.mem_ts = array.array("d")
        self.mem_total = array.array("d")
        self.mem_dev = array.array("i")
        self.h_ts = array.array("d")  # host-side collectives (gloo:*): start, duration, label
        self.h_dur = array.array("d")
        self.h_label = array.array("i")
        self.gpu_seen = False
        self.names: dict[str, int] = {}  # runtime API name -> id
        self.labels: dict[str, int] = {}  # collective label -> id
        self._phase_of: dict[str, int] = {}
        self._tids: dict[Any, int] = {}

    def field(self, key: str, value: Any) -> None:
        if key in _FIELDS:
            self.fields[key] = value

    def _tid(self, tid: Any) -> int:
        if isinstance(tid, int):
            return tid
        got = self._tids.get(tid)
        if got is None:
            got = self._tids[tid] = -(len(self._tids) + 1)
        return got

    def _phase(self, name: str) -> int:
        got = self._phase_of.get(name)
        if got is None:
            got = -1
            for i, rx in enumerate(_PHASE_RES):
                if rx.search(name):
                    got = i
                    break
            if len(self._phase_of) < 100_000:
                self._phase_of[name] = got
        return got

    def event(self, ev: Any) -> None:
        self.n += 1
        if not isinstance(ev, dict):
            return
        ph = ev.get("ph")
        if ph == "X":
            cat = ev.get("cat")
            name = ev.get("name")
            if isinstance(name, str) and name.startswith(_HOST_COLLECTIVE_PREFIXES) and cat != "kernel":
                # gloo runs a collective on its own thread: the annotation spans launch to completion,
                # the wait for the slowest peer included (as an NCCL kernel's duration does)
                try:
                    self.h_ts.append(float(ev["ts"]))
                    self.h_dur.append(float(ev.get("dur", 0.0)))
                except (KeyError, TypeError, ValueError):
                    return
                label = name.split(":", 1)[1]
                lid = self.labels.get(label)
                if lid is None:
                    lid = self.labels[label] = len(self.labels)
                self.h_label.append(lid)
                return
            if cat == "cpu_op" or cat == "python_function":
                # older profilers filed ProfilerStep#N under cpu_op; everything else here is skipped
                name = ev.get("name")
                if not (isinstance(name, str) and name.startswith("ProfilerStep#")):
                    return
            try:
                ts = float(ev["ts"])
                dur = float(ev.get("dur", 0.0))
            except (KeyError, TypeError, ValueError):
                return
            name = ev.get("name", "")
            if cat in _RUNTIME_CATS:
                rid = self.names.get(name)
                if rid is None:
                    rid = self.names[name] = len(self.names)
                self.rt_name.append(rid)
                self.rt_ts.append(ts)
                self.rt_dur.append(dur)
                args = ev.get("args") or {}
                corr = args.get("correlation", -1)
                self.rt_corr.append(corr if isinstance(corr, int) else -1)
                return
            if cat == "kernel" or cat == "Kernel":
                self.gpu_seen = True
                if isinstance(name, str) and name[:4].lower() in _COLLECTIVE_PREFIXES:
                    args = ev.get("args") or {}
                    label = args.get("Collective name") or _collective_label(name)
                    lid = self.labels.get(label)
                    if lid is None:
                        lid = self.labels[label] = len(self.labels)
                    corr = args.get("correlation", -1)
                    elems = args.get("In msg nelems", float("nan"))
                    self.k_ts.append(ts)
                    self.k_dur.append(dur)
                    self.k_corr.append(corr if isinstance(corr, int) else -1)
                    self.k_label.append(lid)
                    self.k_elems.append(float(elems) if isinstance(elems, (int, float)) else float("nan"))
                return
            if cat == "gpu_user_annotation" or cat == "gpu_memcpy" or cat == "gpu_memset":
                self.gpu_seen = True
                return
            if not isinstance(name, str):
                return
            m = _STEP_RE.match(name)
            tid = self._tid(ev.get("tid", 0))
            if m:
                self.step_num.append(int(m.group(1)))
                self.step_ts.append(ts)
                self.step_dur.append(dur)
                self.step_tid.append(tid)
                if self.pid < 0 and isinstance(ev.get("pid"), int):
                    self.pid = ev["pid"]
                return
            if cat == "user_annotation":
                phase = self._phase(name)
                if phase >= 0:
                    self.ann_ts.append(ts)
                    self.ann_dur.append(dur)
                    self.ann_tid.append(tid)
                    self.ann_phase.append(phase)
        elif ph == "i" or ph == "I":
            if ev.get("name") != "[memory]":
                return
            args = ev.get("args") or {}
            if args.get("Device Type") != 1:  # CUDA device memory only
                return
            try:
                self.mem_ts.append(float(ev["ts"]))
                self.mem_total.append(float(args.get("Total Allocated", 0)))
                self.mem_dev.append(int(args.get("Device Id", 0)))
            except (KeyError, TypeError, ValueError):
                return


def _collective_label(kernel: str) -> str:
    # ncclKernel_AllReduce_RING_LL_Sum_float(...) / ncclDevKernel_AllGather_RING_LL(...) -> AllReduce
    base = kernel.split("(", 1)[0]
    parts = base.split("_")
    return parts[1] if len(parts) > 1 else base
