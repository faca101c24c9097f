"""Runs side by side: the same figures of each run, their differences from the first run (the
baseline), intervals where a figure is a rate, and limits for a CI gate.

Pure: figures in (``Figure`` per name and run, made by ``hyperacc.analysis.diagnose``'s document),
a comparison out. Limits are written ``name=+10%`` (may grow by at most 10 % of the baseline),
``name=-5%`` (may fall by at most 5 %), ``name=+2pp`` (a rate may rise by at most 2 percentage points) or
``name=+0.05`` (an absolute change). A rate's limit is broken only when the change is both above the
limit and significant (its 95 % interval excludes zero): a CI gate that fails on noise is switched off
by its users. docs/presentation.md, "Compare".
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

from hyperacc.analysis.spikes import wilson_interval

_LIMIT = re.compile(r"^\s*([a-z0-9_.]+)\s*=\s*([+-])\s*([0-9]*\.?[0-9]+)\s*(%|pp)?\s*$")


class CompareError(ValueError):
    """A limit that cannot be read or names no figure; the message says which and what is allowed."""


@dataclasses.dataclass(frozen=True)
class Figure:
    name: str
    value: float | None
    unit: str  # "ms", "%", "x", "/s", ""
    better: str  # "lower" | "higher": which direction is an improvement
    successes: int | None = None  # for a rate: events ...
    trials: int | None = None  # ... out of trials


@dataclasses.dataclass(frozen=True)
class Limit:
    name: str
    sign: int  # +1: may grow by at most, -1: may fall by at most
    amount: float
    kind: str  # "relative" | "points" | "absolute"

    def text(self) -> str:
        unit = {"relative": "%", "points": "pp", "absolute": ""}[self.kind]
        amount = self.amount * 100 if self.kind in ("relative", "points") else self.amount
        return f"{self.name}={'+' if self.sign > 0 else '-'}{amount:g}{unit}"


def parse_limits(text: str | None, known: Sequence[str]) -> list[Limit]:
    """``'p99=+10%,spike_rate=+2pp'`` -> limits; names must be figures of the comparison. None is no
    gate; an empty text or an empty limit between commas is refused (a gate that checks nothing would
    pass every run)."""
    if text is None:
        return []
    if not text.strip():
        raise CompareError("--fail-on is empty: give limits such as 'p99=+10%', or leave the option out")
    out = []
    for part in text.split(","):
        if not part.strip():
            raise CompareError(f"--fail-on {text!r} holds an empty limit: write NAME=+10% limits joined by "
                               "single commas")  # fmt: skip
        m = _LIMIT.match(part)
        if not m:
            raise CompareError(
                f"cannot read the limit {part.strip()!r}: write NAME=+10% (relative), NAME=+2pp (a rate, in "
                "percentage points) or NAME=+0.05 (absolute), joined by commas"
            )
        name, sign, amount, unit = m.groups()
        if name not in known:
            raise CompareError(f"--fail-on names {name!r}, which is no figure; figures: {', '.join(known)}")
        value = float(amount)
        kind = "relative" if unit == "%" else "points" if unit == "pp" else "absolute"
        out.append(Limit(name, 1 if sign == "+" else -1, value / 100 if kind != "absolute" else value, kind))
    return out


def uncomputable(runs: Sequence[Mapping[str, Figure]], limits: Sequence[Limit]) -> list[tuple[Limit, list[int]]]:
    """The limits whose figure is missing (None, not finite, absent) in some run, with those runs'
    indices (0 the baseline). Such a limit can be neither kept nor broken: a gate on it is an error,
    never a pass."""
    out = []
    for lim in limits:
        missing = []
        for i, run in enumerate(runs):
            fig = run.get(lim.name)
            if fig is None or fig.value is None or not math.isfinite(fig.value):
                missing.append(i)
        if missing:
            out.append((lim, missing))
    return out


@dataclasses.dataclass(frozen=True)
class Change:
    name: str
    run: int  # index of the run compared with the baseline (run 0)
    base: float | None
    value: float | None
    delta: float | None  # value - base
    relative: float | None  # delta / base
    low: float | None  # 95 % interval of the delta (rates only)
    high: float | None
    worse: bool | None  # the change goes the wrong way (None: unknown or unchanged)
    broken: list[str]  # the limits this change breaks


def compare(runs: Sequence[Mapping[str, Figure]], limits: Sequence[Limit] = ()) -> list[Change]:
    """Every figure of every run after the first, against the first."""
    if len(runs) < 2:
        raise CompareError("compare needs at least two runs: the baseline first, then the others")
    base = runs[0]
    out = []
    for i, run in enumerate(runs[1:], start=1):
        for name, fb in base.items():
            fr = run.get(name)
            if fr is None:
                continue
            out.append(_change(fb, fr, i, [lim for lim in limits if lim.name == name]))
    return out


def _change(fb: Figure, fr: Figure, run: int, limits: Sequence[Limit]) -> Change:
    a, b = fb.value, fr.value
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return Change(fb.name, run, a, b, None, None, None, None, None, [])
    delta = b - a
    rel = delta / a if a else None
    low = high = None
    if fb.trials and fr.trials and fb.successes is not None and fr.successes is not None:
        low, high = _newcombe(fb.successes, fb.trials, fr.successes, fr.trials)
    worse = None if delta == 0 else (delta > 0) == (fb.better == "lower")
    broken = [lim.text() for lim in limits if _breaks(lim, a, delta, low, high)]
    return Change(fb.name, run, a, b, delta, rel, low, high, worse, broken)


def _breaks(lim: Limit, base: float, delta: float, low: float | None, high: float | None) -> bool:
    if lim.kind == "relative":
        change = delta / base if base else (math.inf if delta else 0.0)
    else:
        change = delta
    beyond = change > lim.amount if lim.sign > 0 else change < -lim.amount
    if not beyond:
        return False
    if low is not None and high is not None:  # a rate: only a significant change breaks its limit
        return low > 0 if lim.sign > 0 else high < 0
    return True


def _newcombe(k1: int, n1: int, k2: int, n2: int) -> tuple[float, float]:
    """95 % interval of p2 - p1 (Newcombe's hybrid score method, from two Wilson intervals)."""
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = (float(v) for v in wilson_interval(k1, n1))
    l2, u2 = (float(v) for v in wilson_interval(k2, n2))
    d = p2 - p1
    low = d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2)
    high = d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)
    return low, high


# Figures of a diagnosis document (``Diagnosis.to_dict()``), in the order they are shown; the names are
# what ``--fail-on`` takes. (name, where, unit, better, scale)
_FIGURES: tuple[tuple[str, tuple[str, ...], str, str, float], ...] = (
    ("p50", ("coordination", "distribution", "p50_ns"), "ms", "lower", 1e-6),
    ("p90", ("coordination", "distribution", "p90_ns"), "ms", "lower", 1e-6),
    ("p99", ("coordination", "distribution", "p99_ns"), "ms", "lower", 1e-6),
    ("p999", ("coordination", "distribution", "p999_ns"), "ms", "lower", 1e-6),
    ("cv", ("coordination", "distribution", "cv"), "", "lower", 1.0),
    ("jitter", ("coordination", "distribution", "jitter"), "", "lower", 1.0),
    ("steps_per_s", ("coordination", "distribution", "steps_per_s"), "/s", "higher", 1.0),
    ("samples_per_s", ("coordination", "distribution", "samples_per_s"), "/s", "higher", 1.0),
    ("wait_share", ("coordination", "cost", "wait_share"), "%", "lower", 1.0),
    ("late_share", ("coordination", "cost", "late_share"), "%", "lower", 1.0),
    ("collective_share", ("coordination", "cost", "collective_share"), "%", "lower", 1.0),
    ("spread_p50", ("coordination", "cost", "spread_p50_ns"), "ms", "lower", 1e-6),
    ("spread_p99", ("coordination", "cost", "spread_p99_ns"), "ms", "lower", 1e-6),
)
FIGURE_NAMES: tuple[str, ...] = (*(f[0] for f in _FIGURES), "spike_rate", "stragglers", "creep_ranks",
                                 "slowdown_share")  # fmt: skip


def figures_of(doc: Mapping) -> dict[str, Figure]:
    """The figures ``compare`` sets side by side, from a diagnosis document; a figure the run did not
    measure is None (never zero)."""
    out: dict[str, Figure] = {}
    for name, path, unit, better, scale in _FIGURES:
        v: object = doc
        for key in path:
            v = v.get(key) if isinstance(v, Mapping) else None
        out[name] = Figure(name, float(v) * scale if isinstance(v, (int, float)) else None, unit, better)
    cl = (doc.get("spikes") or {}).get("cluster") or {}
    steps, spikes = int(cl.get("steps") or 0), int(cl.get("spike_steps") or 0)
    out["spike_rate"] = Figure("spike_rate", spikes / steps if steps else None, "%", "lower",
                               spikes if steps else None, steps or None)  # fmt: skip
    out["stragglers"] = Figure("stragglers", float(len(doc.get("stragglers") or [])), "", "lower")
    # the job's time lost to slowdowns of the whole job, over the job's time (steps x mean step)
    dist = (doc.get("coordination") or {}).get("distribution") or {}
    job_ns = float(dist.get("steps") or 0) * float(dist.get("mean_ns") or 0.0)
    lost = sum(float(s.get("job_time_lost_ns") or 0.0) for s in doc.get("slowdowns") or [])
    out["slowdown_share"] = Figure("slowdown_share", lost / job_ns if job_ns > 0 else None, "%", "lower")
    res = doc.get("resources") or {}
    out["creep_ranks"] = Figure("creep_ranks", float(len({c["rank"] for c in res.get("creep") or []}))
                                if res.get("samples") else None, "", "lower")  # fmt: skip
    return out


@dataclasses.dataclass(frozen=True)
class ScalePoint:
    world_size: int
    steps_per_s: float | None
    efficiency: float | None  # against linear scaling of the smallest run (per-rank batch held)
    cv: float | None


def scaling(runs: Sequence[tuple[int, Mapping[str, Figure]]]) -> list[ScalePoint]:
    """Efficiency against linear scaling over runs of one job at several world sizes.

    With the per-rank batch held (data parallel, weak scaling) samples/s is ranks x batch x steps/s, so
    efficiency at N ranks = (N x steps/s(N)) / (N0 x steps/s(N0)) / (N / N0) = steps/s(N) / steps/s(N0),
    N0 the smallest world size. docs/presentation.md, "Compare".
    """
    ordered = sorted(runs, key=lambda r: r[0])
    base = ordered[0][1]["steps_per_s"].value if ordered else None
    out = []
    for n, figs in ordered:
        rate = figs["steps_per_s"].value
        eff = rate / base if rate is not None and base else None
        out.append(ScalePoint(n, rate, eff, figs["cv"].value))
    return out
