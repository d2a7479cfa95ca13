"""KDA kernels (gates, short conv, gated RMSNorm, decode step, recurrence) against the float64 oracles.

Tolerances. The recurrence runs in float32 (unit roundoff 6e-8) with K-term dot products and
a state that sums ~T decayed rank-1 updates; the issue fixes max |diff| <= 1e-6 for outputs
and states of O(1) size at the real shapes (the seed's C kernel reached 4.1e-8 / 1.8e-7).
Elementwise float32 functions (gates, conv, norm) are held to a few ulp relative: 2e-6. Gates
also get an absolute 1e-7: g enters only as exp(g), so 1e-7 in g is 1e-7 relative in the decay,
and the tiny gates of saturated sigmoids (1e-20) carry the float32 rounding of their argument.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import max_abs_diff

from waste.errors import WasteError
from waste.jit import kernel
from waste.kernels import kda as kk
from waste.kernels import kda_decode as kd
from waste.kernels import short_conv as sc
from waste.kernels.fastmath import fexp
from waste.kernels.kda_chunk import prefill_kda
from waste.reference import kda as ref
from waste.testing import kda_inputs

ATOL = 1e-6


@kernel
def _exp_all(x, out):
    for i in range(x.size):
        out[i] = fexp(x[i])


@kernel
def _strip(P, pk, a, ak, aq, pd, u, w, j0):
    kd._strip_pass(P, pk, a, ak, aq, pd, u, w, j0)  # an intrinsic: callable only from compiled code



def test_fexp_accuracy() -> None:
    x = np.concatenate([np.linspace(-87, 88, 20001), [0.0, -1e-8, -87.5, -200.0, -np.inf]]).astype(np.float32)
    out = np.full_like(x, np.nan)
    _exp_all(x, out)
    want = np.exp(x.astype(np.float64))
    normal = x >= -87.3
    assert np.max(np.abs(out[normal] / want[normal] - 1)) < 3e-7
    assert np.all(out[x < -87.34] == 0.0)
    _exp_all(np.array([np.nan], np.float32), out[:1])
    assert np.isnan(out[0])


@pytest.mark.parametrize("a_log_form", ["1_1_H_1", "H", "K_padded"])
@pytest.mark.parametrize("variant", ["softplus", "lower_bound"])
def test_gates_match_reference(variant: str, a_log_form: str) -> None:
    rng = np.random.default_rng(11)
    T, H, Kd = 5, 3, 8
    z = (4 * rng.standard_normal((T, H * Kd))).astype(np.float32)
    z[0, :3] = [25.0, 20.0, -40.0]  # linear branch, its edge, deep negative
    bias = rng.standard_normal(H * Kd).astype(np.float32)
    a = np.log(rng.uniform(1, 16, H)).astype(np.float32)
    a_log = {"1_1_H_1": a.reshape(1, 1, H, 1), "H": a, "K_padded": np.concatenate([a, np.zeros(Kd - H, np.float32)])}
    if variant == "softplus":
        got = kk.kda_gate_softplus(z, a_log[a_log_form], bias)
        want = ref.kda_gate_softplus(z, a_log[a_log_form], bias)
    else:
        got = kk.kda_gate_lower_bound(z, a_log[a_log_form], bias, -5.0)
        want = ref.kda_gate_lower_bound(z, a_log[a_log_form], bias, -5.0)
    assert got.shape == (T, H, Kd) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    got3 = kk.kda_gate_softplus(z.reshape(T, H, Kd), a, bias)  # [T, H, K] input too
    np.testing.assert_allclose(got3, ref.kda_gate_softplus(z.reshape(T, H, Kd), a, bias), rtol=2e-6, atol=1e-7)


def test_gate_bad_inputs() -> None:
    z = np.zeros((2, 12), np.float32)
    with pytest.raises(WasteError):
        kk.kda_gate_softplus(z, np.zeros(3), np.zeros(11))
    with pytest.raises(WasteError):
        kk.kda_gate_lower_bound(z, np.zeros(3), np.zeros(12), 1.0)
    with pytest.raises(WasteError):
        kk.kda_gate_softplus(z, np.ones(5), np.zeros(12), num_heads=3)


def test_short_conv_sequence_and_ring() -> None:
    rng = np.random.default_rng(12)
    T, C, W = 10, 40, 4
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((C, 1, W)).astype(np.float32)
    taps = sc.conv_taps(w)
    want, want_ring = ref.naive_short_conv(x, w)
    ring = np.zeros((W - 1, C), np.float32)
    y = sc.short_conv_silu(x, taps, ring)
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(ring, want_ring)
    # prefill 2 (shorter than the ring), then 1, then token-by-token decode == one pass
    ring = np.zeros((W - 1, C), np.float32)
    parts = [sc.short_conv_silu(x[:2], taps, ring), sc.short_conv_silu(x[2:3], taps, ring)]
    parts += [sc.short_conv_silu_step(x[t], taps, ring)[None] for t in range(3, T)]
    np.testing.assert_allclose(np.concatenate(parts), y, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(ring, want_ring)
    with pytest.raises(WasteError):
        sc.short_conv_silu(x, taps, np.zeros((W, C), np.float32))


def test_short_prefill_after_a_filled_ring() -> None:
    """A prefill shorter than the ring, resumed from a ring that holds earlier tokens (a session's
    second prompt of two tokens), keeps the ring's later rows: it must equal stepping token by
    token. From a zero ring, a wrong shift would move zeros and go unseen."""
    rng = np.random.default_rng(15)
    C, W = 24, 4
    taps = sc.conv_taps(rng.standard_normal((C, 1, W)).astype(np.float32))
    x = rng.standard_normal((2, C)).astype(np.float32)
    ring = rng.standard_normal((W - 1, C)).astype(np.float32)
    stepped = ring.copy()
    want = np.stack([sc.short_conv_silu_step(x[t], taps, stepped) for t in range(2)])
    got = sc.short_conv_silu(x, taps, ring)
    np.testing.assert_array_equal(ring, stepped)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_stacked_conv_step_equals_separate_steps() -> None:
    """The decode path runs the q, k, v convs in one call; it must equal three separate steps."""
    rng = np.random.default_rng(14)
    C, W = 48, 4
    x = rng.standard_normal((3, C)).astype(np.float32)
    taps = np.stack([sc.conv_taps(rng.standard_normal((C, 1, W)).astype(np.float32)) for _ in range(3)])
    rings = rng.standard_normal((3, W - 1, C)).astype(np.float32)
    separate_rings = rings.copy()
    want = np.stack([sc.short_conv_silu_step(x[i], taps[i], separate_rings[i]) for i in range(3)])
    got = sc.short_conv_silu_step(x, taps, rings)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(rings, separate_rings)
    with pytest.raises(WasteError):
        sc.short_conv_silu_step(x, taps[:2], rings)


def test_gated_rmsnorm_matches_reference() -> None:
    rng = np.random.default_rng(13)
    o = rng.standard_normal((3, 4, 16)).astype(np.float32)
    gate = (3 * rng.standard_normal((3, 4 * 16))).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 16).astype(np.float32)
    got = kk.gated_rmsnorm(o, gate, w, 1e-5)
    np.testing.assert_allclose(got, ref.naive_gated_rmsnorm(o, gate.reshape(o.shape), w, 1e-5), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize(("T", "H", "Kd"), [(24, 4, 32), (64, 32, 128)])
def test_recurrent_and_decode_match_reference(T: int, H: int, Kd: int, record_property) -> None:
    rng = np.random.default_rng(T + H)
    q, k, v, g, beta, s0 = kda_inputs(rng, T, H, Kd, Kd)
    o_ref, s_ref = ref.naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    o, s = kk.recurrent_kda(q, k, v, g, beta, initial_state=s0)
    err_o, err_s = max_abs_diff(o, o_ref), max_abs_diff(s, s_ref)
    record_property("recurrent_max_diff", (err_o, err_s))
    assert err_o <= ATOL and err_s <= ATOL, (err_o, err_s)
    state = s0.copy()
    o_dec = np.stack([kd.kda_decode_step(q[t], k[t], v[t], g[t], beta[t], state) for t in range(T)])
    err_o, err_s = max_abs_diff(o_dec, o_ref), max_abs_diff(state, s_ref)
    record_property("decode_max_diff", (err_o, err_s))
    assert err_o <= ATOL and err_s <= ATOL, (err_o, err_s)
    o_def, state = _deferred_decode(q, k, v, g, beta, s0)
    err_o, err_s = max_abs_diff(o_def, o_ref), max_abs_diff(state, s_ref)
    record_property("deferred_decode_max_diff", (err_o, err_s))
    assert err_o <= ATOL and err_s <= ATOL, (err_o, err_s)


def _deferred_decode(q, k, v, g, beta, s0, fold_after=(), **kw):
    """All tokens through kda_decode_step_deferred from s0 (folding the pending update in after
    the listed tokens and at the end): (o [T, H, V], final state [H, K, V])."""
    T, H, Kd = q.shape
    base = s0.copy()
    pk, pd = np.zeros((H, Kd), np.float32), np.zeros((H, v.shape[2]), np.float32)
    o = []
    for t in range(T):
        o.append(kd.kda_decode_step_deferred(q[t], k[t], v[t], g[t], beta[t], base, pk, pd, **kw))
        if t in fold_after:
            kd.apply_pending(base, pk, pd)
    kd.apply_pending(base, pk, pd)
    assert not np.any(pk) and not np.any(pd)
    return np.stack(o), base


@pytest.mark.parametrize(("Kd", "V"), [(6, 5), (7, 16), (13, 9), (5, kd.STRIP), (3, 2 * kd.STRIP + 6)])
def test_deferred_decode_any_head_size(Kd: int, V: int) -> None:
    """Value sizes below one column strip, exactly one, and two with columns left over."""
    rng = np.random.default_rng(Kd * V)
    q, k, v, g, beta, s0 = kda_inputs(rng, 11, 3, Kd, V)
    o_ref, s_ref = ref.naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    o, s = _deferred_decode(q, k, v, g, beta, s0)
    assert max_abs_diff(o, o_ref) <= ATOL and max_abs_diff(s, s_ref) <= ATOL


@pytest.mark.parametrize(("Kd", "V"), [(32, 9), (7, 9), (6, kd.STRIP + 5)])
def test_folding_the_pending_update_early_changes_no_bits(Kd: int, V: int) -> None:
    rng = np.random.default_rng(18)
    q, k, v, g, beta, s0 = kda_inputs(rng, 12, 4, Kd, V)
    o_late, s_late = _deferred_decode(q, k, v, g, beta, s0)
    o_early, s_early = _deferred_decode(q, k, v, g, beta, s0, fold_after=(0, 3, 4, 8))
    np.testing.assert_array_equal(o_early, o_late)
    np.testing.assert_array_equal(s_early, s_late)


def test_strip_pass_rounds_as_the_scalar_columns_at_any_alignment() -> None:
    """The vector strips give the bits of the scalar column loop (which rounds as apply_pending),
    and neither the state's alignment nor a NaN-filled output changes them."""
    rng = np.random.default_rng(19)
    H, Kd, V = 3, 9, 2 * kd.STRIP + 3
    q, k, v, g, beta, s0 = kda_inputs(rng, 1, H, Kd, V)
    a = np.exp(g[0, 0]).astype(np.float32)
    ak, aq = (a * rng.standard_normal(Kd)).astype(np.float32), (a * rng.standard_normal(Kd)).astype(np.float32)
    pk, pd = rng.standard_normal(Kd).astype(np.float32), rng.standard_normal(V).astype(np.float32)
    P_scalar, P_strips = s0[0].copy(), s0[0].copy()
    u1, w1, u2, w2 = (np.full(V, np.nan, np.float32) for _ in range(4))
    kd._deferred_columns(P_scalar, pk, a, ak, aq, pd, u1, w1, 0)
    _strip(P_strips, pk, a, ak, aq, pd, u2, w2, 0)
    _strip(P_strips, pk, a, ak, aq, pd, u2, w2, kd.STRIP)
    kd._deferred_columns(P_strips, pk, a, ak, aq, pd, u2, w2, 2 * kd.STRIP)
    for x, y in ((P_strips, P_scalar), (u2, u1), (w2, w1)):
        np.testing.assert_array_equal(x, y)
    aligned = kd.new_state(H, Kd, V)
    assert aligned.ctypes.data % kd.STATE_ALIGN == 0 and not np.any(aligned)
    outs = []
    for offset in (0, 4, 16):  # bytes past a cache line
        buf = np.empty(s0.nbytes + kd.STATE_ALIGN + offset, np.uint8)
        start = -buf.ctypes.data % kd.STATE_ALIGN + offset
        state = buf[start:start + s0.nbytes].view(np.float32).reshape(s0.shape)
        state[...] = s0
        pending = np.zeros((H, Kd), np.float32), np.zeros((H, V), np.float32)
        o = np.full((H, V), np.nan, np.float32)
        kd._deferred_decode_kernel(q[0], k[0], v[0], g[0], beta[0], Kd**-0.5, True, state, *pending, o)
        outs.append((o, state.copy(), *pending))
    for later in outs[1:]:
        for x, y in zip(later, outs[0], strict=True):
            np.testing.assert_array_equal(x, y)
    o_ref = ref.naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)[0][0]
    assert max_abs_diff(outs[0][0], o_ref) <= ATOL


def test_kernels_write_every_output() -> None:
    rng = np.random.default_rng(14)
    T, H, Kd, V = 70, 2, 16, 12  # T spans two time tiles, V an odd number of column pairs
    q, k, v, g, beta, s0 = kda_inputs(rng, T, H, Kd, V)
    o = np.full((T, H, V), np.nan, np.float32)
    state = s0.copy()
    kk._recurrent_kernel(q, k, v, g, beta, Kd**-0.5, True, state, o)
    o_ref, s_ref = ref.naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    assert max_abs_diff(o, o_ref) <= ATOL and max_abs_diff(state, s_ref) <= ATOL
    o1 = np.full((H, V), np.nan, np.float32)
    state = s0.copy()
    kd._decode_kernel(q[0], k[0], v[0], g[0], beta[0], Kd**-0.5, True, state, o1)
    assert max_abs_diff(o1, o_ref[0]) <= ATOL
    o1[:] = np.nan
    state = s0.copy()
    pk, pd = np.zeros((H, Kd), np.float32), np.zeros((H, V), np.float32)
    kd._deferred_decode_kernel(q[0], k[0], v[0], g[0], beta[0], Kd**-0.5, True, state, pk, pd, o1)
    assert max_abs_diff(o1, o_ref[0]) <= ATOL
    y = np.full((T, H * Kd), np.nan, np.float32)
    sc._conv_seq_kernel(q.reshape(T, -1), np.ones((4, H * Kd), np.float32), np.zeros((3, H * Kd), np.float32), y)
    assert np.all(np.isfinite(y))


def test_options_scale_and_no_l2norm() -> None:
    rng = np.random.default_rng(15)
    q, k, v, g, beta, s0 = kda_inputs(rng, 9, 2, 8, 8)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # keep the un-normalised run stable
    for kw in ({"scale": 0.3}, {"l2norm_qk": False}):
        o_ref, s_ref = ref.naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, **kw)
        o, s = kk.recurrent_kda(q, k, v, g, beta, initial_state=s0, **kw)
        assert max_abs_diff(o, o_ref) <= ATOL and max_abs_diff(s, s_ref) <= ATOL
        state = s0.copy()
        o1 = kd.kda_decode_step(q[0], k[0], v[0], g[0], beta[0], state, **kw)
        o1_ref = ref.naive_recurrent_kda(q[:1], k[:1], v[:1], g[:1], beta[:1], initial_state=s0, **kw)[0][0]
        assert max_abs_diff(o1, o1_ref) <= ATOL
        o_def, s_def = _deferred_decode(q, k, v, g, beta, s0, **kw)
        assert max_abs_diff(o_def, o_ref) <= ATOL and max_abs_diff(s_def, s_ref) <= ATOL


@pytest.mark.parametrize("variant", ["lower_bound", "softplus"])
def test_recurrent_strong_decays(variant: str) -> None:
    rng = np.random.default_rng(16)
    T, H, Kd = 256, 2, 32
    z = (3 * rng.standard_normal((T, H * Kd))).astype(np.float32)
    bias = np.zeros(H * Kd, np.float32)
    if variant == "lower_bound":
        g = kk.kda_gate_lower_bound(z + 30, np.zeros(H, np.float32), bias, -5.0)  # at the -5 floor
    else:
        g = kk.kda_gate_softplus(z, np.full(H, 5.0, np.float32), bias)  # exp(A_log) = 148
    q, k, v, g, beta, s0 = kda_inputs(rng, T, H, Kd, Kd, g)
    o_ref, s_ref = ref.naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    o, s = kk.recurrent_kda(q, k, v, g, beta, initial_state=s0)
    assert max_abs_diff(o, o_ref) <= 1e-5 and max_abs_diff(s, s_ref) <= 1e-5


def test_prefill_kda_and_bad_shapes() -> None:
    rng = np.random.default_rng(17)
    q, k, v, g, beta, s0 = kda_inputs(rng, 7, 2, 8, 8)
    o_ref, s_ref = ref.naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    o, s = prefill_kda(q, k, v, g, beta, initial_state=s0)
    assert max_abs_diff(o, o_ref) <= ATOL and max_abs_diff(s, s_ref) <= ATOL
    with pytest.raises(WasteError):
        kk.recurrent_kda(q, k, v, g[:, :1], beta)
    with pytest.raises(WasteError):
        kk.recurrent_kda(q, k, v, g, beta, initial_state=np.zeros((2, 8, 9)))
    with pytest.raises(WasteError):
        kd.kda_decode_step(q[0], k[0], v[0], g[0], beta[0], np.zeros((2, 8, 8)))  # float64 state
    state, pk, pd = s0.copy(), np.zeros((2, 8), np.float32), np.zeros((2, 8), np.float32)
    with pytest.raises(WasteError, match="pending_d"):
        kd.kda_decode_step_deferred(q[0], k[0], v[0], g[0], beta[0], state, pk, pd[:, :7].copy())
    with pytest.raises(WasteError, match="pending_k"):
        kd.apply_pending(state, pk.astype(np.float64), pd)
