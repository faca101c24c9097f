"""The doctor's rules on hand-made measurements: which rank, node or link, and which resource."""

from __future__ import annotations

import json

import pytest
from doctor_docs import make_doc

from hyperacc.preflight.judge import judge, resources_of
from hyperacc.preflight.options import DoctorConfigError, DoctorOptions


def findings(doc):
    return [(f["scope"], f["rank"], f["node"], f["resource"]) for f in doc["findings"]]


def test_a_rank_slow_on_every_cpu_figure_names_the_host_cpu():
    doc = judge(make_doc(slow=lambda rank, node, fig, r: 1.8 if rank == 2 else 1.0))
    assert findings(doc) == [("rank", 2, 0, "cpu")]
    f = doc["findings"][0]
    assert {x["figure"] for x in f["figures"]} == {"matmul", "memory", "dispatch"}
    assert all(1.6 < x["slowdown"] < 2.0 and x["rounds_flagged"] == 5 for x in f["figures"])
    assert doc["exclude_hosts"] == ["host0"]
    assert doc["verdict"].startswith("Rank 2 (node 0, host host0) is slow: host CPU")
    json.dumps(doc, allow_nan=False)


def test_one_slow_figure_names_its_own_resource():
    doc = judge(make_doc(slow=lambda rank, node, fig, r: 1.6 if (rank, fig) == (1, "memory") else 1.0))
    assert findings(doc) == [("rank", 1, 0, "memory")]
    doc = judge(make_doc(slow=lambda rank, node, fig, r: 1.6 if (rank, fig) == (3, "dispatch") else 1.0))
    assert findings(doc) == [("rank", 3, 0, "dispatch")]


def test_noise_alone_flags_nobody():
    for seed in range(20):
        doc = judge(make_doc(nodes=4, per_node=4, noise=0.05, seed=seed))
        assert doc["findings"] == [], (seed, doc["evidence"])
        assert doc["verdict"].startswith("Healthy")


def test_slow_in_fewer_rounds_than_persist_k_is_not_confirmed():
    doc = judge(make_doc(slow=lambda rank, node, fig, r: 2.0 if rank == 1 and r in (1, 3) else 1.0))
    assert doc["findings"] == []
    doc = judge(make_doc(slow=lambda rank, node, fig, r: 2.0 if rank == 1 and r in (0, 1, 3) else 1.0))
    assert findings(doc) == [("rank", 1, 0, "cpu")]


def test_a_fast_rank_is_never_slow():
    doc = judge(make_doc(slow=lambda rank, node, fig, r: 0.4 if rank == 0 else 1.0))
    assert doc["findings"] == []


def test_below_min_slowdown_is_not_material():
    doc = judge(make_doc(noise=0.002, slow=lambda rank, node, fig, r: 1.15 if rank == 2 else 1.0))
    assert doc["findings"] == []  # a clear outlier statistically, but 15 % < min_slowdown (25 %)
    opts = DoctorOptions(min_slowdown=0.10)
    doc = judge(make_doc(noise=0.002, slow=lambda rank, node, fig, r: 1.15 if rank == 2 else 1.0), opts)
    assert findings(doc) == [("rank", 2, 0, "cpu")]


def test_jitter_needs_an_absolute_excess():
    # 3x the median tail, but 30 us above it: below the 0.2 ms floor (docs/doctor.md)
    doc = judge(make_doc(slow=lambda rank, node, fig, r: 3.0 if (rank, fig) == (1, "jitter") else 1.0))
    assert doc["findings"] == []
    doc = judge(make_doc(slow=lambda rank, node, fig, r: 40.0 if (rank, fig) == (1, "jitter") else 1.0))
    assert findings(doc) == [("rank", 1, 0, "jitter")]


def test_most_of_a_nodes_ranks_slow_is_a_node_finding():
    doc = judge(make_doc(nodes=4, per_node=2, slow=lambda rank, node, fig, r: 1.7 if node == 2 else 1.0))
    scopes = findings(doc)
    assert scopes == [("node", None, 2, "cpu")]  # told once, with its slow ranks
    assert doc["findings"][0]["ranks"] == [4, 5]
    assert doc["exclude_hosts"] == ["host2"]


def test_a_node_slow_as_a_whole_is_found_across_nodes():
    # every rank of node 1 equally slow on memory: the node medians are the outliers
    doc = judge(make_doc(nodes=5, per_node=2, slow=lambda rank, node, fig, r: 1.5 if (node, fig) == (1, "memory") else 1.0))
    assert ("node", None, 1, "memory") in findings(doc)


def test_a_slow_node_is_told_from_a_slow_link():
    # every exchange with node 3 is slow: the node's network, not a link
    doc = judge(make_doc(nodes=5, per_node=2, link=lambda a, b, r: 2.0 if 3 in (a, b) else 1.0))
    assert findings(doc) == [("node", None, 3, "network")]
    assert doc["findings"][0]["ranks"] == [6, 7]  # each of its ranks' best exchange is slow too
    assert doc["exclude_hosts"] == ["host3"]
    # only the exchange between nodes 0 and 2 is slow: a link; both ends are fine elsewhere
    doc = judge(make_doc(nodes=5, per_node=2, link=lambda a, b, r: 2.0 if (a, b) == (0, 2) else 1.0))
    assert findings(doc) == [("link", None, None, "link")]
    assert doc["findings"][0]["nodes"] == [0, 2]
    assert doc["exclude_hosts"] == []  # a link is not a host to leave out
    assert [lk["slow"] for lk in doc["links"]].count(True) == 1


def test_three_ranks_are_listed_not_judged():
    doc = judge(make_doc(per_node=3, slow=lambda rank, node, fig, r: 3.0 if rank == 2 else 1.0))
    assert doc["findings"] == [] and doc["judged"]["ranks"] is False
    assert "too few" in doc["verdict"]


def test_two_nodes_say_what_cannot_be_told_apart():
    doc = judge(make_doc(nodes=2, per_node=2))
    assert doc["judged"]["nodes"] is False
    assert any("needs 4 nodes" in line for line in doc["evidence"])
    assert len(doc["links"]) == 1


def test_missing_figures_are_not_judged():
    raw = make_doc(slow=lambda rank, node, fig, r: 2.0 if rank == 2 else 1.0)
    raw["ranks"][2]["figures"]["memory"]["cost_ns"] = [float("nan")] * 5
    del raw["ranks"][1]["figures"]["dispatch"]
    doc = judge(raw)
    assert findings(doc) == [("rank", 2, 0, "compute")]  # matmul only: one CPU figure is "compute"
    json.dumps(doc, allow_nan=False)


def test_resources_of_figures():
    assert resources_of(["matmul", "memory"], cuda=False) == ["cpu"]
    assert resources_of(["matmul", "memory", "read_p99"], cuda=False) == ["cpu", "storage"]
    assert resources_of(["matmul", "memory"], cuda=True) == ["compute", "memory"]  # a GPU matmul is the GPU
    assert resources_of(["read_p50", "read_p99"], cuda=False) == ["storage"]


def test_bad_options_are_one_clear_error():
    with pytest.raises(DoctorConfigError, match="persist_k"):
        DoctorOptions(rounds=2, persist_k=3)
    with pytest.raises(DoctorConfigError, match="unknown doctor option"):
        DoctorOptions.from_mapping({"secs": 3})
    with pytest.raises(DoctorConfigError, match="min_ranks"):
        DoctorOptions(min_ranks=2)


def test_a_uniformly_slow_host_is_named_even_when_one_figure_crosses_the_bar():
    # every CPU figure 1.2x (below the 25 % bar), memory 1.4x: the host's CPU, with the others as corroboration
    doc = judge(make_doc(noise=0.01, slow=lambda rank, node, fig, r: (1.4 if fig == "memory" else 1.2) if rank == 1 else 1.0))
    assert findings(doc) == [("rank", 1, 0, "cpu")]
    figs = {f["figure"]: f["material"] for f in doc["findings"][0]["figures"]}
    assert figs == {"memory": True, "matmul": False, "dispatch": False}
    # memory alone slow, the others at the median: memory
    doc = judge(make_doc(noise=0.01, slow=lambda rank, node, fig, r: 1.4 if (rank, fig) == (1, "memory") else 1.0))
    assert findings(doc) == [("rank", 1, 0, "memory")]


def test_saved_measurements_are_judged_again_by_the_command(tmp_path):
    from click.testing import CliRunner

    from hyperacc.cli import cli

    saved = tmp_path / "m.json"
    saved.write_text(json.dumps(make_doc(nodes=4, per_node=2, slow=lambda rank, node, fig, r: 1.6 if rank == 3 else 1.0)))
    exclude = tmp_path / "hosts.exclude"
    result = CliRunner().invoke(cli, ["doctor", "--load", str(saved), "--exclude-file", str(exclude)],
                                terminal_width=200)  # fmt: skip
    assert result.exit_code == 1, result.output
    for text in ("Rank 3 (node 1, host host1) is slow: host CPU", "Evidence", "Next step", "Figures per rank",
                 "Node pairs", "Exclusion file"):  # fmt: skip
        assert text in result.output
    assert exclude.read_text().split()[0] == "host1"
    # a stricter bar on the same measurements: nothing to leave out
    result = CliRunner().invoke(cli, ["doctor", "--load", str(saved), "--min-slowdown", "0.8", "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["findings"] == []
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    result = CliRunner().invoke(cli, ["doctor", "--load", str(bad)])
    assert result.exit_code == 2 and "not a file written by --save" in result.output


def test_memory_is_not_judged_in_rounds_a_rank_shared_its_core():
    """Ranks taking turns on shared cores (a 2-core host, 4 ranks and a busy process: 41 % of the wall
    time on a core) get the memory bandwidth of whoever ran beside them: a clean 2-node job named one
    rank 1.27x slow on memory in 3 of 5 rounds. Those rounds are not judged; a rank with its core to
    itself is, and its other figures are judged whatever the share."""
    def slow(rank, node, fig, r):
        return 1.6 if (rank, fig) == (1, "memory") else 1.0

    assert findings(judge(make_doc(slow=slow, cpu_share=0.41))) == []
    assert findings(judge(make_doc(slow=slow, cpu_share=0.9))) == [("rank", 1, 0, "memory")]
    matmul = judge(make_doc(slow=lambda rank, node, fig, r: 1.6 if (rank, fig) == (1, "matmul") else 1.0, cpu_share=0.41))
    assert findings(matmul) == [("rank", 1, 0, "compute")]
