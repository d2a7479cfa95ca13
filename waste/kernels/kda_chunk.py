"""Chunked KDA prefill: intra-chunk work as small matrix products, the state carried across chunks.

Per chunk of C tokens, with state S0 and G the cumulative log decay from the chunk start
(inclusive), the recurrence of `waste.kernels.kda` is exactly (docs/KDA.md):

    A[i, j] = beta_i sum_d k_id k_jd exp(G_id - G_jd)  (j < i)     T = (I + A)^-1
    U = T diag(beta) V,  W = T diag(beta) (k exp(G)),  D = U - W S0
    M[i, j] = sum_d q_id k_jd exp(G_id - G_jd)  (j <= i)
    O = (q exp(G)) S0 + M D,    S = Diag(exp(G_last)) S0 + (k exp(G_last - G))^T D

Overflow: G falls without bound inside a chunk (64 steps at the K3 floor reach -320), so
exp(G_i - G_j) is never factored as exp(G_i) exp(-G_j). The chunk is split into sub-chunks
of 16. Between sub-chunks every factor is a decay over a stretch of time, so it is <= 1:
exp(G_i - G_j) = exp(G_i - G_p) * exp(G_p - G_e) * exp(G_e - G_j) with p the position before
the row's sub-chunk and e the last position of the column's sub-chunk. Inside a sub-chunk the
decays are taken relative to its middle token m, exp(G_i - G_m) and its reciprocal, when
every such exponent stays within +-MIDPOINT_EXP_LIMIT; otherwise (an unbounded softplus gate)
that sub-chunk's pairs are formed one by one as exp(G_i - G_j). Exponents come from float64
differences and are split into float32 high and low parts, so large exponents lose nothing.

All products use one "dot form" routine over rows whose reduction axis is contiguous; the
state is kept transposed, [V, K], for the whole sequence.
"""

from __future__ import annotations

import numpy as np

from waste.errors import WasteError
from waste.jit import kernel, parallel_kernel, prange
from waste.kernels.fastmath import fexp
from waste.kernels.kda import L2_EPS, check_kda_inputs, kda_scale, recurrent_kda

# The recurrence is faster than the chunked form at every length measured on this AVX-512
# machine (T = 16 .. 4096, H = 32: 1.4-2x, bench/kda.py, docs/KDA.md), so prefill_kda never
# switches to chunk_kda; a token count here would make it switch from that length on.
CHUNK_PREFILL_MIN_TOKENS: int | None = None
CHUNK_SIZE = 64
SUB_CHUNK = 16
# Midpoint factors up to e^60 and their reciprocals down to e^-60 stay well inside float32's
# normal range (1.2e-38 .. 3.4e38); the K3 floor of -5 per step needs at most e^40 here.
MIDPOINT_EXP_LIMIT = 60.0


@kernel
def _exp_sub(x, y, out, hi, lo):
    """out = exp(x - y) for float64 rows x, y [K] -> float32, as e^hi (1 + lo), hi = float32(x - y).

    The float64 and float32 halves run as separate loops so that both vectorise.
    """
    K = out.shape[0]
    for i in range(K):
        d = x[i] - y[i]
        h = np.float32(d)
        hi[i] = h
        lo[i] = np.float32(d - np.float64(h))
    for i in range(K):
        out[i] = fexp(hi[i]) * (np.float32(1.0) + lo[i])


@kernel
def _gemm_nt(X, Y, out, na, nb, L, accumulate):
    """out[a, b] (+)= sum_{c < L} X[a, c] Y[b, c] for a < na, b < nb.

    accumulate is 0.0 or 1.0 (a bool constant would be typed as a literal and compile twice).
    Four rows of X share each load of a Y row: the fastest of the 1x1, 2x2, 4x1 tiles and an
    axpy form tried (26 GMAC/s at L = 128 on one core). Triangular X is multiplied whole:
    stopping each row at the diagonal made the loops short and the kernel 40% slower.
    """
    a = 0
    while a + 3 < na:
        x0, x1, x2, x3 = X[a], X[a + 1], X[a + 2], X[a + 3]
        o0, o1, o2, o3 = out[a], out[a + 1], out[a + 2], out[a + 3]
        for b in range(nb):
            y = Y[b]
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            s2 = np.float32(0.0)
            s3 = np.float32(0.0)
            for c in range(L):
                yc = y[c]
                s0 += x0[c] * yc
                s1 += x1[c] * yc
                s2 += x2[c] * yc
                s3 += x3[c] * yc
            if accumulate != 0.0:
                o0[b] += s0
                o1[b] += s1
                o2[b] += s2
                o3[b] += s3
            else:
                o0[b] = s0
                o1[b] = s1
                o2[b] = s2
                o3[b] = s3
        a += 4
    while a < na:
        x0 = X[a]
        o0 = out[a]
        for b in range(nb):
            y = Y[b]
            s0 = np.float32(0.0)
            for c in range(L):
                s0 += x0[c] * y[c]
            o0[b] = o0[b] + s0 if accumulate != 0.0 else s0
        a += 1


@parallel_kernel
def _chunk_kernel(q, k, v, g, beta, scale, l2norm_qk, C, state, o):
    for h in prange(q.shape[1]):
        # int64 head index: prange's own index type would compile a second copy of the body
        _chunk_head(q, k, v, g, beta, scale, l2norm_qk, C, state, o, np.int64(h))


@kernel
def _chunk_head(q, k, v, g, beta, scale, l2norm_qk, C, state, o, h):
    T, H, K = q.shape
    V = v.shape[2]
    BC = min(SUB_CHUNK, C)
    ST = np.empty((V, K), np.float32)  # state transposed
    for i in range(K):
        for j in range(V):
            ST[j, i] = state[h, i, j]
    G = np.empty((C, K), np.float64)  # cumulative log decay from the chunk start
    qs = np.empty((C, K), np.float32)  # normalised, scaled q
    kn = np.empty((C, K), np.float32)  # normalised k
    kA = np.empty((C, K), np.float32)  # k exp(G - G_p), p = position before the sub-chunk
    qA = np.empty((C, K), np.float32)  # q exp(G - G_p)
    base = np.empty((C, K), np.float32)  # exp(G_e - G), e = last position of the sub-chunk
    kR = np.empty((BC, K), np.float32)  # k exp(G - G_m), m = middle of the sub-chunk
    qR = np.empty((BC, K), np.float32)
    kS = np.empty((BC, K), np.float32)  # k exp(G_m - G)
    B = np.empty((BC, K), np.float32)
    Qt = np.empty((C, K), np.float32)  # q exp(G)
    kgT = np.empty((K, C), np.float32)  # (beta k exp(G))^T
    khT = np.empty((K, C), np.float32)  # (k exp(G_last - G))^T
    vT = np.empty((V, C), np.float32)  # (beta v)^T
    A = np.empty((C, C), np.float32)
    M = np.empty((C, C), np.float32)
    Ti = np.empty((C, C), np.float32)  # (I + A)^-1
    U = np.empty((C, V), np.float32)
    W = np.empty((C, K), np.float32)
    D = np.empty((C, V), np.float32)
    DT = np.empty((V, C), np.float32)
    Ob = np.empty((C, V), np.float32)
    kg = np.empty((C, K), np.float32)  # beta k exp(G)
    kh = np.empty((C, K), np.float32)  # k exp(G_last - G)
    P = np.empty(K, np.float32)
    ep = np.empty(K, np.float32)
    al = np.empty(K, np.float32)
    hi = np.empty(K, np.float32)
    lo = np.empty(K, np.float32)
    Z = np.zeros(K, np.float64)
    for c0 in range(0, T, C):
        n = min(C, T - c0)
        for t in range(n):
            rq = np.float32(scale)
            rk = np.float32(1.0)
            if l2norm_qk:
                sq = np.float32(0.0)
                sk = np.float32(0.0)
                for i in range(K):
                    sq += q[c0 + t, h, i] * q[c0 + t, h, i]
                    sk += k[c0 + t, h, i] * k[c0 + t, h, i]
                rq = rq / np.sqrt(sq + np.float32(L2_EPS))
                rk = np.float32(1.0) / np.sqrt(sk + np.float32(L2_EPS))
            gprev = G[t - 1] if t > 0 else Z
            for i in range(K):
                qs[t, i] = q[c0 + t, h, i] * rq
                kn[t, i] = k[c0 + t, h, i] * rk
                G[t, i] = gprev[i] + np.float64(g[c0 + t, h, i])
        for i in range(n):
            for j in range(n):
                A[i, j] = 0.0
                M[i, j] = 0.0
        for s0 in range(0, n, BC):
            s1 = min(n, s0 + BC)
            last = s1 - 1
            gp = G[s0 - 1] if s0 > 0 else Z
            _exp_sub(gp, Z, ep, hi, lo)
            _exp_sub(G[n - 1], G[last], P, hi, lo)
            for t in range(s0, s1):
                _exp_sub(G[t], gp, al, hi, lo)
                _exp_sub(G[last], G[t], base[t], hi, lo)
                bt = beta[c0 + t, h]
                for i in range(K):
                    kA[t, i] = kn[t, i] * al[i]
                    qA[t, i] = qs[t, i] * al[i]
                    Qt[t, i] = qA[t, i] * ep[i]
                    kg[t, i] = bt * kA[t, i] * ep[i]
                    kh[t, i] = kn[t, i] * base[t, i] * P[i]
            _diagonal_block(G, kn, qs, s0, s1, kR, qR, kS, A, M, al, hi, lo)
            # blocks left of this sub-chunk: exp(G_i - G_j) = [exp(G_i - G_p)] exp(G_p - G_e) [exp(G_e - G_j)]
            for r0 in range(0, s0, BC):
                r1 = r0 + BC
                _exp_sub(G[s0 - 1], G[r1 - 1], P, hi, lo)
                for j in range(r0, r1):
                    for i in range(K):
                        B[j - r0, i] = P[i] * base[j, i] * kn[j, i]
                _gemm_block(kA, qA, s0, s1, B, r0, A, M)
        for i in range(K):
            for t in range(n):
                kgT[i, t] = kg[t, i]
                khT[i, t] = kh[t, i]
        for i in range(n):
            bi = beta[c0 + i, h]
            for j in range(i):
                A[i, j] *= bi
        # (I + A)^-1 by forward substitution, row by row
        for i in range(n):
            for j in range(n):
                Ti[i, j] = 0.0
            Ti[i, i] = 1.0
            for j in range(i):
                aij = A[i, j]
                if aij != 0.0:
                    for c in range(j + 1):
                        Ti[i, c] -= aij * Ti[j, c]
        for t in range(n):
            bt = beta[c0 + t, h]
            for j in range(V):
                vT[j, t] = bt * v[c0 + t, h, j]
        _gemm_nt(Ti, vT, U, n, V, n, 0.0)
        _gemm_nt(Ti, kgT, W, n, K, n, 0.0)
        # D = U - W S0;  O = Qt S0 + M D
        _gemm_nt(W, ST, D, n, V, K, 0.0)
        for t in range(n):
            for j in range(V):
                dv = U[t, j] - D[t, j]
                D[t, j] = dv
                DT[j, t] = dv
        _gemm_nt(Qt, ST, Ob, n, V, K, 0.0)
        _gemm_nt(M, DT, Ob, n, V, n, 1.0)
        for t in range(n):
            for j in range(V):
                o[c0 + t, h, j] = Ob[t, j]
        # S = Diag(exp(G_last)) S0 + (k exp(G_last - G))^T D, transposed
        _exp_sub(G[n - 1], Z, P, hi, lo)
        for j in range(V):
            for i in range(K):
                ST[j, i] *= P[i]
        _gemm_nt(DT, khT, ST, V, K, n, 1.0)
    for i in range(K):
        for j in range(V):
            state[h, i, j] = ST[j, i]


@kernel
def _diagonal_block(G, kn, qs, s0, s1, kR, qR, kS, A, M, r, hi, lo):
    """A[i, j] (j < i) and M[i, j] (j <= i) for i, j inside sub-chunk [s0, s1); r, hi, lo are [K] scratch."""
    K = kn.shape[1]
    m = s0 + (s1 - s0) // 2
    wide = False
    for t in range(s0, s1):
        for i in range(K):
            if abs(G[t, i] - G[m, i]) > MIDPOINT_EXP_LIMIT:
                wide = True
    if not wide:
        for t in range(s0, s1):
            _exp_sub(G[t], G[m], r, hi, lo)
            for i in range(K):
                kR[t - s0, i] = kn[t, i] * r[i]
                qR[t - s0, i] = qs[t, i] * r[i]
                kS[t - s0, i] = kn[t, i] / r[i]
        for a in range(s0, s1):
            for b in range(s0, a + 1):
                sa = np.float32(0.0)
                sm = np.float32(0.0)
                for i in range(K):
                    sa += kR[a - s0, i] * kS[b - s0, i]
                    sm += qR[a - s0, i] * kS[b - s0, i]
                if b < a:
                    A[a, b] = sa
                M[a, b] = sm
    else:
        for a in range(s0, s1):
            for b in range(s0, a + 1):
                _exp_sub(G[a], G[b], r, hi, lo)
                sa = np.float32(0.0)
                sm = np.float32(0.0)
                for i in range(K):
                    e = kn[b, i] * r[i]
                    sa += kn[a, i] * e
                    sm += qs[a, i] * e
                if b < a:
                    A[a, b] = sa
                M[a, b] = sm


@kernel
def _gemm_block(kA, qA, s0, s1, B, r0, A, M):
    """A[s0:s1, r0:r0+BC] = kA[s0:s1] B^T and the same for M with qA."""
    nb = B.shape[0]
    K = B.shape[1]
    for a in range(s0, s1):
        for b in range(nb):
            sa = np.float32(0.0)
            sm = np.float32(0.0)
            for i in range(K):
                sa += kA[a, i] * B[b, i]
                sm += qA[a, i] * B[b, i]
            A[a, r0 + b] = sa
            M[a, r0 + b] = sm


def chunk_kda(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, *,
              scale: float | None = None, initial_state: np.ndarray | None = None,
              l2norm_qk: bool = True, chunk_size: int = CHUNK_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Chunked KDA over a sequence of any length, heads in parallel: (o [T, H, V], final state [H, K, V])."""
    if int(chunk_size) < 1:
        raise WasteError(f"chunk_size must be positive, got {chunk_size}")
    q, k, v, g, beta, state = check_kda_inputs(q, k, v, g, beta, initial_state)
    o = np.empty(v.shape, np.float32)
    C = min(int(chunk_size), max(1, q.shape[0]))
    _chunk_kernel(q, k, v, g, beta, kda_scale(scale, q.shape[2]), bool(l2norm_qk), C, state, o)
    return o, state


def prefill_kda(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, *,
                scale: float | None = None, initial_state: np.ndarray | None = None,
                l2norm_qk: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """KDA over a prompt by whichever of `recurrent_kda` / `chunk_kda` is faster at this length."""
    if CHUNK_PREFILL_MIN_TOKENS is not None and np.shape(q)[0] >= CHUNK_PREFILL_MIN_TOKENS:
        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, l2norm_qk=l2norm_qk)
    return recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, l2norm_qk=l2norm_qk)
