"""KDA decode: one token through each head's recurrent state (semantics in waste.kernels.kda).

The decode step folds the decay into the vectors, S'^T x = S^T (exp(g) x), so per head one
read-only pass over the state gives u = S^T (a k) and w = S^T (a q), and one read-write pass
applies S = Diag(a) S + k d^T with d = beta (v - u); then o = w + (q . k) d.
The engine decodes with `kda_decode_step_deferred` instead: it keeps the state as
base + k d^T with the last rank-1 update pending, so one read-write pass per token both
applies the previous update and accumulates u and w. That pass goes down the state in strips
of STRIP columns, all K rows per strip, with the strip's u, w and d in vector registers
(`_strip_pass`, LLVM vector IR): per state element one load, one store and four vector
operations, no loads or stores of u and w. States from `new_state` start on a 64-byte
boundary, so a strip's row is whole cache lines (docs/KDA.md).

Shapes: q, k, g [H, K]; v [H, V]; beta [H]; state [H, K, V] float32, row-major by K;
pending vectors [H, K] and [H, V].
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from waste.errors import WasteError
from waste.jit import kernel, parallel_kernel, prange
from waste.kernels.fastmath import fexp
from waste.kernels.kda import kda_scale, normalise_token

# Columns per strip of the deferred step: u, w and d of a strip take 12 of AVX2's 16 vector
# registers. 16 columns measured slower, 64 spill (bench/kda.py, docs/KDA.md).
STRIP = 32
STATE_ALIGN = 64  # bytes: a cache line


def new_state(H: int, K: int, V: int) -> np.ndarray:
    """A zero state [H, K, V] float32 whose first element starts a cache line.

    NumPy's large arrays start 16 bytes past a page, so every other 32-byte row load of the
    decode step would straddle two cache lines (10-30% slower, docs/KDA.md).
    """
    nbytes = H * K * V * 4
    buf = np.zeros(nbytes + STATE_ALIGN, np.uint8)
    start = -buf.ctypes.data % STATE_ALIGN
    return buf[start:start + nbytes].view(np.float32).reshape(H, K, V)


@kernel
def _decode_coefficients(q, k, g, h, scale, l2norm_qk, c):
    """Head h of one token into c [5, K]: rows a = exp(g), kn, a kn, a qs, qs, where qs and kn
    are the normalised q and k; returns qs . kn."""
    K = q.shape[1]
    qk = normalise_token(q[h], k[h], scale, l2norm_qk, c[4], c[1])
    for i in range(K):
        a = fexp(g[h, i])
        c[0, i] = a
        c[2, i] = a * c[1, i]
        c[3, i] = a * c[4, i]
    return qk


@parallel_kernel
def _decode_kernel(q, k, v, g, beta, scale, l2norm_qk, state, o):
    H, K = q.shape
    V = v.shape[1]
    # Scratch for all heads in two allocations, not seven per head (about 40 ns each).
    coefficients = np.empty((H, 5, K), np.float32)
    sums = np.zeros((H, 2, V), np.float32)
    for h in prange(H):
        a, kn, ak, aq = coefficients[h, 0], coefficients[h, 1], coefficients[h, 2], coefficients[h, 3]
        qk = _decode_coefficients(q, k, g, h, scale, l2norm_qk, coefficients[h])
        u, w = sums[h, 0], sums[h, 1]
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


_F32 = ir.FloatType()
_STRIP_VEC = ir.VectorType(_F32, STRIP)


@intrinsic
def _strip_pass(typingctx, P, pk, a, ak, aq, pd, u, w, j0):
    """Columns j0 .. j0+STRIP of one head's deferred step, over all K rows of P [K, V]:

        s = P[i] + pk[i] pd,  u = sum_i ak[i] s,  w = sum_i aq[i] s,  P[i] = a[i] s

    with u and w summed in row order from zero by fused multiply-adds (the rounding of the
    scalar loop `_deferred_columns`, which does the columns past the last whole strip)."""
    arrays = (P, pk, a, ak, aq, pd, u, w)
    if not all(isinstance(x, types.Array) and x.dtype == types.float32 and x.layout == "C" for x in arrays):
        return None
    if P.ndim != 2 or any(x.ndim != 1 for x in arrays[1:]):
        return None
    sig = types.void(*arrays, types.intp)

    def codegen(context, builder, signature, args):
        P_, pk_, a_, ak_, aq_, pd_, u_, w_ = (context.make_array(ty)(context, builder, x)
                                              for ty, x in zip(signature.args[:8], args[:8], strict=True))
        j0_ = args[8]
        K, V = cgutils.unpack_tuple(builder, P_.shape)
        fma_type = ir.FunctionType(_STRIP_VEC, [_STRIP_VEC] * 3)
        fma = cgutils.get_or_insert_function(builder.module, fma_type, f"llvm.fma.v{STRIP}f32")

        def strip(arr, index):
            return builder.bitcast(builder.gep(arr.data, [index]), _STRIP_VEC.as_pointer())

        def splat(arr, i):
            x = builder.insert_element(ir.Constant(_STRIP_VEC, ir.Undefined), builder.load(builder.gep(arr.data, [i])),
                                       ir.Constant(ir.IntType(32), 0))
            return builder.shuffle_vector(x, ir.Constant(_STRIP_VEC, ir.Undefined),
                                          ir.Constant(ir.VectorType(ir.IntType(32), STRIP), [0] * STRIP))

        zero = ir.Constant(_STRIP_VEC, [0.0] * STRIP)
        d = builder.load(strip(pd_, j0_), align=4)
        u_acc = cgutils.alloca_once_value(builder, zero)  # entry-block slots: promoted to registers
        w_acc = cgutils.alloca_once_value(builder, zero)
        builder.store(zero, u_acc)
        builder.store(zero, w_acc)
        with cgutils.for_range(builder, K) as loop:
            i = loop.index
            row = strip(P_, builder.add(builder.mul(i, V), j0_))
            s = builder.call(fma, [splat(pk_, i), d, builder.load(row, align=4)])
            builder.store(builder.call(fma, [splat(ak_, i), s, builder.load(u_acc)]), u_acc)
            builder.store(builder.call(fma, [splat(aq_, i), s, builder.load(w_acc)]), w_acc)
            builder.store(builder.fmul(splat(a_, i), s), row, align=4)
        builder.store(builder.load(u_acc), strip(u_, j0_), align=4)
        builder.store(builder.load(w_acc), strip(w_, j0_), align=4)
        return context.get_dummy_value()

    return sig, codegen


@kernel
def _deferred_columns(P, pk, a, ak, aq, pd, u, w, j0):
    """`_strip_pass` for columns j0 .. V-1 (fewer than a strip), same rounding."""
    K, V = P.shape
    for j in range(j0, V):
        u[j] = 0.0
        w[j] = 0.0
    for i in range(K):
        Pi = P[i]
        for j in range(j0, V):
            s = Pi[j] + pk[i] * pd[j]
            u[j] += ak[i] * s
            w[j] += aq[i] * s
            Pi[j] = a[i] * s


@parallel_kernel
def _deferred_decode_kernel(q, k, v, g, beta, scale, l2norm_qk, base, pending_k, pending_d, o):
    H, K = q.shape
    V = v.shape[1]
    coefficients = np.empty((H, 5, K), np.float32)  # scratch in two allocations, not seven per head
    sums = np.empty((H, 2, V), np.float32)
    for h in prange(H):
        a, kn, ak, aq = coefficients[h, 0], coefficients[h, 1], coefficients[h, 2], coefficients[h, 3]
        qk = _decode_coefficients(q, k, g, h, scale, l2norm_qk, coefficients[h])
        u, w = sums[h, 0], sums[h, 1]
        P = base[h]
        pd = pending_d[h]
        for j0 in range(0, V - STRIP + 1, STRIP):
            _strip_pass(P, pending_k[h], a, ak, aq, pd, u, w, j0)
        _deferred_columns(P, pending_k[h], a, ak, aq, pd, u, w, V - V % STRIP)
        b = beta[h]
        for j in range(V):
            d = b * (v[h, j] - u[j])
            o[h, j] = w[j] + qk * d
            pd[j] = d
        for i in range(K):
            pending_k[h, i] = kn[i]
