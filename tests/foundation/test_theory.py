"""Spike theory reproduces the seeds' numbers and refuses impossible input."""

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from hyperacc import theory
from hyperacc.cli import cli


def test_seed_64_nodes_at_4_percent_spike_on_more_than_90_percent_of_steps():
    p = theory.cluster_spike_probability(0.04, nodes=64)
    assert p > 0.90
    assert p == pytest.approx(0.927, abs=5e-4)


def test_half_percent_gc_is_92_percent_only_per_process():
    # 64 nodes x 8 ranks: the seed's ~92 %; per node (64 draws) it would be only ~27 %
    assert theory.cluster_spike_probability(0.005, ranks_per_node=8, nodes=64) == pytest.approx(0.923, abs=5e-4)
    assert theory.cluster_spike_probability(0.005, ranks_per_node=1, nodes=64) == pytest.approx(0.274, abs=5e-4)


def test_required_rates_for_64_and_256_nodes():
    # a quarter of steps: 64 nodes need <= 0.5 %, 256 nodes 0.1-0.3 % (the seed)
    p64 = theory.required_rate(theory.DEFAULT_TARGET, nodes=64)
    p256 = theory.required_rate(theory.DEFAULT_TARGET, nodes=256)
    assert 0.004 < p64 < 0.005
    assert 0.001 <= p256 <= 0.003
    # at half the steps, 256 nodes still need <= 0.3 %
    assert 0.001 <= theory.required_rate(0.5, nodes=256) <= 0.003
    # the inverse is exact
    assert theory.cluster_spike_probability(p64, nodes=64) == pytest.approx(theory.DEFAULT_TARGET)


def test_node_and_rank_rates_combine():
    both = theory.cluster_spike_probability(0.001, ranks_per_node=8, nodes=16, p_node=0.002)
    assert both == pytest.approx(1 - (0.999 ** 128) * (0.998 ** 16))
    req = theory.required_rate(0.3, nodes=16, ranks_per_node=8, p_node=0.002)
    assert theory.cluster_spike_probability(req, 8, 16, 0.002) == pytest.approx(0.3)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_probabilities_outside_unit_interval_are_refused(bad):
    with pytest.raises(theory.TheoryError, match="p_rank"):
        theory.cluster_spike_probability(bad, nodes=4)


def test_unreachable_target_is_refused():
    with pytest.raises(theory.TheoryError, match="cannot be met"):
        theory.required_rate(0.1, nodes=64, p_node=0.01)


def test_expected_max_of_normals_is_exact():
    want = {4: 1.029, 64: 2.344, 256: 2.827, 1024: 3.248, 2048: 3.442}
    for n, v in want.items():
        assert theory.expected_max_normal(n) == pytest.approx(v, abs=2e-3)


def test_cluster_cv_is_not_monotone_in_n():
    m = theory.ClusterStepModel(base=100, noise=5, p_rank=1e-3, spike_size=200)
    cv = {n: m.stats(n).cv for n in (4, 64, 256, 1024, 2048)}
    assert cv[256] > cv[64] > cv[4]
    assert cv[256] > cv[1024] > cv[2048]
    assert cv[256] == pytest.approx(0.50, abs=0.01)


@pytest.mark.parametrize("spike", ["fixed", "exp", "lognormal"])
def test_order_statistics_agree_with_monte_carlo(spike):
    m = theory.ClusterStepModel(base=100, noise=5, p_rank=0.01, spike_size=50, spike=spike,
                                ranks_per_node=4, p_node=0.005)
    exact = m.stats(16)
    rng = np.random.default_rng(7)
    draws, shape = 40_000, (40_000, 16, 4)

    def mags(size):
        if spike == "fixed":
            return np.full(size, 50.0)
        if spike == "exp":
            return rng.exponential(50, size)
        return 50 * np.exp(0.5 * rng.standard_normal(size))

    x = 100 + 5 * rng.standard_normal(shape) + (rng.random(shape) < 0.01) * mags(shape)
    x = x + (rng.random((draws, 16, 1)) < 0.005) * mags((draws, 16, 1))
    mx = x.max(axis=(1, 2))
    se = mx.std() / math.sqrt(draws)
    assert exact.mean == pytest.approx(mx.mean(), abs=5 * se + 0.05)
    assert exact.p50 == pytest.approx(np.median(mx), rel=0.01)
    assert exact.std == pytest.approx(mx.std(), rel=0.05)


def test_serial_mtbf_and_survival():
    assert theory.cluster_mtbf(1000.0, 10) == pytest.approx(100.0)
    assert theory.cluster_mtbf([100.0, 100.0, 50.0]) == pytest.approx(25.0)
    assert theory.survival_probability(100.0, 100.0) == pytest.approx(math.exp(-1))
    assert theory.interruptions_per_day(12.0) == pytest.approx(2.0)
    with pytest.raises(theory.TheoryError):
        theory.cluster_mtbf([100.0, 0.0])


def test_cli_shows_92_percent_for_the_seed_case():
    out = CliRunner().invoke(cli, ["theory", "--nodes", "64", "--ranks-per-node", "8", "--p-rank", "0.005"])
    assert out.exit_code == 0, out.output
    assert "92.3 %" in out.output


def test_cli_json_inverts_the_target():
    out = CliRunner().invoke(cli, ["theory", "--sweep", "64,256", "--ranks-per-node", "1", "--p-rank", "0.002",
                                   "--target", "0.25", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)["rows"]
    assert [r["nodes"] for r in rows] == [64, 256]
    assert rows[0]["required_p_rank"] == pytest.approx(theory.required_rate(0.25, 64))
    assert rows[1]["p_cluster"] == pytest.approx(1 - 0.998 ** 256)


@pytest.mark.parametrize("args,needle", [
    (["--p-rank", "1.5"], "p_rank"),
    (["--nodes", "0"], "nodes"),
    (["--p-node", "0.01", "--target", "0.1", "--nodes", "64"], "cannot be met"),
    (["--sweep", "a,b"], "whole numbers"),
    (["--bogus"], "No such option"),
])
def test_cli_errors_are_one_line_without_traceback(args, needle):
    out = CliRunner().invoke(cli, ["theory", *args])
    assert out.exit_code != 0
    assert needle in out.output
    assert "Traceback" not in out.output
