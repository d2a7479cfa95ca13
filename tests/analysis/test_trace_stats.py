"""Trace statistics on small traces whose answers can be counted by hand."""

from __future__ import annotations

import numpy as np
import pytest

from waste.analysis.trace_stats import coverage, entropy, hit_rates, popularity, top_experts
from waste.engine.trace import Trace
from waste.errors import WasteError


def _trace() -> Trace:
    # Layer 1: tokens pick {0 1}, {0 2}, {0 1}; layer 3: {3 2} three times. 4 experts.
    ids = np.array([[0, 1], [0, 2], [0, 1], [3, 2], [3, 2], [3, 2]])
    w = np.array([[0.75, 0.25]] * 6, np.float32)
    hit = np.array([[0, 0], [1, 0], [1, 1], [0, 0], [1, 1], [1, 1]], bool)
    return Trace.from_arrays(
        ids,
        layer=np.array([1, 1, 1, 3, 3, 3]),
        phase=np.array([0, 0, 1, 0, 0, 1]),
        step=np.array([0, 0, 1, 0, 0, 1]),
        weights=w,
        hit=hit,
        num_layers=4,
        moe_layers=[1, 3],
        num_experts=4,
    )


def test_popularity_counts_and_weights():
    t = _trace()
    assert popularity(t).tolist() == [[3, 2, 1, 0], [0, 0, 3, 3]]
    np.testing.assert_allclose(popularity(t, weighted=True), [[2.25, 0.5, 0.25, 0], [0, 0, 0.75, 2.25]])


def test_top_experts_breaks_ties_to_the_lower_id():
    counts = popularity(_trace())
    assert top_experts(counts, 2).tolist() == [[0, 1], [2, 3]]
    with pytest.raises(WasteError):
        top_experts(counts, 5)


def test_entropy_and_coverage():
    counts = np.array([[3, 2, 1, 0], [0, 0, 3, 3], [1, 1, 1, 1], [0, 0, 0, 0]])
    h = entropy(counts)
    p = np.array([3, 2, 1]) / 6
    np.testing.assert_allclose(h[:3], [-(p * np.log2(p)).sum(), 1.0, 2.0])
    assert np.isnan(h[3])
    np.testing.assert_allclose(entropy(counts, normalized=True)[1:3], [0.5, 1.0])
    # Layer 0: 3 of 6 selections come from expert 0 alone, 5 of 6 need two experts, all need three.
    assert coverage(counts[:3], 0.5).tolist() == [1, 1, 2]
    assert coverage(counts[:3], 0.8).tolist() == [2, 2, 4]
    assert coverage(counts[:3], 1.0).tolist() == [3, 2, 4]
    with pytest.raises(WasteError):
        coverage(counts, 0.0)


def test_recorded_hit_rates_by_phase_and_layer():
    r = hit_rates(_trace())
    assert r["prefill"] == {1: 0.25, 3: 0.5}
    assert r["decode"] == {1: 1.0, 3: 1.0}
    assert r["all"] == {1: 0.5, 3: 4 / 6}
