"""The pacing controller: per-rank arrivals and waits in, per-rank delays out. No clocks, no I/O.

Every rule, formula and default used here is documented once, in ``docs/pacing.md``; the section
names below refer to that page.

The same class runs inside every training rank (fed by the in-band exchange, so every rank holds the
same observations and computes the same delay vector) and inside the simulator (fed thousands of
ranks per step). It is vectorised over ranks and works in preallocated buffers: ``observe`` and
``plan`` allocate nothing per step once the rank count is known.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from hyperacc.options import OptionsError, check, check_fields
from hyperacc.stats import median_inplace

_SQRT_HALF_PI = math.sqrt(math.pi / 2)  # standard deviation / mean absolute deviation of a normal


@functools.lru_cache(maxsize=64)
def noise_range_factor(ranks: int) -> float:
    """E[max - min] of ``ranks`` independent standard normals: 2 E[max] (``hyperacc.theory``)."""
    if ranks < 2:
        return 0.0
    from hyperacc.theory import expected_max_normal  # scipy: imported once, when the rank count is known

    return 2.0 * expected_max_normal(ranks)


PacingConfigError = OptionsError  # the name before the one options error; public, kept as an alias


@dataclasses.dataclass(frozen=True)
class PacingConfig:
    """Rules and defaults: docs/pacing.md, "Rules"."""

    alpha: float = 0.1  # EWMA weight of one step (smoothing over ~1/alpha steps)
    clip: float = 3.0  # a sample moves an estimate by at most clip x its smoothed deviation ...
    clip_floor: float = 0.02  # ... or clip x this fraction of the smoothed step, whichever is larger
    warmup_steps: int = 5  # observations ignored at the start (DDP rebuilds buckets at step 1)
    on_spread_ns: int = 1_000_000  # switch on above this predictable spread (beyond noise) ...
    on_spread_frac: float = 0.05  # ... and above this fraction of the smoothed step
    on_steps: int = 5  # k: for this many consecutive steps
    off_spread_ns: int = 500_000  # switch off below max(off_spread_ns, off_spread_frac x step) ...
    off_spread_frac: float = 0.025
    off_steps: int = 20  # m: for this many consecutive steps
    gain: float = 0.8  # fraction of a rank's predicted lead that it is delayed by
    margin: float = 1.0  # lead is first reduced by margin x the rank's own arrival deviation
    max_delay_ns: int = 20_000_000  # cap of one delay
    max_delay_frac: float = 0.1  # and never more than this fraction of the smoothed step
    signal: str = "arrival"  # "arrival" (self-time) or "wait" (time inside the collective)
    arrivals_include_delay: bool = True  # the measured arrival/wait contain the delay this controller set

    def __post_init__(self) -> None:
        check_fields(self, "pacing")
        for name, ok, allowed in (
            ("alpha", 0.0 < self.alpha <= 1.0, "in (0, 1]"),
            ("clip", self.clip > 0, "> 0"),
            ("clip_floor", self.clip_floor >= 0, ">= 0"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("on_spread_ns", self.on_spread_ns >= 0, ">= 0"),
            ("on_spread_frac", self.on_spread_frac >= 0, ">= 0"),
            ("on_steps", self.on_steps >= 1, ">= 1"),
            ("off_spread_ns", 0 <= self.off_spread_ns <= self.on_spread_ns, "in [0, on_spread_ns]"),
            ("off_spread_frac", 0 <= self.off_spread_frac <= self.on_spread_frac, "in [0, on_spread_frac]"),
            ("off_steps", self.off_steps >= 1, ">= 1"),
            ("gain", 0.0 <= self.gain <= 1.0, "in [0, 1]"),
            ("margin", self.margin >= 0, ">= 0"),
            ("max_delay_ns", self.max_delay_ns >= 0, ">= 0"),
            ("max_delay_frac", 0.0 <= self.max_delay_frac < 1.0, "in [0, 1)"),
            ("signal", self.signal in ("arrival", "wait"), "'arrival' or 'wait'"),
        ):
            check("pacing", name, getattr(self, name), ok, allowed)


@dataclasses.dataclass(frozen=True)
class PacingState:
    """What the controller is doing, for the tracer and reports (columns pace_on, spread_ns, ...)."""

    on: bool
    spread_ns: float  # smoothed arrival spread, late minus early, without the delays it applied
    step_ns: float  # smoothed step time
    on_threshold_ns: float
    off_threshold_ns: float
    max_delay_ns: int  # largest delay of the current plan
    steps_observed: int
    switches: int  # number of on/off transitions so far
    predictable_ns: float = 0.0  # spread of the ranks' predicted arrivals beyond what noise alone gives
    noise_ns: float = 0.0  # that noise-alone spread at this rank count (order statistics)


class PacingController:
    """Pure pacing policy over ``ranks`` ranks (docs/pacing.md).

    ``observe(step, arrivals_ns, waits_ns)`` feeds one step's per-rank arrival (self-time since the
    previous collective exit) and wait inside the collective; a negative or NaN value means "not
    measured" and never counts as an early or late rank. ``plan(step)`` returns the delay vector for
    ``step`` and remembers it, so that the delays it caused can be taken out of later observations;
    ``delay_ns(rank)`` is one rank's entry of the latest plan.
    """

    _PLAN_MEMORY = 16
    _STEP_SAMPLE = 64  # ranks sampled for the step-time median  # plans remembered for subtracting applied delays from late observations

    def __init__(self, config: PacingConfig | None = None, ranks: int | None = None) -> None:
        self.config = config or PacingConfig()
        self.ranks = 0
        self._on = False
        self._above = 0
        self._below = 0
        self._switches = 0
        self._observed = 0
        self._seen = 0  # observations counted, including warm-up
        self._spread = math.nan
        self._spread_dev = 0.0
        self._predictable = 0.0
        self._noise = 0.0
        self._noise_factor = 0.0
        self._step = math.nan
        self._step_dev = 0.0
        self._plans: dict[int, np.ndarray] = {}
        if ranks is not None:
            self._allocate(ranks)

    # ------------------------------------------------------------------ buffers

    def _allocate(self, ranks: int) -> None:
        if ranks < 1:
            raise OptionsError(f"pacing needs at least one rank (got {ranks})")
        self.ranks = ranks
        f = np.float64
        self._mean = np.zeros(ranks, f)  # robust EWMA of each rank's natural arrival
        self._dev = np.zeros(ranks, f)  # its smoothed absolute deviation
        self._count = np.zeros(ranks, f)  # samples seen per rank
        self._delay = np.zeros(ranks, np.int64)  # the current plan
        self._x = np.empty(ranks, f)
        self._r = np.empty(ranks, f)
        self._lim = np.empty(ranks, f)
        self._w = np.empty(ranks, f)
        self._valid = np.empty(ranks, bool)
        self._vf = np.empty(ranks, f)
        self._lead = np.empty(ranks, f)
        self._spare = [np.zeros(ranks, np.int64) for _ in range(self._PLAN_MEMORY)]
        self._scratch = np.empty(ranks, f)
        self._noise_factor = noise_range_factor(ranks)
        self._plans.clear()
        self._all_started = False
        self._any_invalid = False

    # ------------------------------------------------------------------ observations

    def observe(self, step: int, arrivals_ns: np.ndarray, waits_ns: np.ndarray | None = None) -> None:
        """Feed one step's observations of every rank (docs/pacing.md, "Estimates" and "Switching")."""
        a = np.asarray(arrivals_ns, dtype=np.float64)
        if a.ndim != 1:
            raise ValueError(f"arrivals_ns must be one value per rank (got shape {a.shape})")
        if self.ranks == 0:
            self._allocate(a.shape[0])
        if a.shape[0] != self.ranks:
            raise ValueError(f"arrivals_ns has {a.shape[0]} ranks, the controller was built for {self.ranks}")
        w = None if waits_ns is None else np.asarray(waits_ns, dtype=np.float64)
        if w is not None and w.shape != a.shape:
            raise ValueError(f"waits_ns has shape {w.shape}, arrivals_ns {a.shape}: one value per rank each")
        cfg = self.config
        self._seen += 1
        if self._seen <= cfg.warmup_steps:
            return

        # The signal, without the delays this controller applied ("natural" arrival).
        x, valid = self._x, self._valid
        if cfg.signal == "arrival":
            np.copyto(x, a)
        else:
            if w is None:
                return
            np.negative(w, out=x)  # a long wait is an early arrival
        np.greater_equal(x if cfg.signal == "arrival" else w, 0.0, out=valid)  # NaN compares False
        applied = self._plans.get(step) if cfg.arrivals_include_delay else None
        if applied is not None:
            # arrival - delay, or -(wait + delay): what the rank would have shown without its delay
            np.subtract(x, applied, out=x)
        n_valid = int(np.count_nonzero(valid))
        if n_valid < 2:
            return
        self._any_invalid = n_valid < self.ranks
        self._observed += 1

        # Step time: arrival since the previous exit plus wait inside = exit to exit (the arrival alone
        # when waits are not measured). Every rank sees nearly the same exit-to-exit time, so the
        # median over a strided sample of measured ranks is enough.
        step_buf = self._w
        if w is None:
            np.copyto(step_buf, a)
        else:
            np.add(a, w, out=step_buf)
        stride = max(1, self.ranks // self._STEP_SAMPLE)
        sample = step_buf[::stride]
        if not (sample >= 0).all():
            sample = step_buf[step_buf >= 0]
        if sample.size:
            self._step, self._step_dev = _robust_scalar(
                self._step, self._step_dev, median_inplace(sample), self._observed, cfg, self._step
            )

        # Spread of this step over measured ranks, smoothed robustly.
        if n_valid == self.ranks:
            hi, lo = float(x.max()), float(x.min())
        else:
            xs = x[valid]
            hi, lo = float(xs.max()), float(xs.min())
        self._spread, self._spread_dev = _robust_scalar(
            self._spread, self._spread_dev, hi - lo, self._observed, cfg, self._step
        )

        # Each rank's typical arrival: running mean for the first 1/alpha samples, then a clipped EWMA.
        self._robust_vector(x, valid)
        self._predictable_spread()

        # Switching with hysteresis, on the predictable part of the spread only.
        on_thr, off_thr = self._thresholds()
        if self._predictable > on_thr:
            self._above += 1
            self._below = 0
        elif self._predictable < off_thr:
            self._below += 1
            self._above = 0
        else:
            self._above = self._below = 0
        if not self._on and self._above >= cfg.on_steps:
            self._on, self._switches = True, self._switches + 1
        elif self._on and self._below >= cfg.off_steps:
            self._on, self._switches = False, self._switches + 1
        self._update_delays()

    def _robust_vector(self, x: np.ndarray, valid: np.ndarray) -> None:
        cfg = self.config
        vf, r, lim, cnt = self._vf, self._r, self._lim, self._count
        np.copyto(vf, valid)
        cnt += vf
        # per-rank weight: 1/n while n < 1/alpha (an unbiased start), alpha afterwards
        np.maximum(cnt, 1.0, out=lim)
        np.reciprocal(lim, out=lim)
        np.maximum(lim, cfg.alpha, out=lim)
        weight = self._lead  # scratch
        np.multiply(lim, vf, out=weight)
        if not self._all_started:
            # a rank's first sample is its estimate, with no deviation yet
            first = (cnt == 1.0) & valid
            self._mean[first] = x[first]
        np.subtract(x, self._mean, out=r)
        if self._any_invalid:
            np.nan_to_num(r, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
        # clip only once a rank has its start-up samples: limit = clip x max(deviation, floor x step)
        floor = cfg.clip_floor * self._step if math.isfinite(self._step) else 0.0
        np.maximum(self._dev, floor, out=lim)
        lim *= cfg.clip
        if not self._all_started:
            lim[cnt <= 1.0 / cfg.alpha] = np.inf
            self._all_started = bool(cnt.min() > 1.0 / cfg.alpha)
        np.minimum(r, lim, out=r)
        np.negative(lim, out=lim)
        np.maximum(r, lim, out=r)
        np.multiply(r, weight, out=lim)
        self._mean += lim
        np.abs(r, out=r)
        r -= self._dev
        r *= weight
        self._dev += r

    def _predictable_spread(self) -> None:
        """docs/pacing.md, "Switching": the range of the ranks' predicted arrivals less the range that
        N equal ranks would show from the noise of their estimates alone."""
        cfg = self.config
        if self._all_started or not self._any_invalid and bool((self._count > 0).all()):
            means, devs, counts = self._mean, self._dev, self._count
            factor = self._noise_factor
        else:
            known = self._count > 0
            means, devs, counts = self._mean[known], self._dev[known], self._count[known]
            factor = noise_range_factor(int(means.shape[0]))
        if means.shape[0] < 2:
            self._predictable = self._noise = 0.0
            return
        scratch = self._scratch[: devs.shape[0]]
        np.copyto(scratch, devs)
        sigma = median_inplace(scratch) * _SQRT_HALF_PI  # one arrival's noise, from the deviations
        weight = max(1.0 / float(counts.min()), cfg.alpha)  # a running mean, then the EWMA's weight
        noise = factor * sigma * math.sqrt(weight / (2.0 - weight))  # E[range] of N estimates of one value
        self._noise = noise
        self._predictable = max(0.0, float(means.max()) - float(means.min()) - noise)

    def _thresholds(self) -> tuple[float, float]:
        cfg = self.config
        step = self._step if math.isfinite(self._step) else 0.0
        return (
            max(float(cfg.on_spread_ns), cfg.on_spread_frac * step),
            max(float(cfg.off_spread_ns), cfg.off_spread_frac * step),
        )

    def _update_delays(self) -> None:
        """docs/pacing.md, "Delay": d = min(gain x (lead - margin x dev)+, cap, frac x step)."""
        cfg = self.config
        if not self._on or not math.isfinite(self._step):
            self._delay.fill(0)
            return
        lead = self._lead
        known = self._valid
        np.greater(self._count, 0.0, out=known)
        all_known = self._all_started or bool(known.all())
        latest = float(self._mean.max()) if all_known else float(self._mean[known].max())
        np.subtract(latest, self._mean, out=lead)
        np.multiply(self._dev, cfg.margin, out=self._r)
        lead -= self._r
        lead *= cfg.gain
        bound = min(float(cfg.max_delay_ns), cfg.max_delay_frac * self._step)
        np.clip(lead, 0.0, max(bound, 0.0), out=lead)
        if not all_known:
            lead[~known] = 0.0
        np.copyto(self._delay, lead, casting="unsafe")

    # ------------------------------------------------------------------ outputs

    def plan(self, step: int) -> np.ndarray:
        """The delay of every rank for ``step`` (ns, int64, read-only view); remembered for ``observe``."""
        if self.ranks == 0:
            return np.zeros(0, np.int64)
        buf = self._spare[step % self._PLAN_MEMORY]
        np.copyto(buf, self._delay)
        stale = step - self._PLAN_MEMORY
        self._plans.pop(stale, None)
        self._plans[step] = buf
        view = buf.view()
        view.flags.writeable = False
        return view

    def delay_ns(self, rank: int) -> int:
        """This rank's delay for the next step, from the latest observations (0 when off)."""
        if not 0 <= rank < max(self.ranks, 1):
            raise ValueError(f"rank {rank} is outside 0..{self.ranks - 1}")
        return int(self._delay[rank]) if self.ranks else 0

    @property
    def delays_ns(self) -> np.ndarray:
        view = self._delay.view() if self.ranks else np.zeros(0, np.int64)
        view.flags.writeable = False
        return view

    @property
    def on(self) -> bool:
        return self._on

    @property
    def state(self) -> PacingState:
        on_thr, off_thr = self._thresholds()
        return PacingState(
            on=self._on,
            spread_ns=self._spread if math.isfinite(self._spread) else 0.0,
            step_ns=self._step if math.isfinite(self._step) else 0.0,
            on_threshold_ns=on_thr,
            off_threshold_ns=off_thr,
            max_delay_ns=int(self._delay.max()) if self.ranks else 0,
            steps_observed=self._observed,
            switches=self._switches,
            predictable_ns=self._predictable,
            noise_ns=self._noise,
        )


def _robust_scalar(
    mean: float, dev: float, x: float, n: int, cfg: PacingConfig, scale: float
) -> tuple[float, float]:
    """One step of the clipped EWMA (docs/pacing.md, "Estimates") for a scalar."""
    if not math.isfinite(x):
        return mean, dev
    if n <= 1 or not math.isfinite(mean):
        return x, 0.0
    weight = max(1.0 / n, cfg.alpha)
    r = x - mean
    if n > 1.0 / cfg.alpha:
        lim = cfg.clip * max(dev, cfg.clip_floor * scale)
        r = min(max(r, -lim), lim)
    return mean + weight * r, dev + weight * (abs(r) - dev)
