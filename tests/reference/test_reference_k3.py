"""The float64 K3 oracle pieces (waste.reference.k3) on cases worked out by hand."""

from __future__ import annotations

import numpy as np

from waste.reference.k3 import depth_attention, situ, situ_mlp


def test_situ_at_hand_computed_points():
    # b tanh(g/b) sigmoid(g) * u: g = 0 gives 0; b = 4, g = 2, u = 1: 4 tanh(0.5) / (1 + e^-2) = 1.62812576719...
    np.testing.assert_allclose(situ(np.array([0.0, 2.0]), np.array([5.0, 1.0]), 4.0, None), [0.0, 1.6281257671922484],
                               rtol=1e-15)
    # With the linear beta the up branch saturates too: g = -1, u = 30, b = 4, bl = 25:
    # 4 tanh(-0.25) / (1 + e) * 25 tanh(1.2) = -5.49118062254...
    np.testing.assert_allclose(situ(np.array([-1.0]), np.array([30.0]), 4.0, 25.0), [-5.491180622549083], rtol=1e-14)
    # A null beta is 1; a large gate saturates at b * u.
    np.testing.assert_allclose(situ(np.array([1.0]), np.array([1.0]), None, None),
                               [np.tanh(1.0) / (1 + np.exp(-1.0))], rtol=1e-15)
    np.testing.assert_allclose(situ(np.array([200.0]), np.array([0.5]), 4.0, None), [2.0], rtol=1e-15)


def test_situ_mlp_is_down_of_the_activation():
    rng = np.random.default_rng(0)
    x, gate, up, down = (rng.standard_normal(s) for s in ((3, 8), (5, 8), (5, 8), (8, 5)))
    want = situ(x @ gate.T, x @ up.T, 4.0, 25.0) @ down.T
    np.testing.assert_allclose(situ_mlp(x, gate, up, down, 4.0, 25.0), want, rtol=1e-14)


def test_depth_attention_with_known_weights():
    D = 4
    ones = np.ones((1, D))
    # Logits are (c . w) / rms(c) with eps = 0: for c = +1 and -1 everywhere and w = ln(3)/D,
    # they are ln 3 and -ln 3, so the softmax weights are 9/10 and 1/10.
    w = np.full(D, np.log(3.0) / D)
    mixed, weights = depth_attention([ones, -ones], w, np.ones((1, D)), 0.0)
    np.testing.assert_allclose(weights, [[0.9, 0.1]], rtol=1e-14)
    np.testing.assert_allclose(mixed, 0.8 * ones, rtol=1e-14)
    # The norm makes the logits scale-free: c and 2c score alike, so the weights are equal.
    mixed, weights = depth_attention([ones, 2 * ones], np.ones(D), np.full((1, D), 0.3), 0.0)
    np.testing.assert_allclose(weights, [[0.5, 0.5]], rtol=1e-14)
    np.testing.assert_allclose(mixed, 1.5 * ones, rtol=1e-14)
    # One candidate: weight 1, the mix is that candidate.
    c = np.random.default_rng(1).standard_normal((3, D))
    mixed, weights = depth_attention([c], np.ones(D), np.ones((1, D)), 1e-5)
    np.testing.assert_array_equal(weights, np.ones((3, 1)))
    np.testing.assert_allclose(mixed, c, rtol=1e-15)
