"""Self-checks of the float64 KDA oracles: the chunked form equals the recurrence, gates and
conv match their closed forms, and the layer's pieces agree with each other.

The chunk/recurrent comparison is between two float64 computations of the same quantity by
different algebra, so it holds to ~1e-12 (rounding of float64 over 64-term sums), not 1e-6.
"""

from __future__ import annotations

import numpy as np
import pytest

from waste.errors import WasteError
from waste.reference.kda import (
    kda_gate_lower_bound,
    kda_gate_softplus,
    naive_a_log_per_head,
    naive_chunk_kda,
    naive_gated_rmsnorm,
    naive_l2norm,
    naive_recurrent_kda,
    naive_short_conv,
)


def _inputs(rng: np.random.Generator, T: int, H: int, K: int, V: int, log_decay: np.ndarray | None = None):
    q = rng.standard_normal((T, H, K))
    k = rng.standard_normal((T, H, K))
    v = rng.standard_normal((T, H, V))
    g = -np.logaddexp(0.0, -rng.standard_normal((T, H, K))) if log_decay is None else log_decay
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((T, H))))
    s0 = rng.standard_normal((H, K, V))
    return q, k, v, g, beta, s0


@pytest.mark.parametrize(("T", "chunk"), [(1, 4), (17, 4), (16, 16), (37, 16), (20, 64)])
def test_naive_chunk_equals_naive_recurrent(T: int, chunk: int) -> None:
    rng = np.random.default_rng(T * 100 + chunk)
    q, k, v, g, beta, s0 = _inputs(rng, T, 2, 8, 5)
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = naive_chunk_kda(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    np.testing.assert_allclose(o_c, o_r, rtol=0, atol=1e-12)
    np.testing.assert_allclose(s_c, s_r, rtol=0, atol=1e-12)


def test_naive_chunk_strong_decay_is_finite_and_exact() -> None:
    rng = np.random.default_rng(1)
    T, H, K = 48, 2, 8
    # -300 per step: exp(G) underflows inside the first chunk; the naive form never forms exp(-G)
    g = np.full((T, H, K), -300.0)
    g[:, :, ::2] = -0.01
    q, k, v, g, beta, s0 = _inputs(rng, T, H, K, K, g)
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = naive_chunk_kda(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    assert np.all(np.isfinite(o_c)) and np.all(np.isfinite(s_c))
    np.testing.assert_allclose(o_c, o_r, rtol=0, atol=1e-12)
    np.testing.assert_allclose(s_c, s_r, rtol=0, atol=1e-12)


def test_recurrence_first_token_by_hand() -> None:
    rng = np.random.default_rng(2)
    q, k, v, g, beta, s0 = _inputs(rng, 1, 1, 4, 3)
    o, s = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, scale=0.7)
    qn, kn = q[0, 0] / np.sqrt(q[0, 0] @ q[0, 0] + 1e-6), k[0, 0] / np.sqrt(k[0, 0] @ k[0, 0] + 1e-6)
    decayed = np.exp(g[0, 0])[:, None] * s0[0]
    want = decayed + beta[0, 0] * np.outer(kn, v[0, 0] - decayed.T @ kn)
    np.testing.assert_allclose(s[0], want, atol=1e-14)
    np.testing.assert_allclose(o[0, 0], want.T @ (0.7 * qn), atol=1e-14)


def test_l2norm_eps_inside_root() -> None:
    x = np.array([[3.0, 4.0]])
    np.testing.assert_allclose(naive_l2norm(x), x / np.sqrt(25 + 1e-6))


def test_gates_closed_forms() -> None:
    H, K = 2, 3
    z = np.array([[[-30.0, 0.0, 19.0], [20.5, 1.0, -2.0]]])  # [1, H, K]
    a_log = np.array([0.5, -1.0])
    bias = np.zeros(H * K)
    g = kda_gate_softplus(z, a_log, bias)
    sp = np.where(z > 20, z, np.log1p(np.exp(z)))
    np.testing.assert_allclose(g, -np.exp(a_log)[None, :, None] * sp)
    assert g[0, 1, 0] == -np.exp(-1.0) * 20.5  # linear branch above 20
    lb = kda_gate_lower_bound(z.reshape(1, H * K), a_log.reshape(1, 1, H, 1), bias, -5.0)
    np.testing.assert_allclose(lb, -5.0 / (1 + np.exp(-np.exp(a_log)[None, :, None] * z)))
    assert lb.shape == (1, H, K)


def test_a_log_forms() -> None:
    H = 3
    a = np.array([0.1, 0.2, 0.3])
    for form in (a.reshape(1, 1, H, 1), a, np.concatenate([a, np.zeros(5)])):
        np.testing.assert_array_equal(naive_a_log_per_head(form, H), a)
    with pytest.raises(WasteError):
        naive_a_log_per_head(np.array([0.1, 0.2, 0.3, 0.4]), H)
    # a [K] vector padded past H is recognised from z [T, H*K] alone
    z = np.zeros((1, H * 8))
    g = kda_gate_softplus(z, np.concatenate([a, np.zeros(5)]), np.zeros(H * 8))
    assert g.shape == (1, H, 8)


def test_short_conv_against_numpy_convolve_and_history() -> None:
    rng = np.random.default_rng(3)
    T, C, W = 9, 5, 4
    x = rng.standard_normal((T, C))
    w = rng.standard_normal((C, 1, W))
    y, hist = naive_short_conv(x, w)
    for c in range(C):
        pre = np.convolve(x[:, c], w[c, 0, ::-1])[:T]  # causal, zero history
        np.testing.assert_allclose(y[:, c], pre / (1 + np.exp(-pre)), atol=1e-13)
    np.testing.assert_array_equal(hist, x[-(W - 1):])
    y1, h1 = naive_short_conv(x[:2], w)  # shorter than the ring
    y2, h2 = naive_short_conv(x[2:], w, h1)
    np.testing.assert_allclose(np.concatenate([y1, y2]), y, atol=1e-14)
    np.testing.assert_array_equal(h2, hist)


def test_gated_rmsnorm() -> None:
    rng = np.random.default_rng(4)
    o, gate, w = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4)), rng.standard_normal(4)
    got = naive_gated_rmsnorm(o, gate, w, 1e-5)
    rms = np.sqrt(np.mean(o**2, axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(got, o / rms * w / (1 + np.exp(-gate)))
