"""DetectionOptions refuses impossible values with a message that names the option."""

import math

import pytest

from hyperacc.analysis import LiveDetector, diagnose
from hyperacc.analysis.options import DetectionOptions

BAD = [
    ({"top_events": 0}, "top_events must be >= 1"),
    ({"top_events": -1}, "top_events must be >= 1"),
    ({"ranks_per_node": 0}, "ranks_per_node must be >= 1"),
    ({"z_threshold": math.nan}, "z_threshold must be a finite number"),
    ({"iqr_k": math.inf}, "iqr_k must be a finite number"),
    ({"spike_floor_rel": math.nan}, "spike_floor_rel must be a finite number"),
    ({"min_slowdown": -0.1}, "min_slowdown must be >= 0"),
    ({"target": 1.0}, "target must be a probability"),
    ({"target": math.nan}, "target must be a finite number"),
    ({"window_steps": 0}, "window_steps must be >= 1"),
    ({"window_steps": 2.5}, "window_steps must be an integer"),
    ({"warmup_steps": True}, "warmup_steps must be an integer"),
    ({"min_ranks": 2}, "min_ranks must be >= 3"),
    ({"persist_k": 6, "persist_n": 5}, "persist_k must be <= persist_n"),
    ({"explain_share": 0.0}, "explain_share must be > 0"),
    ({"top_alpha": 2.0}, "top_alpha must be >= 0 and <= 1"),
    ({"projection_nodes": (8, 0)}, "projection_nodes must be >= 1"),
    ({"projection_nodes": "64"}, "projection_nodes must be a list"),
    ({"outlier_rule": "xor"}, "outlier_rule must be 'and' or 'or'"),
]


@pytest.mark.parametrize(("options", "message"), BAD)
def test_impossible_values_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        DetectionOptions(**options)


def test_every_entry_point_validates_the_same_way(clean_run):
    with pytest.raises(ValueError, match="spike_floor_rel must be a finite number"):
        diagnose(clean_run, spike_floor_rel=math.nan)
    with pytest.raises(ValueError, match="top_events must be >= 1"):
        LiveDetector(4, 1, top_events=0)


def test_the_defaults_and_a_few_good_values_are_accepted():
    opts = DetectionOptions(ranks_per_node=8, projection_nodes=[4, 16], top_alpha=0.0, iqr_k=0)
    assert opts.projection_nodes == (4, 16) and opts.steps_to_confirm == 10 + 3 * 50
