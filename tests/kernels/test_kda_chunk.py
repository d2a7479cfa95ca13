"""Chunked KDA prefill against the recurrence and the float64 oracle, including strong decays.

Tolerances as in test_kda.py: 1e-6 max |diff| for O(1) outputs and states (float32 products
over K and over a chunk of <= 64 tokens). Strong decays: 1e-5 as the issue sets; the decay
factors there are exponents of up to -5 x 64 and are formed from float64 differences.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import max_abs_diff

from waste.errors import WasteError
from waste.kernels.kda import kda_gate_lower_bound, kda_gate_softplus, recurrent_kda
from waste.kernels.kda_chunk import _chunk_kernel, chunk_kda
from waste.kernels.kda_decode import kda_decode_step
from waste.reference.kda import naive_recurrent_kda
from waste.testing import kda_inputs

ATOL = 1e-6



@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_chunk_equals_recurrent(T: int, chunk: int) -> None:
    rng = np.random.default_rng(T * 7 + chunk)
    q, k, v, g, beta, s0 = kda_inputs(rng, T, 3, 32, 24)
    o_r, s_r = recurrent_kda(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = chunk_kda(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    assert max_abs_diff(o_c, o_r) <= ATOL and max_abs_diff(s_c, s_r) <= ATOL


def test_chunk_real_shape_against_reference(record_property) -> None:
    rng = np.random.default_rng(21)
    q, k, v, g, beta, s0 = kda_inputs(rng, 64, 32, 128, 128)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=s0)
    err_o, err_s = max_abs_diff(o, o_ref), max_abs_diff(s, s_ref)
    record_property("chunk_max_diff", (err_o, err_s))
    assert err_o <= ATOL and err_s <= ATOL, (err_o, err_s)


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("variant", ["lower_bound", "softplus"])
def test_chunk_strong_decays(variant: str, chunk: int) -> None:
    rng = np.random.default_rng(22)
    T, H, Kd = 256, 2, 32
    z = (3 * rng.standard_normal((T, H * Kd))).astype(np.float32)
    bias = np.zeros(H * Kd, np.float32)
    if variant == "lower_bound":
        # most channels at the -5 floor, a few open: the mix that overflows exp(+-G) factoring
        g = kda_gate_lower_bound(z + 6, np.zeros(H, np.float32), bias, -5.0)
    else:
        g = kda_gate_softplus(z, np.full(H, 5.0, np.float32), bias)  # exp(A_log) = 148, no floor
    q, k, v, g, beta, s0 = kda_inputs(rng, T, H, Kd, Kd, g)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    assert max_abs_diff(o, o_ref) <= 1e-5 and max_abs_diff(s, s_ref) <= 1e-5


def test_prefill_then_decode_equals_one_pass() -> None:
    rng = np.random.default_rng(23)
    T1, T2 = 70, 5
    q, k, v, g, beta, s0 = kda_inputs(rng, T1 + T2, 2, 16, 16)
    o_all, s_all = recurrent_kda(q, k, v, g, beta, initial_state=s0)
    o1, state = chunk_kda(q[:T1], k[:T1], v[:T1], g[:T1], beta[:T1], initial_state=s0)
    o2 = [kda_decode_step(q[t], k[t], v[t], g[t], beta[t], state) for t in range(T1, T1 + T2)]
    o = np.concatenate([o1, np.stack(o2)])
    assert max_abs_diff(o, o_all) <= ATOL and max_abs_diff(state, s_all) <= ATOL


@pytest.mark.parametrize("path", ["recurrent", "chunk", "decode"])
def test_small_q_and_k_meet_the_l2_norms_epsilon(path: str) -> None:
    """q and k whose squared norms (~1e-6) are of the order of the L2 normalisation's epsilon:
    there the epsilon shapes the result, and every path must add it where the reference does."""
    rng = np.random.default_rng(31)
    T, H, K, V = 70, 2, 16, 12
    q, k, v, g, beta, s0 = kda_inputs(rng, T, H, K, V)
    q, k = (2.5e-4 * q).astype(np.float32), (2.5e-4 * k).astype(np.float32)
    assert 1e-7 < float(np.median(np.sum(q.astype(np.float64) ** 2, axis=-1))) < 1e-5
    if path == "recurrent":
        o, s = recurrent_kda(q, k, v, g, beta, initial_state=s0)
    elif path == "chunk":
        o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    else:
        s = s0.copy()
        o = np.stack([kda_decode_step(q[t], k[t], v[t], g[t], beta[t], s) for t in range(T)])
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    assert max_abs_diff(o, o_ref) <= ATOL and max_abs_diff(s, s_ref) <= ATOL


def test_chunk_kernel_writes_every_output() -> None:
    rng = np.random.default_rng(24)
    T, H, Kd, V = 37, 2, 16, 11
    q, k, v, g, beta, s0 = kda_inputs(rng, T, H, Kd, V)
    o = np.full((T, H, V), np.nan, np.float32)
    state = s0.copy()
    _chunk_kernel(q, k, v, g, beta, Kd**-0.5, True, 16, state, o)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    assert max_abs_diff(o, o_ref) <= ATOL and max_abs_diff(state, s_ref) <= ATOL


def test_chunk_options_and_errors() -> None:
    rng = np.random.default_rng(25)
    q, k, v, g, beta, s0 = kda_inputs(rng, 20, 2, 8, 8)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, scale=0.25)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, scale=0.25, chunk_size=7)
    assert max_abs_diff(o, o_ref) <= ATOL and max_abs_diff(s, s_ref) <= ATOL
    with pytest.raises(WasteError):
        chunk_kda(q, k, v, g, beta, chunk_size=0)
