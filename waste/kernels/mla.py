"""Latent attention (MLA) over the compressed cache: absorbed decode and causal chunk prefill.

The cache holds one row of D = R + P values per token: the normalised KV latent (R =
kv_lora_rank) followed by the shared, unrotated rope part of the key (P = qk_rope_head_dim).
With the key up-projection absorbed into the query, head h's query is one D-vector
`q_abs[h] = [W_UK[h]^T q_nope[h] | q_rope[h]]`, so its score against cached token j is a plain
dot product with the cached row, and its output is the probability-weighted sum of the cached
latents (first R values), mapped to the value space by W_UV[h] outside these kernels.
Nothing here ever expands the cache into per-head keys or values.

Decode is a Numba kernel: blocks of cached rows shared by all heads, scored four heads by two
rows at a time (eight independent sums) and summed two heads by four rows at a time.
Prefill runs each query through the same decode kernel over exactly its causal prefix, so a
query's output depends only on its position and the cache, never on how the prompt was cut
into chunks: prefill is chunk-invariant bit for bit (issue 13), and equals decode. BLAS
products were 1.5x faster at the Kimi-Linear shape, but their results depend on the number of
rows in the call (OpenBLAS picks edge kernels by the row count), which broke bit-exact session
resume on AVX2 machines. The per-head absorption products (W_UK into the query, W_UV out of
the latent) are a Numba kernel for the same reason (`heads_times`).

Shapes: q_abs [H, D] (decode) or [T, H, D] (prefill); latent [capacity, D]; output
[H, R] or [T, H, R]; probs [H, n] with n the number of cached tokens attended.
"""

from __future__ import annotations

import numpy as np

from waste.errors import WasteError
from waste.jit import num_threads, parallel_kernel, prange

# Cached rows per block in the decode kernel (16 rows x 576 values = 36 KiB); measured best of
# 1..64 at H=32, 4096 tokens on the 2-core dev machine.
DECODE_BLOCK = 16


@parallel_kernel
def _decode(q, latent, n, scale, kv_rank, nchunks, block, probs, out):
    H, D = q.shape
    # Token-major in blocks of `block` rows: a block stays in L1/L2 while all H queries are
    # scored against it, so the cache streams through memory once, not once per head.
    # Four heads by two cached rows at a time: eight independent sums (enough to hide the FMA
    # latency) from six loads per eight multiply-adds.
    for b in prange((n + block - 1) // block):
        j0, j1 = b * block, min(b * block + block, n)
        for h in range(0, H - 3, 4):
            q0, q1, q2, q3 = q[h], q[h + 1], q[h + 2], q[h + 3]
            for j in range(j0, j1 - 1, 2):
                la, lb = latent[j], latent[j + 1]
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                a2 = np.float32(0.0)
                a3 = np.float32(0.0)
                b0 = np.float32(0.0)
                b1 = np.float32(0.0)
                b2 = np.float32(0.0)
                b3 = np.float32(0.0)
                for d in range(D):
                    x = la[d]
                    y = lb[d]
                    a0 += q0[d] * x
                    a1 += q1[d] * x
                    a2 += q2[d] * x
                    a3 += q3[d] * x
                    b0 += q0[d] * y
                    b1 += q1[d] * y
                    b2 += q2[d] * y
                    b3 += q3[d] * y
                probs[h, j] = a0 * scale
                probs[h + 1, j] = a1 * scale
                probs[h + 2, j] = a2 * scale
                probs[h + 3, j] = a3 * scale
                probs[h, j + 1] = b0 * scale
                probs[h + 1, j + 1] = b1 * scale
                probs[h + 2, j + 1] = b2 * scale
                probs[h + 3, j + 1] = b3 * scale
            if (j1 - j0) % 2:
                j = j1 - 1
                lj = latent[j]
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                a2 = np.float32(0.0)
                a3 = np.float32(0.0)
                for d in range(D):
                    x = lj[d]
                    a0 += q0[d] * x
                    a1 += q1[d] * x
                    a2 += q2[d] * x
                    a3 += q3[d] * x
                probs[h, j] = a0 * scale
                probs[h + 1, j] = a1 * scale
                probs[h + 2, j] = a2 * scale
                probs[h + 3, j] = a3 * scale
        for h in range(H - H % 4, H):
            for j in range(j0, j1):
                acc = np.float32(0.0)
                for d in range(D):
                    acc += q[h, d] * latent[j, d]
                probs[h, j] = acc * scale
    for h in prange(H):
        m = -np.inf
        for j in range(n):
            m = max(m, probs[h, j])
        total = 0.0
        for j in range(n):
            e = np.exp(probs[h, j] - m)
            probs[h, j] = e
            total += e
        inv = 1.0 / total
        for j in range(n):
            probs[h, j] *= inv
    # Weighted latent sum: one partial [H, R] per token range (reduced afterwards), walked in
    # blocks so each head's accumulator row stays hot across the block's rows.
    partial = np.zeros((nchunks, H, kv_rank), np.float32)
    for c in prange(nchunks):
        j0 = c * n // nchunks
        j1 = (c + 1) * n // nchunks
        for jb in range(j0, j1, block):
            je = min(jb + block, j1)
            # Two heads by four rows at a time: each load of a cached value serves two heads,
            # each load and store of an accumulator four rows.
            for h in range(0, H - 1, 2):
                acc, acd = partial[c, h], partial[c, h + 1]
                ph, pi = probs[h], probs[h + 1]
                for j in range(jb, je - 3, 4):
                    p0, p1, p2, p3 = ph[j], ph[j + 1], ph[j + 2], ph[j + 3]
                    s0, s1, s2, s3 = pi[j], pi[j + 1], pi[j + 2], pi[j + 3]
                    L0, L1, L2, L3 = latent[j], latent[j + 1], latent[j + 2], latent[j + 3]
                    for r in range(kv_rank):
                        x0, x1, x2, x3 = L0[r], L1[r], L2[r], L3[r]
                        acc[r] += (p0 * x0 + p1 * x1) + (p2 * x2 + p3 * x3)
                        acd[r] += (s0 * x0 + s1 * x1) + (s2 * x2 + s3 * x3)
                for j in range(je - (je - jb) % 4, je):
                    for r in range(kv_rank):
                        acc[r] += ph[j] * latent[j, r]
                        acd[r] += pi[j] * latent[j, r]
            if H % 2:
                acc = partial[c, H - 1]
                ph = probs[H - 1]
                for j in range(jb, je):
                    for r in range(kv_rank):
                        acc[r] += ph[j] * latent[j, r]
    for h in prange(H):
        for r in range(kv_rank):
            acc = np.float32(0.0)
            for c in range(nchunks):
                acc += partial[c, h, r]
            out[h, r] = acc


@parallel_kernel
def _heads_times(x, w, y):
    """y[t, h] = x[t, h] @ w[h] for x [T, H, A], w [H, A, B] -> y [T, H, B]; each output is summed
    over A in the same order whatever T is (rows never share a BLAS tile)."""
    T, H, A = x.shape
    B = w.shape[2]
    for h in prange(H):
        for t in range(T):
            for j in range(B):
                y[t, h, j] = np.float32(0.0)
            for a in range(A):
                xa = x[t, h, a]
                for j in range(B):
                    y[t, h, j] += xa * w[h, a, j]


def heads_times(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per-head products x [T, H, A] @ w [H, A, B] -> [T, H, B] float32, row-count invariant."""
    x = np.ascontiguousarray(x, np.float32)
    w = np.ascontiguousarray(w, np.float32)
    if x.ndim != 3 or w.ndim != 3 or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[1]:
        raise WasteError(f"per-head product needs x [T, H, A] and w [H, A, B], got {x.shape} and {w.shape}")
    y = np.empty((x.shape[0], x.shape[1], w.shape[2]), np.float32)
    _heads_times(x, w, y)
    return y


def _check_latent(latent: np.ndarray, q_width: int, kv_rank: int) -> None:
    if latent.dtype != np.float32 or latent.ndim != 2 or not latent.flags.c_contiguous:
        raise WasteError(f"MLA latent cache must be a C-contiguous float32 [capacity, D] array, got {latent.dtype} "
                         f"{latent.shape}")
    if latent.shape[1] != q_width:
        raise WasteError(f"MLA latent width {latent.shape[1]} does not match the absorbed query width {q_width}")
    if not 0 < kv_rank <= q_width:
        raise WasteError(f"MLA kv_rank {kv_rank} must lie in 1..{q_width}")


def mla_decode(
    q_abs: np.ndarray,
    latent: np.ndarray,
    length: int,
    scale: float,
    kv_rank: int,
    *,
    out: np.ndarray | None = None,
    probs: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One query token over the first `length` cached rows.

    q_abs [H, D] absorbed queries, latent [capacity, D] -> (o_latent [H, R], probs [H, length]).
    """
    q_abs = np.ascontiguousarray(q_abs, np.float32)
    _check_latent(latent, q_abs.shape[1], kv_rank)
    if not 0 < length <= latent.shape[0]:
        raise WasteError(f"MLA decode over {length} tokens needs 1..{latent.shape[0]} cached rows")
    H = q_abs.shape[0]
    if out is None:
        out = np.empty((H, kv_rank), np.float32)
    if probs is None:
        probs = np.empty((H, length), np.float32)
    if out.shape != (H, kv_rank) or probs.shape != (H, length):
        raise WasteError(f"MLA decode buffers must be [H, R] = {(H, kv_rank)} and [H, n] = {(H, length)}")
    nchunks = max(1, min(num_threads(), length))
    _decode(q_abs, latent, length, np.float32(scale), kv_rank, nchunks, DECODE_BLOCK, probs, out)
    return out, probs


def mla_prefill(
    q_abs: np.ndarray,
    latent: np.ndarray,
    start: int,
    scale: float,
    kv_rank: int,
    *,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """A chunk of T queries at positions start..start+T-1, causal over cache + chunk.

    The chunk's own latents must already sit in rows start..start+T-1 of `latent`.
    q_abs [T, H, D], latent [capacity, D] -> o_latent [T, H, R].
    """
    q_abs = np.ascontiguousarray(q_abs, np.float32)
    _check_latent(latent, q_abs.shape[2], kv_rank)
    T, H, _ = q_abs.shape
    if start < 0 or start + T > latent.shape[0]:
        raise WasteError(f"MLA prefill of {T} tokens at position {start} exceeds the cache capacity {latent.shape[0]}")
    if out is None:
        out = np.empty((T, H, kv_rank), np.float32)
    if out.shape != (T, H, kv_rank):
        raise WasteError(f"MLA prefill output must be [T, H, R] = {(T, H, kv_rank)}, got {out.shape}")
    nchunks = max(1, num_threads())
    for t in range(T):
        n = start + t + 1
        probs = np.empty((H, n), np.float32)
        _decode(q_abs[t], latent, n, np.float32(scale), kv_rank, min(nchunks, n), DECODE_BLOCK, probs, out[t])
    return out
