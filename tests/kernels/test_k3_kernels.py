"""K3's SiTU activation and AttnRes mixing against hand-derived values and the float64 oracle.

Tolerances:
- SiTU: float32 tanh, exp and three products, each within an ulp or two: 4e-6 relative to the
  float64 value (plus 1e-37 absolute for results that underflow).
- SiTU expert: float32 matrix products over <= 96 terms: 1e-5 of the output scale.
- AttnRes: the kernel works in float64 and rounds once, so the mix is within 1e-6 of the
  token's largest |candidate| and the weights within 1e-7 (a float32 rounding of a number <= 1).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from waste.errors import WasteError
from waste.kernels import attn_res as ar
from waste.kernels import moe
from waste.kernels.quant import quantize
from waste.reference import k3 as ref

LN3, LN2 = math.log(3.0), math.log(2.0)


def _situ_close(fast: np.ndarray, exact: np.ndarray) -> None:
    assert fast.dtype == np.float32
    assert np.all(np.abs(fast - exact) <= 4e-6 * np.abs(exact) + 1e-37), np.abs(fast - exact).max()


def test_situ_by_hand() -> None:
    # tanh(ln 3) = (9 - 1) / (9 + 1) = 0.8, sigmoid(ln 3) = 3/4, sigmoid(2 ln 3) = 9/10.
    g = np.array([0.0, LN3, -LN3, 2 * LN3], np.float32)
    u = np.array([5.0, 2.0, -5.0, 4 * LN3], np.float32)
    # beta null (1), linear beta null (plain u): 0; 0.8 * 0.75 * 2; -0.8 * 0.25 * -5
    np.testing.assert_allclose(moe.situ(g[:3], u[:3], None, None), [0.0, 1.2, 1.0], rtol=1e-6)
    # beta 2, linear beta 4 at g = 2 ln 3, u = 4 ln 3: 2 tanh(ln 3) * 9/10 * 4 tanh(ln 3) = 1.44 * 3.2
    np.testing.assert_allclose(moe.situ(g[3:], u[3:], 2.0, 4.0), [4.608], rtol=1e-6)
    # Saturated: tanh -> 1 and sigmoid -> 1 give beta * linear_beta; sigmoid -> 0 gives zero, not NaN.
    big = moe.situ(np.array([1000.0, -1000.0, 60.0], np.float32), np.array([1e4, 1e4, -1e30], np.float32), 4.0, 25.0)
    np.testing.assert_array_equal(big, [100.0, 0.0, -100.0])
    # beta 1 equals beta None.
    np.testing.assert_array_equal(moe.situ(g, u, 1.0, None), moe.situ(g, u, None, None))


def test_tanh_is_within_three_ulp_everywhere() -> None:
    # Near 0 (where 1 - exp(-2y) would cancel), tiny values and saturation.
    y = np.concatenate([np.linspace(-20, 20, 200_001), np.linspace(0.12, 0.13, 10_001),
                        np.geomspace(1e-38, 1.0, 10_001), [np.inf]]).astype(np.float32)
    y = np.concatenate([y, -y])
    got = np.array([moe._tanh(v) for v in y[:: 7]], np.float32)
    exact = np.tanh(y[:: 7].astype(np.float64))
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(got - exact) <= 3 * ulp), np.max(np.abs(got - exact) / ulp)
    assert np.isnan(moe._tanh(np.float32(np.nan)))


@pytest.mark.parametrize(("beta", "linear_beta"), [(None, None), (4.0, 25.0), (0.5, None), (None, 3.0)])
def test_situ_matches_reference(beta: float | None, linear_beta: float | None) -> None:
    rng = np.random.default_rng(11)
    g = (rng.standard_normal((7, 50)) * np.exp2(rng.integers(-12, 8, (7, 50)))).astype(np.float32)
    u = (rng.standard_normal((7, 50)) * np.exp2(rng.integers(-12, 12, (7, 50)))).astype(np.float32)
    g[0, :5] = [0.0, -0.0, 88.0, -88.0, 1e-30]  # sigmoid's extremes and a subnormal product
    _situ_close(moe.situ(g, u, beta, linear_beta), ref.situ(g, u, beta, linear_beta))
    # The kernel writes every element of a NaN-filled buffer.
    out = np.full(g.size, np.nan, np.float32)
    moe._situ(g.ravel(), u.ravel(), *moe.situ_betas(beta, linear_beta), out)
    _situ_close(out.reshape(g.shape), ref.situ(g, u, beta, linear_beta))


def test_situ_on_all_cores_gives_the_serial_bits() -> None:
    # Past SITU_BLOCK elements situ runs in blocks on all cores; a partial last block included.
    rng = np.random.default_rng(12)
    g, u = (rng.standard_normal((3, moe.SITU_BLOCK + 123)) * 4).astype(np.float32)[:2]
    for betas in ((None, None), (4.0, 25.0)):
        serial = np.full(g.size, np.nan, np.float32)
        moe._situ(g.ravel(), u.ravel(), *moe.situ_betas(*betas), serial)
        np.testing.assert_array_equal(moe.situ(g, u, *betas).ravel(), serial)


@pytest.mark.parametrize("fmt", ["f32", "mxfp4"])
def test_situ_mlp_matches_reference(fmt: str) -> None:
    rng = np.random.default_rng(12)
    gate, up = (quantize(rng.standard_normal((96, 64)).astype(np.float32) * 0.3, fmt) for _ in range(2))
    down = quantize(rng.standard_normal((64, 96)).astype(np.float32) * 0.1, fmt)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    y = moe.situ_mlp(x, gate, up, down, 4.0, 25.0)
    assert y.shape == (5, 64) and y.dtype == np.float32
    if fmt == "f32":
        exact = ref.situ_mlp(x, gate.dequantize(), up.dequantize(), down.dequantize(), 4.0, 25.0)
        assert np.abs(y - exact).max() <= 1e-5 * np.abs(exact).max()
    else:  # quantised: the same arithmetic as the activation on its own
        g, u = gate.matmul(x), up.matmul(x)
        np.testing.assert_array_equal(y, down.matmul(moe.situ(g, u, 4.0, 25.0)))
        # A token alone gives the same bits as in a chunk (f32 goes through BLAS, which need not).
        np.testing.assert_array_equal(moe.situ_mlp(x[2:3], gate, up, down, 4.0, 25.0), y[2:3])


def test_situ_refuses_bad_input() -> None:
    with pytest.raises(WasteError, match="beta"):
        moe.situ(np.ones(3), np.ones(3), 0.0, None)
    with pytest.raises(WasteError, match="linear_beta"):
        moe.situ(np.ones(3), np.ones(3), None, -1.0)
    with pytest.raises(WasteError, match="shape"):
        moe.situ(np.ones(3), np.ones(4), None, None)


def test_attn_res_by_hand() -> None:
    # eps 0, D 2. With w = (w0, w1): c = s (1, 1) scores w0 + w1, c = s (1, -1) scores w0 - w1
    # (any s > 0: the score ignores the norm), c = (w1, -w0) scores 0. Picking w0 + w1 = ln 3 and
    # w0 - w1 = ln 2 gives the softmax of (ln 3, ln 2, 0) = (3, 2, 1) / 6.
    w = np.array([(LN3 + LN2) / 2, (LN3 - LN2) / 2], np.float32)
    b0 = np.array([[1e30, 1e30]], np.float32)  # huge: its square overflows float32
    b1 = np.array([[1e-20, -1e-20]], np.float32)  # tiny
    p = np.array([[w[1], -w[0]]], np.float32)
    mixed, weights = ar.attn_res_mix_weights([b0, b1], p, w, 0.0)
    np.testing.assert_allclose(weights, [[0.5, 1 / 3, 1 / 6]], rtol=1e-6)
    np.testing.assert_allclose(mixed, 0.5 * b0 + b1 / 3 + p / 6, rtol=1e-6)
    # One block: softmax(ln 3, 0) = (3/4, 1/4).
    b0 = np.array([[1.0, 1.0]], np.float32)
    w1 = np.array([LN3 / 2, LN3 / 2], np.float32)
    p = np.array([[1.0, -1.0]], np.float32)  # p . w = 0
    mixed, weights = ar.attn_res_mix_weights(b0[None], p, w1, 0.0)
    np.testing.assert_allclose(weights, [[0.75, 0.25]], rtol=1e-6)
    np.testing.assert_allclose(mixed, [[1.0, 0.5]], rtol=1e-6)
    # No block yet: the partial sum itself, weight 1.
    mixed, weights = ar.attn_res_mix_weights([], p, w1, 1e-5)
    np.testing.assert_array_equal(mixed, p)
    np.testing.assert_array_equal(weights, [[1.0]])


def _attn_res_close(mixed: np.ndarray, weights: np.ndarray, blocks: list[np.ndarray], p: np.ndarray,
                    w: np.ndarray, eps: float) -> None:
    exact, exact_w = ref.attn_res_mix(blocks, p, w, eps)
    scale = np.max(np.abs(np.stack([*blocks, p])), axis=(0, 2))[:, None]  # [T, 1]
    assert mixed.dtype == weights.dtype == np.float32
    assert np.all(np.abs(mixed - exact) <= 1e-6 * scale)
    assert np.abs(weights - exact_w).max() <= 1e-7


@pytest.mark.parametrize(("n", "T"), [(0, 3), (1, 1), (3, 9), (8, 6)])
def test_attn_res_matches_reference(n: int, T: int) -> None:
    rng = np.random.default_rng(13 + n * 10 + T)
    D = 64
    size = np.exp2(rng.integers(-30, 30, (n + 1, T, 1)))  # block norms from 1e-9 to 1e9
    cands = (rng.standard_normal((n + 1, T, D)) * size).astype(np.float32)
    if n >= 3:
        cands[2] = cands[1]  # an exact tie
        cands[3, 0] = cands[1, 0] * np.float32(1 + 2**-20)  # a near tie (the score ignores the norm)
    w = (rng.standard_normal(D) * 0.5).astype(np.float32)
    blocks, p = list(cands[:n]), cands[n]
    for eps in (1e-5, 0.0):
        mixed, weights = ar.attn_res_mix_weights(blocks, p, w, eps)
        _attn_res_close(mixed, weights, blocks, p, w, eps)
        # An array of blocks, and one token at a time, give the same bits.
        again = ar.attn_res_mix(cands[:n], p, w, eps)
        np.testing.assert_array_equal(again, mixed)
        for t in range(T):
            one = ar.attn_res_mix(cands[:n, t:t + 1], p[t:t + 1], w, eps)
            np.testing.assert_array_equal(one, mixed[t:t + 1])
    # Both drivers write every element of NaN-filled buffers.
    for drive in (ar._mix_serial, ar._mix_parallel):
        out = np.full((T, D), np.nan, np.float32)
        wts = np.full((T, n + 1), np.nan, np.float32)
        drive(np.ascontiguousarray(cands[:n]), p, w, 1e-5, out, wts)
        _attn_res_close(out, wts, blocks, p, w, 1e-5)


def test_attn_res_saturated_softmax() -> None:
    # Logits hundreds apart: one weight 1, the others exactly 0 (no overflow, no NaN).
    D = 8
    w = np.full(D, 100.0, np.float32)
    b0 = np.full((2, D), 3.0, np.float32)  # scores 800
    p = np.full((2, D), -3.0, np.float32)  # scores -800
    mixed, weights = ar.attn_res_mix_weights([b0], p, w, 1e-5)
    np.testing.assert_array_equal(weights, [[1.0, 0.0], [1.0, 0.0]])
    np.testing.assert_array_equal(mixed, b0)


def test_attn_res_refuses_bad_shapes() -> None:
    p = np.ones((2, 8), np.float32)
    with pytest.raises(WasteError, match="blocks"):
        ar.attn_res_mix(np.ones((1, 3, 8)), p, np.ones(8), 1e-5)
    with pytest.raises(WasteError, match="w_eff"):
        ar.attn_res_mix([p], p, np.ones(7), 1e-5)
    with pytest.raises(WasteError, match="partial"):
        ar.attn_res_mix([], np.ones(8), np.ones(8), 1e-5)
