"""The router kernels against the float64 oracle in waste.reference.moe.

Tolerance: routing weights are a handful of float32 sigmoids, a sum and two products, so they
agree with float64 to a few ulps (1e-6 relative is 15 ulps).
"""

from __future__ import annotations

import numpy as np
import pytest

from waste.errors import WasteError
from waste.kernels.routing import route, route_one_token, router_logits
from waste.reference import moe as ref


@pytest.mark.parametrize(
    ("E", "k", "groups", "keep", "mode", "renorm", "scaling"),
    [
        (8, 2, 1, 1, "unbiased", True, 2.446),
        (16, 3, 4, 2, "unbiased", True, 1.0),
        (16, 3, 4, 2, "biased", True, 2.5),
        (24, 4, 6, 3, "biased", False, 1.5),
        (12, 5, 12, 6, "unbiased", True, 1.0),  # one expert per group: group score is that expert's
        (64, 8, 8, 8, "unbiased", False, 0.7),  # all groups kept
    ],
)
def test_route_matches_reference(E, k, groups, keep, mode, renorm, scaling) -> None:
    rng = np.random.default_rng(E * 100 + k * 10 + groups)
    T = 40
    logits = (2 * rng.standard_normal((T, E))).astype(np.float32)
    bias = (0.3 * rng.standard_normal(E)).astype(np.float32)
    kw = dict(top_k=k, num_groups=groups, topk_group=keep, renormalize=renorm, scaling=scaling, router_weights=mode)
    ids, w = route(logits, bias, **kw)
    ref_ids, ref_w = ref.route(logits, bias, **kw)
    assert ids.dtype == np.int64 and w.dtype == np.float32 and ids.shape == (T, k)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(w, ref_w, rtol=1e-6)
    # Rank order: choice scores (corrected, 0 in dropped groups) are non-increasing along each row.
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    c = s + bias
    size = E // groups
    group_score = np.sort(c.reshape(T, groups, size), axis=-1)[..., -2:].sum(-1) if size > 1 else c
    kept = np.zeros((T, groups), bool)
    np.put_along_axis(kept, np.argsort(-group_score, axis=1, kind="stable")[:, :keep], True, axis=1)
    choice = np.where(np.repeat(kept, size, axis=1), c, 0.0)
    assert np.all(np.diff(np.take_along_axis(choice, ids, axis=1), axis=1) <= 0)
    for t in range(T):
        assert len(set(ids[t])) == k


def test_bias_chooses_but_does_not_weigh() -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((5, 8)).astype(np.float32)
    bias = np.zeros(8, np.float32)
    bias[6] = 10.0  # expert 6 always wins the choice
    ids, w = route(logits, bias, top_k=2, renormalize=False)
    assert np.all(ids[:, 0] == 6)
    np.testing.assert_allclose(w[:, 0], 1 / (1 + np.exp(-logits[:, 6])), rtol=1e-6)
    _, wb = route(logits, bias, top_k=2, renormalize=False, router_weights="biased")
    np.testing.assert_allclose(wb[:, 0], 10 + 1 / (1 + np.exp(-logits[:, 6])), rtol=1e-6)


def test_ties_pick_the_lowest_index() -> None:
    logits = np.zeros((2, 12), np.float32)
    bias = np.zeros(12, np.float32)
    ids, w = route(logits, bias, top_k=3, scaling=3.0)
    np.testing.assert_array_equal(ids, [[0, 1, 2], [0, 1, 2]])
    np.testing.assert_allclose(w, 1.0, rtol=1e-6)
    # Tied groups too: the first two of four equal groups are kept.
    ids, _ = route(logits, bias, top_k=3, num_groups=4, topk_group=2)
    np.testing.assert_array_equal(ids, [[0, 1, 2], [0, 1, 2]])
    ref_ids, _ = ref.route(logits, bias, top_k=3, num_groups=4, topk_group=2)
    np.testing.assert_array_equal(ref_ids, ids)


def test_dropped_groups_are_zeroed_not_removed() -> None:
    # c = s + bias = [1.4, -0.4, 0.6, 0.1]: group 0 scores 1.0, group 1 scores 0.7 and is dropped.
    # Expert 1's biased score is negative, so dropped expert 2 (choice score 0, the lower index
    # of the two zeros) outranks it.
    s = np.array([0.5, 0.2, 0.3, 0.1])
    bias = np.array([0.9, -0.6, 0.3, 0.0], np.float32)
    logits = np.log(s / (1 - s)).astype(np.float32)[None, :]
    for router in (route, ref.route):
        ids, w = router(logits, bias, top_k=2, num_groups=2, topk_group=1, scaling=1.0)
        np.testing.assert_array_equal(ids, [[0, 2]])
        np.testing.assert_allclose(w, [[0.5 / 0.8, 0.3 / 0.8]], rtol=1e-6)


def test_one_expert_keeps_its_score() -> None:
    # Renormalising applies only when k > 1 (transformers' router, FACTS.md): with top-1 the
    # weight is sigmoid(2) x scaling, not scaling. The engine's router, the one-token kernel the
    # decode routes with, and the oracle agree on the hand-computed value.
    logits = np.array([[0.3, -1.0, 2.0, 0.1, -0.5, 0.0, 1.0, -2.0]], np.float32)
    bias = np.zeros(8, np.float32)
    expected = 2.5 / (1 + np.exp(-2.0))  # 2.2020
    for router in (route, ref.route):
        ids, w = router(logits, bias, top_k=1, scaling=2.5)
        np.testing.assert_array_equal(ids, [[2]])
        np.testing.assert_allclose(w, [[expected]], rtol=1e-6)
    x = np.eye(8, dtype=np.float32)[:1]  # a one-hot token: its logits are the weight's first column
    weight = np.zeros((8, 8), np.float32)
    weight[:, 0] = logits[0]
    ids, w = np.empty((1, 1), np.int64), np.empty((1, 1), np.float32)
    route_one_token(x, weight, bias, 1, 1, 1, True, np.float32(2.5), False, ids, w)
    np.testing.assert_array_equal(ids, [[2]])
    np.testing.assert_allclose(w, [[expected]], rtol=1e-6)


def test_router_logits_are_float32_products() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    w = rng.standard_normal((8, 16)).astype(np.float32)
    got = router_logits(x, w)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-5)
    # A token's logits do not depend on the other tokens of its chunk (routing is chunk-invariant).
    np.testing.assert_array_equal(router_logits(x[1:2], w), got[1:2])


def test_a_prefills_router_logits_on_all_cores_are_each_tokens_own() -> None:
    """Past PARALLEL_ROUTER_WORK products the tokens' rows run on all cores: every row as close to
    float64 as the serial path's, and the same bits as that token routed alone."""
    from waste.kernels.routing import PARALLEL_ROUTER_WORK

    rng = np.random.default_rng(7)
    x = rng.standard_normal((300, 64)).astype(np.float32)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    assert x.shape[0] * w.size >= PARALLEL_ROUTER_WORK
    got = router_logits(x, w)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-4)
    alone = np.concatenate([router_logits(x[t:t + 1], w) for t in range(x.shape[0])])
    np.testing.assert_array_equal(got, alone)


def test_route_rejects_bad_arguments() -> None:
    logits = np.zeros((2, 8), np.float32)
    bias = np.zeros(8, np.float32)
    with pytest.raises(WasteError, match="router_weights"):
        route(logits, bias, top_k=2, router_weights="both")
    with pytest.raises(WasteError, match="groups"):
        route(logits, bias, top_k=2, num_groups=3)
    with pytest.raises(WasteError, match="top_k"):
        route(logits, bias, top_k=9, num_groups=4, topk_group=2)
    with pytest.raises(WasteError, match="8 values"):
        route(logits, np.zeros(7, np.float32), top_k=2)
