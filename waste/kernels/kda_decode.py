"""KDA decode: one token through each head's recurrent state (semantics in waste.kernels.kda).

The decode step folds the decay into the vectors, S'^T x = S^T (exp(g) x), so per head one
read-only pass over the state gives u = S^T (a k) and w = S^T (a q), and one read-write pass
applies S = Diag(a) S + k d^T with d = beta (v - u); then o = w + (q . k) d.
The engine decodes with `kda_decode_step_deferred` instead: it keeps the state as
base + k d^T with the last rank-1 update pending, so one read-write pass per token both
applies the previous update and accumulates u and w (1.4x faster when the state is out of
L2; docs/KDA.md).

Shapes: q, k, g [H, K]; v [H, V]; beta [H]; state [H, K, V] float32, row-major by K;
pending vectors [H, K] and [H, V].
"""

from __future__ import annotations

import numpy as np

from waste.errors import WasteError
from waste.jit import kernel, parallel_kernel, prange
from waste.kernels.fastmath import fexp
from waste.kernels.kda import kda_scale, normalise_token


@kernel
def _decode_coefficients(q, k, g, h, scale, l2norm_qk):
    """Head h of one token: (a = exp(g), kn, a kn, a qs, qs . kn) with qs, kn the normalised q, k."""
    K = q.shape[1]
    qs = np.empty(K, np.float32)
    kn = np.empty(K, np.float32)
    a = np.empty(K, np.float32)
    ak = np.empty(K, np.float32)
    aq = np.empty(K, np.float32)
    qk = normalise_token(q[h], k[h], scale, l2norm_qk, qs, kn)
    for i in range(K):
        a[i] = fexp(g[h, i])
        ak[i] = a[i] * kn[i]
        aq[i] = a[i] * qs[i]
    return a, kn, ak, aq, qk


@parallel_kernel
def _decode_kernel(q, k, v, g, beta, scale, l2norm_qk, state, o):
    H, K = q.shape
    V = v.shape[1]
    for h in prange(H):
        u = np.zeros(V, np.float32)
        w = np.zeros(V, np.float32)
        a, kn, ak, aq, qk = _decode_coefficients(q, k, g, h, scale, l2norm_qk)
        b = beta[h]
        S = state[h]
        for i in range(K):
            aki = ak[i]
            aqi = aq[i]
            for j in range(V):
                s = S[i, j]
                u[j] += aki * s
                w[j] += aqi * s
        for j in range(V):
            d = b * (v[h, j] - u[j])
            o[h, j] = w[j] + qk * d
            u[j] = d
        for i in range(K):
            ai = a[i]
            ki = kn[i]
            for j in range(V):
                S[i, j] = ai * S[i, j] + ki * u[j]


def _decode_inputs(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                   beta: np.ndarray) -> tuple[np.ndarray, ...]:
    """One token's q, k, g [H, K], v [H, V], beta [H] as contiguous float32, shapes checked."""
    q, k, g, v = (np.ascontiguousarray(x, np.float32) for x in (q, k, g, v))
    beta = np.ascontiguousarray(beta, np.float32).reshape(-1)
    H, K = q.shape
    if k.shape != (H, K) or g.shape != (H, K) or v.shape != (H, v.shape[-1]) or beta.shape != (H,):
        raise WasteError(f"decode step shapes disagree: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, "
                         f"beta {beta.shape}")
    return q, k, v, g, beta


def _check_float32(name: str, a: np.ndarray, shape: tuple[int, ...]) -> None:
    if a.dtype != np.float32 or a.shape != shape or not a.flags.c_contiguous:
        raise WasteError(f"{name} must be contiguous float32 {list(shape)}, got {a.dtype} {list(a.shape)}")


def kda_decode_step(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                    state: np.ndarray, *, scale: float | None = None, l2norm_qk: bool = True) -> np.ndarray:
    """One token: q, k, g [H, K], v [H, V], beta [H]; updates state [H, K, V] in place; returns o [H, V]."""
    q, k, v, g, beta = _decode_inputs(q, k, v, g, beta)
    (H, K), V = q.shape, v.shape[1]
    _check_float32("state", state, (H, K, V))
    o = np.empty((H, V), np.float32)
    _decode_kernel(q, k, v, g, beta, kda_scale(scale, K), bool(l2norm_qk), state, o)
    return o


def kda_decode_step_deferred(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                             base: np.ndarray, pending_k: np.ndarray, pending_d: np.ndarray, *,
                             scale: float | None = None, l2norm_qk: bool = True) -> np.ndarray:
    """One token in one pass over the state, with its rank-1 update left pending; returns o [H, V].

    The true state is base + pending_k pending_d^T (per head, [H, K, V] + [H, K] x [H, V]);
    the step keeps that true, applying the previous token's pending update inside its single
    pass and leaving its own (k, d) pending. Zero pending vectors start from `base` itself;
    `apply_pending` folds the update in. Same arithmetic as `kda_decode_step` up to rounding.
    """
    q, k, v, g, beta = _decode_inputs(q, k, v, g, beta)
    (H, K), V = q.shape, v.shape[1]
    _check_float32("state", base, (H, K, V))
    _check_float32("pending_k", pending_k, (H, K))
    _check_float32("pending_d", pending_d, (H, V))
    o = np.empty((H, V), np.float32)
    _deferred_decode_kernel(q, k, v, g, beta, kda_scale(scale, K), bool(l2norm_qk), base, pending_k, pending_d, o)
    return o


def apply_pending(base: np.ndarray, pending_k: np.ndarray, pending_d: np.ndarray) -> None:
    """base += pending_k pending_d^T per head, then zero the pending vectors (all in place).

    Rounds exactly as the next deferred step would (the same fused multiply-add), so applying
    the update early, e.g. to read the state, never changes the bits of later steps.
    """
    if np.ndim(base) != 3:
        raise WasteError(f"state must be [H, K, V], got shape {list(np.shape(base))}")
    H, K, V = base.shape
    _check_float32("state", base, (H, K, V))
    _check_float32("pending_k", pending_k, (H, K))
    _check_float32("pending_d", pending_d, (H, V))
    _apply_pending_kernel(base, pending_k, pending_d)


@parallel_kernel
def _apply_pending_kernel(base, pending_k, pending_d):
    H, K, V = base.shape
    for h in prange(H):
        for i in range(K):
            Bi = base[h, i]
            pki = pending_k[h, i]
            for j in range(V):
                Bi[j] = Bi[j] + pki * pending_d[h, j]
            pending_k[h, i] = 0.0
        for j in range(V):
            pending_d[h, j] = 0.0


@parallel_kernel
def _deferred_decode_kernel(q, k, v, g, beta, scale, l2norm_qk, base, pending_k, pending_d, o):
    H, K = q.shape
    V = v.shape[1]
    for h in prange(H):
        u = np.zeros(V, np.float32)
        w = np.zeros(V, np.float32)
        a, kn, ak, aq, qk = _decode_coefficients(q, k, g, h, scale, l2norm_qk)
        P = base[h]
        pk = pending_k[h]
        pd = pending_d[h]
        # Rows four at a time: each load and store of u, w and pd serves four state rows.
        # (A bound precomputed as K - K % 4 made LLVM's loop twice as slow.)
        for i in range(0, K - 3, 4):
            a0, a1, a2, a3 = a[i], a[i + 1], a[i + 2], a[i + 3]
            k0, k1, k2, k3 = ak[i], ak[i + 1], ak[i + 2], ak[i + 3]
            q0, q1, q2, q3 = aq[i], aq[i + 1], aq[i + 2], aq[i + 3]
            p0, p1, p2, p3 = pk[i], pk[i + 1], pk[i + 2], pk[i + 3]
            P0, P1, P2, P3 = P[i], P[i + 1], P[i + 2], P[i + 3]
            for j in range(V):
                d = pd[j]
                s0 = P0[j] + p0 * d
                s1 = P1[j] + p1 * d
                s2 = P2[j] + p2 * d
                s3 = P3[j] + p3 * d
                u[j] += (k0 * s0 + k1 * s1) + (k2 * s2 + k3 * s3)
                w[j] += (q0 * s0 + q1 * s1) + (q2 * s2 + q3 * s3)
                P0[j] = a0 * s0
                P1[j] = a1 * s1
                P2[j] = a2 * s2
                P3[j] = a3 * s3
        for i in range(K - K % 4, K):
            Pi = P[i]
            for j in range(V):
                s0 = Pi[j] + pk[i] * pd[j]
                u[j] += ak[i] * s0
                w[j] += aq[i] * s0
                Pi[j] = a[i] * s0
        b = beta[h]
        for j in range(V):
            d = b * (v[h, j] - u[j])
            o[h, j] = w[j] + qk * d
            pd[j] = d
        for i in range(K):
            pk[i] = kn[i]
