"""Comparing runs: differences, intervals of rate differences, and limits that break only when they should."""

from __future__ import annotations

import pytest

from hyperacc.analysis.compare import CompareError, Figure, compare, parse_limits


def figs(p99: float, spikes: int, steps: int, tput: float) -> dict[str, Figure]:
    return {
        "p99": Figure("p99", p99, "ms", "lower"),
        "spike_rate": Figure("spike_rate", spikes / steps, "%", "lower", spikes, steps),
        "steps_per_s": Figure("steps_per_s", tput, "/s", "higher"),
    }


def test_limits_are_read_and_unknown_names_are_refused() -> None:
    known = ["p99", "spike_rate", "steps_per_s"]
    lims = parse_limits("p99=+10%, spike_rate=+2pp,steps_per_s=-5%", known)
    assert [(lim.name, lim.sign, round(lim.amount, 4), lim.kind) for lim in lims] == [
        ("p99", 1, 0.1, "relative"), ("spike_rate", 1, 0.02, "points"), ("steps_per_s", -1, 0.05, "relative"),
    ]  # fmt: skip
    with pytest.raises(CompareError, match="no figure"):
        parse_limits("p98=+1%", known)
    with pytest.raises(CompareError, match="cannot read"):
        parse_limits("p99<10", known)


def test_a_slower_tail_breaks_its_limit_and_a_noisy_rate_does_not() -> None:
    known = ["p99", "spike_rate", "steps_per_s"]
    lims = parse_limits("p99=+10%,spike_rate=+2pp,steps_per_s=-5%", known)
    base = figs(100.0, 10, 1000, 20.0)
    worse = figs(125.0, 13, 1000, 18.0)  # +25 % p99; 1.0 -> 1.3 % spikes (noise); -10 % throughput
    changes = {c.name: c for c in compare([base, worse], lims)}
    assert changes["p99"].broken == ["p99=+10%"] and changes["p99"].worse
    assert changes["steps_per_s"].broken == ["steps_per_s=-5%"] and changes["steps_per_s"].worse
    sr = changes["spike_rate"]
    assert sr.low < 0 < sr.high and sr.broken == []  # +0.3 pp is within noise
    much = figs(100.0, 90, 1000, 20.0)  # 1 % -> 9 % spikes: significant and beyond +2 pp
    assert {c.name: c.broken for c in compare([base, much], lims)}["spike_rate"] == ["spike_rate=+2pp"]
    better = figs(80.0, 2, 1000, 25.0)
    assert all(not c.broken and c.worse is False for c in compare([base, better], lims))
