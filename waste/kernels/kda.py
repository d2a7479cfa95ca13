"""Kimi Delta Attention (KDA) kernels: gates, gated RMSNorm, recurrence.

The short convolution in front of q, k and v is in `waste.kernels.short_conv`, the decode
step in `waste.kernels.kda_decode`, the chunked form and `prefill_kda` in
`waste.kernels.kda_chunk`, the float32 exp / sigmoid / softplus in `waste.kernels.fastmath`.

Semantics (FACTS.md): per token and head, with q, k L2-normalised (eps 1e-6 inside the
root) and q scaled by K^-0.5 after the norm,

    S' = Diag(exp(g_t)) S;   S = S' + beta_t k_t (v_t - S'^T k_t)^T;   o_t = S^T q_t

`recurrent_kda` runs each head through the sequence on a transposed [V, K] copy of its state,
four tokens per pass over it (`_recurrent_head`; docs/KDA.md has the algebra and the timings).

Shapes: q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; state [H, K, V] float32, row-major by K.
All kernels are written as explicit loops with contiguous innermost loops so LLVM emits
packed SIMD; `fexp` is a vectorisable float32 exp (Numba's math.exp is a scalar libm call).
"""

from __future__ import annotations

import numpy as np

from waste.errors import WasteError
from waste.jit import kernel, parallel_kernel, prange
from waste.kernels.fastmath import fexp, fsigmoid, fsoftplus

L2_EPS = 1e-6
# recurrent_kda prepares the normalised q, k and decays of this many tokens of one head at once
# (about 6 x 64 x K floats, in L2).
SEQ_TILE_T = 64


# ---------------------------------------------------------------------------------------------
# gates


def a_log_per_head(A_log: np.ndarray, num_heads: int) -> np.ndarray:
    """A_log as [H] float32 from [1, 1, H, 1], [H], or [K] zero-padded past H."""
    a = np.asarray(A_log, np.float32).reshape(-1)
    if a.size == num_heads:
        return np.ascontiguousarray(a)
    if a.size > num_heads and not np.any(a[num_heads:]):
        return np.ascontiguousarray(a[:num_heads])
    raise WasteError(f"A_log of shape {np.shape(A_log)} does not hold one value per head for {num_heads} heads")


def _gate_inputs(z, A_log, dt_bias, num_heads):
    z = np.asarray(z, np.float32)
    if z.ndim == 3:
        T, H, K = z.shape
    elif z.ndim == 2:
        T, HK = z.shape
        H = num_heads if num_heads is not None else _infer_heads(A_log, HK)
        if HK % H:
            raise WasteError(f"gate input width {HK} is not a multiple of {H} heads")
        K = HK // H
    else:
        raise WasteError(f"gate input must be [T, H*K] or [T, H, K], got shape {z.shape}")
    bias = np.asarray(dt_bias, np.float32).reshape(-1)
    if bias.size != H * K:
        raise WasteError(f"dt_bias has {bias.size} values, expected H*K = {H * K}")
    zc = np.ascontiguousarray(z.reshape(T, H, K))
    return zc, np.exp(a_log_per_head(A_log, H).astype(np.float64)).astype(np.float32), bias.reshape(H, K)


def _infer_heads(A_log: np.ndarray, hk: int) -> int:
    a = np.asarray(A_log).reshape(-1)
    n = a.size
    if n == 0:
        raise WasteError("A_log is empty")
    # A [K] vector whose tail is exactly zero is the zero-padded K3 form: H = H*K / K.
    h_padded = hk // n
    if hk % n == 0 and h_padded < n and not np.any(a[h_padded:]):
        return h_padded
    return n


# Entering Numba's thread pool costs microseconds, more than the elementwise work of one
# decoded token; up to this many elements these kernels run on the calling thread.
SERIAL_ELEMENTS = 4096


@kernel
def _gate_token(z, a, bias, lower_bound, out, t):
    H, K = z.shape[1], z.shape[2]
    for h in range(H):
        ah = a[h]
        for i in range(K):
            x = z[t, h, i] + bias[h, i]
            if lower_bound < 0:
                out[t, h, i] = np.float32(lower_bound) * fsigmoid(ah * x)
            else:
                out[t, h, i] = -ah * fsoftplus(x)


@parallel_kernel
def _gate_kernel(z, a, bias, lower_bound, out):
    if z.size <= SERIAL_ELEMENTS:
        for t in range(z.shape[0]):
            _gate_token(z, a, bias, lower_bound, out, t)
    else:
        for t in prange(z.shape[0]):
            _gate_token(z, a, bias, lower_bound, out, t)


def kda_gate_softplus(z: np.ndarray, A_log: np.ndarray, dt_bias: np.ndarray, *,
                      num_heads: int | None = None) -> np.ndarray:
    """Kimi-Linear decay g = -exp(A_log[h]) * softplus(z + dt_bias): z [T, H*K] or [T, H, K] -> [T, H, K].

    H comes from z [T, H, K], else `num_heads`, else A_log (a [K] vector zero-padded past H counts as H).
    """
    zc, a, bias = _gate_inputs(z, A_log, dt_bias, num_heads)
    out = np.empty(zc.shape, np.float32)
    _gate_kernel(zc, a, bias, 0.0, out)
    return out


def kda_gate_lower_bound(z: np.ndarray, A_log: np.ndarray, dt_bias: np.ndarray, lower_bound: float, *,
                         num_heads: int | None = None) -> np.ndarray:
    """K3 decay g = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias)) -> [T, H, K] (lower_bound < 0)."""
    if not lower_bound < 0:
        raise WasteError(f"gate lower bound must be negative, got {lower_bound}")
    zc, a, bias = _gate_inputs(z, A_log, dt_bias, num_heads)
    out = np.empty(zc.shape, np.float32)
    _gate_kernel(zc, a, bias, float(lower_bound), out)
    return out


# ---------------------------------------------------------------------------------------------
# gated RMSNorm


@kernel
def _gated_rmsnorm_row(o, gate, weight, eps, out, n):
    V = o.shape[1]
    ss = np.float32(0.0)
    for j in range(V):
        ss += o[n, j] * o[n, j]
    r = np.float32(1.0) / np.sqrt(ss / np.float32(V) + np.float32(eps))
    for j in range(V):
        out[n, j] = o[n, j] * r * weight[j] * fsigmoid(gate[n, j])


@parallel_kernel
def _gated_rmsnorm_kernel(o, gate, weight, eps, out):
    if o.size <= SERIAL_ELEMENTS:
        for n in range(o.shape[0]):
            _gated_rmsnorm_row(o, gate, weight, eps, out, n)
    else:
        for n in prange(o.shape[0]):
            _gated_rmsnorm_row(o, gate, weight, eps, out, n)


def gated_rmsnorm(o: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Per-head RMSNorm of o [..., V] times weight [V] times sigmoid(gate); gate has o's size."""
    o = np.asarray(o, np.float32)
    V = o.shape[-1]
    o2 = np.ascontiguousarray(o.reshape(-1, V))
    g2 = np.ascontiguousarray(np.asarray(gate, np.float32).reshape(o2.shape))
    w = np.ascontiguousarray(weight, np.float32).reshape(-1)
    if w.size != V:
        raise WasteError(f"o_norm weight has {w.size} values, expected {V}")
    out = np.empty_like(o2)
    _gated_rmsnorm_kernel(o2, g2, w, float(eps), out)
    return out.reshape(o.shape)


# ---------------------------------------------------------------------------------------------
# recurrence


@kernel
def normalise_token(q, k, scale, l2norm_qk, qs, kn):
    """One head's q, k [K] -> qs = q scale / |q|, kn = k / |k| (eps inside the roots); returns qs . kn."""
    K = q.shape[0]
    rq = np.float32(scale)
    rk = np.float32(1.0)
    if l2norm_qk:
        sq = np.float32(0.0)
        sk = np.float32(0.0)
        for i in range(K):
            sq += q[i] * q[i]
            sk += k[i] * k[i]
        rq = rq / np.sqrt(sq + np.float32(L2_EPS))
        rk = np.float32(1.0) / np.sqrt(sk + np.float32(L2_EPS))
    qk = np.float32(0.0)
    for i in range(K):
        qs[i] = q[i] * rq
        kn[i] = k[i] * rk
        qk += qs[i] * kn[i]
    return qk


def kda_scale(scale: float | None, K: int) -> float:
    """The query scale: K**-0.5 unless given."""
    return K**-0.5 if scale is None else float(scale)


@parallel_kernel
def _recurrent_kernel(q, k, v, g, beta, scale, l2norm_qk, state, o):
    for h in prange(q.shape[1]):
        # int64 head index: prange's own index type would compile a second copy of the body
        _recurrent_head(q, k, v, g, beta, scale, l2norm_qk, state, o, np.int64(h))


@kernel
def _recurrent_head(q, k, v, g, beta, scale, l2norm_qk, state, o, h):
    """All T tokens of head h, one state pass per token (docs/KDA.md, "recurrence over a sequence").

    Each token reads and updates the state on its own, so a token's arithmetic does not depend
    on where the call began: prefill cut anywhere gives the same bits (issue 13). (Blocks of
    four tokens per state pass, as before, rounded a block differently from four single tokens,
    so a prompt cut into other chunks drifted by an ulp.)
    """
    T, H, K = q.shape
    V = v.shape[2]
    # The head's state transposed to [V, K]: each value column is an independent recurrence
    # whose reads are dot products over contiguous K (vector accumulators stay in registers).
    ST = np.empty((V, K), np.float32)
    for i in range(K):
        for j in range(V):
            ST[j, i] = state[h, i, j]
    NT = SEQ_TILE_T
    qs = np.empty((NT, K), np.float32)  # normalised, scaled q
    kn = np.empty((NT, K), np.float32)  # normalised k
    a = np.empty((NT, K), np.float32)  # exp(g)
    ck = np.empty((NT, K), np.float32)  # a k
    cq = np.empty((NT, K), np.float32)  # a q
    co = np.empty((NT, 2), np.float32)  # per token: beta, q.k
    vt = np.empty((NT, V), np.float32)
    ot = np.empty((NT, V), np.float32)
    for t0 in range(0, T, NT):
        nt = min(NT, T - t0)
        for tt in range(nt):
            t = t0 + tt
            co[tt, 0] = beta[t, h]
            co[tt, 1] = normalise_token(q[t, h], k[t, h], scale, l2norm_qk, qs[tt], kn[tt])
            for i in range(K):
                a[tt, i] = fexp(g[t, h, i])
                ck[tt, i] = a[tt, i] * kn[tt, i]
                cq[tt, i] = a[tt, i] * qs[tt, i]
            for j in range(V):
                vt[tt, j] = v[t, h, j]
        for tt in range(nt):
            _one_token(ST, ck[tt], cq[tt], kn[tt], a[tt], co[tt, 0], co[tt, 1], vt[tt], ot[tt])
        for tt in range(nt):
            for j in range(V):
                o[t0 + tt, h, j] = ot[tt, j]
    for i in range(K):
        for j in range(V):
            state[h, i, j] = ST[j, i]


@kernel
def _one_token(ST, ck, cq, kn, a, b, p, v, o):
    """The transposed state ST [V, K] through one token, one value column at a time:
    u = S^T (a k), d = beta (v - u), o = S^T (a q) + (q . k) d, S = Diag(a) S + k d^T."""
    V, K = ST.shape
    for j in range(V):
        s = ST[j]
        u = np.float32(0.0)
        w = np.float32(0.0)
        for i in range(K):
            x = s[i]
            u += ck[i] * x
            w += cq[i] * x
        d = b * (v[j] - u)
        o[j] = w + p * d
        for i in range(K):
            s[i] = a[i] * s[i] + kn[i] * d


def check_kda_inputs(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                     initial_state: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """Coerce to contiguous float32 and check shapes; returns (q, k, v, g, beta, state copy [H, K, V])."""
    q, k, v, g, beta = (np.ascontiguousarray(x, np.float32) for x in (q, k, v, g, beta))
    if q.ndim != 3:
        raise WasteError(f"q must be [T, H, K], got shape {q.shape}")
    T, H, K = q.shape
    if v.ndim != 3 or v.shape[:2] != (T, H):
        raise WasteError(f"v must be [T={T}, H={H}, V], got shape {v.shape}")
    V = v.shape[2]
    if k.shape != q.shape or g.shape != q.shape or beta.shape != (T, H):
        raise WasteError(f"KDA shapes disagree: q {q.shape}, k {k.shape}, g {g.shape}, beta {beta.shape}")
    if initial_state is None:
        state = np.zeros((H, K, V), np.float32)
    else:
        if np.shape(initial_state) != (H, K, V):
            raise WasteError(f"initial_state must be [{H}, {K}, {V}], got {np.shape(initial_state)}")
        state = np.array(initial_state, np.float32, order="C")
    return q, k, v, g, beta, state


def recurrent_kda(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, *,
                  scale: float | None = None, initial_state: np.ndarray | None = None,
                  l2norm_qk: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Token-by-token KDA over a sequence, heads in parallel: (o [T, H, V], final state [H, K, V])."""
    q, k, v, g, beta, state = check_kda_inputs(q, k, v, g, beta, initial_state)
    o = np.empty(v.shape, np.float32)
    _recurrent_kernel(q, k, v, g, beta, kda_scale(scale, q.shape[2]), bool(l2norm_qk), state, o)
    return o, state

