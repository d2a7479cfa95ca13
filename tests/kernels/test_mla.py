"""Latent-attention kernels (absorbed decode, expanded prefill) against the float64 oracle.

Tolerance: the kernels work in float32 (unit roundoff 6e-8) with dot products over D <= 96
and probability-weighted sums over <= 300 cached rows; the accumulated relative error stays
near 1e-6, so 1e-5 of the output's scale leaves a 10x margin and still catches any indexing,
masking or scaling bug (those give O(1) errors).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close

from waste.errors import WasteError
from waste.kernels.mla import GATE_SERIAL_ROWS, KEY_BLOCK, heads_dot, heads_times, mla_decode, mla_prefill, output_gate
from waste.reference.mla import mla_attention, sigmoid

RTOL = 1e-5
H, NOPE, ROPE, V, R = 3, 16, 8, 12, 32



def _problem(rng: np.random.Generator, n: int, capacity: int):
    """Random queries, a cache of n filled rows (NaN beyond) and kv_b, plus the absorbed queries."""
    latent = np.full((capacity, R + ROPE), np.nan, np.float32)
    latent[:n] = rng.standard_normal((n, R + ROPE))
    kv_b = (rng.standard_normal((H * (NOPE + V), R)) / np.sqrt(R)).astype(np.float32)
    w = kv_b.reshape(H, NOPE + V, R)
    return latent, kv_b, w[:, :NOPE], w[:, NOPE:]


def _absorb(q: np.ndarray, w_uk: np.ndarray) -> np.ndarray:
    """q [T, H, NOPE + ROPE] -> [T, H, R + ROPE] (float32, as the layer does)."""
    q_lat = np.einsum("thn,hnr->thr", q[..., :NOPE].astype(np.float64), w_uk.astype(np.float64))
    return np.concatenate([q_lat, q[..., NOPE:]], axis=-1).astype(np.float32)


# 257, 300, 2100: contexts the decode splits into two, two and eight token ranges summed at the end.
@pytest.mark.parametrize("n", [1, 2, 7, 130, 257, 300, 2100])
def test_decode_matches_non_absorbed(n: int) -> None:
    rng = np.random.default_rng(10 + n)
    latent, kv_b, w_uk, w_uv = _problem(rng, n, n + 5)
    q = rng.standard_normal((1, H, NOPE + ROPE)).astype(np.float32)
    scale = (NOPE + ROPE) ** -0.5
    out = np.full((H, R), np.nan, np.float32)
    probs = np.full((H, n), np.nan, np.float32)
    o_lat, p = mla_decode(_absorb(q, w_uk)[0], latent, n, scale, R, out=out, probs=probs)
    assert o_lat is out and p is probs
    o = np.einsum("hr,hvr->hv", o_lat.astype(np.float64), w_uv.astype(np.float64))
    ref_o, ref_p = mla_attention(q, latent, kv_b, start=n - 1, kv_rank=R, nope=NOPE, v_dim=V, scale=scale)
    assert_close(o, ref_o[0], RTOL)
    assert_close(p, ref_p[0], RTOL)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-5)


def _prefill(q, latent, start, w_uk, w_uv, scale=(NOPE + ROPE) ** -0.5):
    out = np.full((q.shape[0], H, V), np.nan, np.float32)
    o = mla_prefill(q, latent, start, scale, w_uk, w_uv, out=out)
    assert o is out
    return o


# 300 tokens: several key blocks; (70, 130): starts inside a block, crosses two boundaries.
@pytest.mark.parametrize(("start", "T"), [(0, 1), (0, 9), (5, 4), (40, 7), (0, 300), (70, 130)])
def test_prefill_matches_non_absorbed(start: int, T: int) -> None:
    rng = np.random.default_rng(100 + start + T)
    # Rows past start + T stay NaN: a read beyond the causal horizon would poison the output.
    latent, kv_b, w_uk, w_uv = _problem(rng, start + T, start + T + 3)
    q = rng.standard_normal((T, H, NOPE + ROPE)).astype(np.float32)
    ref_o, _ = mla_attention(q, latent, kv_b, start=start, kv_rank=R, nope=NOPE, v_dim=V, scale=(NOPE + ROPE) ** -0.5)
    assert_close(_prefill(q, latent, start, w_uk, w_uv), ref_o, RTOL)


def test_prefill_near_ties_rising_and_huge_scores() -> None:
    """Keys that differ by a hair (near-uniform probabilities); scores whose maximum rises from
    block to block (the online softmax must rescale what it summed); scores near 1e6 (finite)."""
    rng = np.random.default_rng(5)
    T = 2 * KEY_BLOCK + 9
    latent, kv_b, w_uk, w_uv = _problem(rng, T, T)
    q = rng.standard_normal((T, H, NOPE + ROPE)).astype(np.float32)
    base = latent[:T].copy()
    latent[:T] = base[0] + 1e-4 * rng.standard_normal((T, R + ROPE)).astype(np.float32)
    ref_o, ref_p = mla_attention(q, latent, kv_b, start=0, kv_rank=R, nope=NOPE, v_dim=V, scale=0.2)
    assert max(float(np.ptp(p)) for p in ref_p[1:]) < 1e-3  # near-ties indeed
    assert_close(_prefill(q, latent, 0, w_uk, w_uv, 0.2), ref_o, RTOL)
    latent[:T] = base
    latent[:T, R:] += np.linspace(0, 4, T, dtype=np.float32)[:, None]
    q[..., NOPE:] = np.abs(q[..., NOPE:]) + 1  # later keys score higher, by up to about 30
    ref_o, _ = mla_attention(q, latent, kv_b, start=0, kv_rank=R, nope=NOPE, v_dim=V, scale=0.5)
    assert_close(_prefill(q, latent, 0, w_uk, w_uv, 0.5), ref_o, RTOL)
    assert np.all(np.isfinite(_prefill(300 * q, 300 * latent, 0, w_uk, w_uv, 1.0)))


def test_prefill_agrees_with_absorbed_decode() -> None:
    """The expanded prefill of the last query and the absorbed decode of it agree to float32 rounding."""
    rng = np.random.default_rng(7)
    n = KEY_BLOCK + 20
    latent, _, w_uk, w_uv = _problem(rng, n, n)
    q = rng.standard_normal((4, H, NOPE + ROPE)).astype(np.float32)
    chunk = _prefill(q, latent, n - 4, w_uk, w_uv, 0.2)
    o_lat, _ = mla_decode(_absorb(q, w_uk)[-1], latent, n, 0.2, R)
    one = heads_dot(o_lat[None], w_uv)[0]
    assert_close(one, chunk[-1], RTOL)


def test_large_scores_stay_finite() -> None:
    rng = np.random.default_rng(3)
    latent, _, w_uk, _ = _problem(rng, 12, 12)
    latent[:12] *= 300
    q_abs = _absorb(300 * rng.standard_normal((1, H, NOPE + ROPE)).astype(np.float32), w_uk)
    o, p = mla_decode(q_abs[0], latent, 12, 1.0, R)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(p))
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-5)


def test_bad_arguments_raise() -> None:
    latent = np.zeros((4, R + ROPE), np.float32)
    q = np.zeros((H, R + ROPE), np.float32)
    w_uk, w_uv = np.zeros((H, NOPE, R), np.float32), np.zeros((H, V, R), np.float32)
    with pytest.raises(WasteError, match="capacity 4"):
        mla_prefill(np.zeros((3, H, NOPE + ROPE), np.float32), latent, 2, 1.0, w_uk, w_uv)
    with pytest.raises(WasteError, match="weights"):
        mla_prefill(np.zeros((3, H, NOPE + ROPE), np.float32), latent, 0, 1.0, w_uk, w_uv[:, :, :5])
    with pytest.raises(WasteError, match="cached rows"):
        mla_decode(q, latent, 5, 1.0, R)
    with pytest.raises(WasteError, match="width"):
        mla_decode(np.zeros((H, R), np.float32), latent, 2, 1.0, R)
    with pytest.raises(WasteError, match="float32"):
        mla_decode(q, latent.astype(np.float64), 2, 1.0, R)


@pytest.mark.parametrize(("heads", "n"), [(4, 37), (6, 37), (32, 37), (6, 600)])
def test_decode_head_groups(heads: int, n: int) -> None:
    """The decode kernel scores heads four at a time: whole groups and a remainder, against
    latent-space attention in float64 (over one token range, and over three)."""
    rng = np.random.default_rng(heads + n)
    D = R + ROPE
    latent = rng.standard_normal((n + 2, D)).astype(np.float32)
    latent[n:] = np.nan  # rows past the length must not be read
    q = rng.standard_normal((heads, D)).astype(np.float32)
    o, p = mla_decode(q, latent, n, 0.2, R)
    s = 0.2 * q.astype(np.float64) @ latent[:n].astype(np.float64).T
    ref_p = np.exp(s - s.max(axis=1, keepdims=True))
    ref_p /= ref_p.sum(axis=1, keepdims=True)
    assert_close(p, ref_p, RTOL)
    assert_close(o, ref_p @ latent[:n, :R].astype(np.float64), RTOL)


@pytest.mark.parametrize("cuts", [(1,), (5,), (7, 8), (3, 11, 12), (63, 64, 65), (7, 70, 71, 129)])
def test_prefill_is_chunk_invariant(cuts: tuple[int, ...]) -> None:
    """Any cut of the prompt into calls gives the same bits for every query (session resume),
    including cuts at and next to key-block boundaries."""
    rng = np.random.default_rng(11)
    T = 2 * KEY_BLOCK + 13
    latent, _, w_uk, w_uv = _problem(rng, T, T + 2)
    q = rng.standard_normal((T, H, NOPE + ROPE)).astype(np.float32)
    whole = _prefill(q, latent, 0, w_uk, w_uv)
    parts, t0 = [], 0
    for t1 in (*cuts, T):
        parts.append(_prefill(q[t0:t1], latent, t0, w_uk, w_uv))
        t0 = t1
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_heads_times_matches_float64_and_ignores_row_count() -> None:
    rng = np.random.default_rng(12)
    x = rng.standard_normal((9, H, 20)).astype(np.float32)
    w = rng.standard_normal((H, 20, 7)).astype(np.float32)
    y = heads_times(x, w)
    assert_close(y, np.einsum("tha,hab->thb", x.astype(np.float64), w.astype(np.float64)), RTOL)
    np.testing.assert_array_equal(heads_times(x[4:6], w), y[4:6])
    with pytest.raises(WasteError):
        heads_times(x, w[:, :19])


@pytest.mark.parametrize("width", [20, 75])  # inside one block of 32 inputs; two blocks and a partial one
def test_heads_dot_matches_float64_and_ignores_row_count(width: int) -> None:
    rng = np.random.default_rng(13)
    x = rng.standard_normal((9, H, width)).astype(np.float32)
    w = rng.standard_normal((H, 11, width)).astype(np.float32)  # 11 rows: not a multiple of a one-token tile's four
    y = heads_dot(x, w)
    assert_close(y, np.einsum("tha,hba->thb", x.astype(np.float64), w.astype(np.float64)), RTOL)
    np.testing.assert_array_equal(heads_dot(x[4:6], w), y[4:6])
    with pytest.raises(WasteError):
        heads_dot(x, w[:, :, :width - 1])


@pytest.mark.parametrize("n", [5, 300, 2100])
def test_decode_does_not_depend_on_the_thread_count(n: int) -> None:
    """The token ranges decode sums separately follow the context, not the threads: the same bits
    on 1 and 2 threads, over contexts of one, two and all of its ranges."""
    import numba

    rng = np.random.default_rng(40 + n)
    latent, _, w_uk, _ = _problem(rng, n, n)
    q_abs = _absorb(rng.standard_normal((1, H, NOPE + ROPE)).astype(np.float32), w_uk)[0]
    before = numba.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            numba.set_num_threads(threads)
            outs.append(mla_decode(q_abs, latent, n, 0.3, R))
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_output_gate_against_float64_and_alike_for_every_row_count() -> None:
    """K3's output gate o * sigmoid(g): within float32 rounding of the float64 sigmoid, including
    strongly negative and positive g and zeros; a row's bits the same alone and among enough rows
    to run in parallel (prefill), so decode and prefill gate alike."""
    rng = np.random.default_rng(12)
    T = 3 * GATE_SERIAL_ROWS
    o = rng.standard_normal((T, 96)).astype(np.float32)
    g = (rng.standard_normal((T, 96)) * 6).astype(np.float32)
    g[0, :6] = [-110.0, -88.0, -30.0, 0.0, 30.0, 110.0]
    out = output_gate(o, g)
    want = o.astype(np.float64) * sigmoid(g.astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=3e-6, atol=1e-37)
    for t in (0, T - 1):
        np.testing.assert_array_equal(output_gate(o[t:t + 1], g[t:t + 1])[0], out[t])
    with pytest.raises(WasteError, match="output gate"):
        output_gate(o, g[:, :95])
