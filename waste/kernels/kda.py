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
# recurrent_kda prepares the normalised q, k, decays and block coefficients of this many
# tokens of one head at once (about 10 x 64 x K floats, in L2); a multiple of 4.
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
    """All T tokens of head h, four at a time (docs/KDA.md, "recurrence in blocks of four").

    With A_m the decay accumulated from the block start through token m and P(r, m] the decay
    between tokens r and m, one read of each state column gives u_m' = S^T (A_m k_m) and
    w_m' = S^T (A_m q_m) for the four tokens; the deltas then follow by scalar corrections,
    u_m = u_m' + sum_{r<m} d_r (k_m . P(r,m] k_r), and one write applies the whole block,
    S = Diag(A_4) S + sum_r (P(r,4] k_r) d_r^T. A tail shorter than four is padded with
    tokens that change nothing (k = q = 0, decay 1, beta 0).
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
    ck = np.empty((NT, K), np.float32)  # A_m k_m
    cq = np.empty((NT, K), np.float32)  # A_m q_m
    ek = np.empty((NT, K), np.float32)  # P(m, 4] k_m
    ablk = np.empty((NT // 4, K), np.float32)  # A_4 per block
    co = np.empty((NT, 8), np.float32)  # per token: beta, q.k, then k_m.P k_r (3), q_m.P k_r (3)
    vt = np.empty((NT, V), np.float32)
    ot = np.empty((NT, V), np.float32)
    P = np.empty(K, np.float32)
    for t0 in range(0, T, NT):
        nt = min(NT, T - t0)
        nb = (nt + 3) // 4
        for tt in range(nb * 4):
            t = t0 + tt
            if tt < nt:
                co[tt, 0] = beta[t, h]
                co[tt, 1] = normalise_token(q[t, h], k[t, h], scale, l2norm_qk, qs[tt], kn[tt])
                for i in range(K):
                    a[tt, i] = fexp(g[t, h, i])
                for j in range(V):
                    vt[tt, j] = v[t, h, j]
            else:
                co[tt, 0] = 0.0
                co[tt, 1] = 0.0
                for i in range(K):
                    qs[tt, i] = 0.0
                    kn[tt, i] = 0.0
                    a[tt, i] = 1.0
                for j in range(V):
                    vt[tt, j] = 0.0
        for blk in range(nb):
            b0 = 4 * blk
            # A_m k_m and A_m q_m: cumulative decay from the block start
            for i in range(K):
                P[i] = 1.0
            for m in range(4):
                for i in range(K):
                    P[i] *= a[b0 + m, i]
                    ck[b0 + m, i] = P[i] * kn[b0 + m, i]
                    cq[b0 + m, i] = P[i] * qs[b0 + m, i]
            for i in range(K):
                ablk[blk, i] = P[i]
            # P(r, m] for r < m: the pair coefficients, and P(r, 4] k_r for the write
            for r in range(4):
                for i in range(K):
                    P[i] = 1.0
                for m in range(r + 1, 4):
                    sk = np.float32(0.0)
                    sq = np.float32(0.0)
                    for i in range(K):
                        P[i] *= a[b0 + m, i]
                        pk = P[i] * kn[b0 + r, i]
                        sk += kn[b0 + m, i] * pk
                        sq += qs[b0 + m, i] * pk
                    co[b0 + m, 2 + r] = sk
                    co[b0 + m, 5 + r] = sq
                for i in range(K):
                    ek[b0 + r, i] = P[i] * kn[b0 + r, i]
        for blk in range(nb):
            _four_tokens(ST, 4 * blk, ck, cq, ek, ablk[blk], co, vt, ot)
        for tt in range(nt):
            for j in range(V):
                o[t0 + tt, h, j] = ot[tt, j]
    for i in range(K):
        for j in range(V):
            state[h, i, j] = ST[j, i]


@kernel
def _four_tokens(ST, b0, ck, cq, ek, ab, co, vt, ot):
    """The transposed state ST [V, K] through tokens b0..b0+3 of the tile, one value column at a time."""
    V, K = ST.shape
    c1k, c2k, c3k, c4k = ck[b0], ck[b0 + 1], ck[b0 + 2], ck[b0 + 3]
    c1q, c2q, c3q, c4q = cq[b0], cq[b0 + 1], cq[b0 + 2], cq[b0 + 3]
    e1, e2, e3, e4 = ek[b0], ek[b0 + 1], ek[b0 + 2], ek[b0 + 3]
    v1, v2, v3, v4 = vt[b0], vt[b0 + 1], vt[b0 + 2], vt[b0 + 3]
    o1, o2, o3, o4 = ot[b0], ot[b0 + 1], ot[b0 + 2], ot[b0 + 3]
    b1, b2, b3, b4 = co[b0, 0], co[b0 + 1, 0], co[b0 + 2, 0], co[b0 + 3, 0]
    p1, p2, p3, p4 = co[b0, 1], co[b0 + 1, 1], co[b0 + 2, 1], co[b0 + 3, 1]
    k21, k31, k32 = co[b0 + 1, 2], co[b0 + 2, 2], co[b0 + 2, 3]
    k41, k42, k43 = co[b0 + 3, 2], co[b0 + 3, 3], co[b0 + 3, 4]
    l21, l31, l32 = co[b0 + 1, 5], co[b0 + 2, 5], co[b0 + 2, 6]
    l41, l42, l43 = co[b0 + 3, 5], co[b0 + 3, 6], co[b0 + 3, 7]
    for j in range(V):
        s = ST[j]
        u1 = np.float32(0.0)
        u2 = np.float32(0.0)
        u3 = np.float32(0.0)
        u4 = np.float32(0.0)
        w1 = np.float32(0.0)
        w2 = np.float32(0.0)
        w3 = np.float32(0.0)
        w4 = np.float32(0.0)
        for i in range(K):
            x = s[i]
            u1 += c1k[i] * x
            w1 += c1q[i] * x
            u2 += c2k[i] * x
            w2 += c2q[i] * x
            u3 += c3k[i] * x
            w3 += c3q[i] * x
            u4 += c4k[i] * x
            w4 += c4q[i] * x
        d1 = b1 * (v1[j] - u1)
        o1[j] = w1 + p1 * d1
        d2 = b2 * (v2[j] - (u2 + k21 * d1))
        o2[j] = w2 + l21 * d1 + p2 * d2
        d3 = b3 * (v3[j] - (u3 + k31 * d1 + k32 * d2))
        o3[j] = w3 + l31 * d1 + l32 * d2 + p3 * d3
        d4 = b4 * (v4[j] - (u4 + k41 * d1 + k42 * d2 + k43 * d3))
        o4[j] = w4 + l41 * d1 + l42 * d2 + l43 * d3 + p4 * d4
        for i in range(K):
            s[i] = ab[i] * s[i] + e1[i] * d1 + e2[i] * d2 + e3[i] * d3 + e4[i] * d4


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

