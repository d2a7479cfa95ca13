"""Latent attention (MLA) over the compressed cache: absorbed decode, expanded prefill.

The cache holds one row of D = R + P values per token: the normalised KV latent c (R =
kv_lora_rank) followed by the shared, unrotated rope part of the key (P = qk_rope_head_dim).
Head h's key is [W_UK[h] c | k_rope] and its value W_UV[h] c (W_UK, W_UV [H, nope or V, R]).

Decode (one query) keeps the absorbed form: the query becomes one D-vector
`q_abs[h] = [W_UK[h]^T q_nope[h] | q_rope[h]]`, scored by a plain dot product with each cached
row, and its output is the probability-weighted sum of the cached latents (first R values),
mapped to the value space by W_UV[h] outside the kernel: D + R = 1088 multiply-adds per cached
token and head at the Kimi shape, and the cache is never expanded. A Numba kernel: blocks of
cached rows shared by all heads, scored four heads by two rows at a time (eight independent
sums, `_score_4x2`, the same microkernel as prefill's scores) and summed two heads by four rows
at a time.

Prefill (many queries) expands instead (`mla_prefill`): per head and per block of KEY_BLOCK
cached tokens it forms the keys [W_UK c | k_rope] and values W_UV c once, then every query of
the call that sees the block scores it (nope + P) and adds its values (V): 320 multiply-adds
per query-key pair and head instead of 1088, plus R (nope + V) per cached token and head for
the expansion, shared by all the call's queries (the engine gives MLA a whole prefill pass at
once). The absorbed form spends as much per query on absorbing it and its output, so a prompt
from an empty cache always gains; a short call over a long cache loses (below about
R (nope + V) / (1088 - 320) = 170 queries at the Kimi shape). Softmax is online: a running max
and sum per query, rescaled from block to block.

Chunk invariance (issue 13): a query's output depends only on its position and the cache,
never on how the prompt was cut into calls, so a resumed session equals a straight run bit for
bit. Blocks start at multiples of KEY_BLOCK in absolute position, so every key is expanded,
paired and grouped alike in every cut. Queries go four at a time (QUERY_TILE; a short last
tile repeats its last query): four queries by two keys make eight independent sums in one
loop, which the compiler vectorises alike, so a query's scores do not depend on its slot or
its neighbours. Each query's softmax is its own; its weights past its causal horizon are zero
and add exactly nothing to the value sums, which take KEY_GROUP rows at a time in one fixed
expression. No BLAS (its results depend on the row count of the call). The per-head products
of decode (W_UK into the query, W_UV out of the latent) are Numba kernels for the same reason.
tests/kernels/test_mla.py cuts prompts at and around block and tile boundaries.

Shapes: q_abs [H, D] (decode); q [T, H, nope + P] (prefill); latent [capacity, D]; w_uk
[H, nope, R]; w_uv [H, V, R]; decode output [H, R], prefill output [T, H, V]; probs [H, n].
"""

from __future__ import annotations

import numpy as np

from waste.errors import WasteError
from waste.jit import FIXED_ORDER_FASTMATH, kernel, parallel_kernel, prange
from waste.kernels.bf16 import _row_block
from waste.kernels.fastmath import fexp, fsigmoid

# Cached rows per block in the decode kernel (16 rows x 576 values = 36 KiB); measured best of
# 1..64 at H=32, 4096 tokens on the 2-core dev machine.
DECODE_BLOCK = 16
# Decode sums the weighted latents in token ranges reduced afterwards. Their number follows the
# context only (one range per DECODE_RANGE tokens, at most DECODE_RANGES), never the thread
# count: a split by threads gave different logits at 1 and 2 threads.
DECODE_RANGE = 256
DECODE_RANGES = 8
# Prefill: cached tokens expanded per head at once (from multiples of KEY_BLOCK in absolute
# position; their keys and values, 80 KiB at the Kimi shape, stay in L2 while every query of
# the call attends to them), value rows summed at once, and queries that share each load.
KEY_BLOCK = 64
KEY_GROUP = 8
QUERY_TILE = 4


@kernel(inline="always")  # a call per tile (LLVM does not inline across Numba functions) costs 5-10%
def _score_4x2(q0, q1, q2, q3, x, y, scale, out, r0, j):
    """out[r0 + r, j] = scale * q_r . x and out[r0 + r, j + 1] = scale * q_r . y for the four rows
    q_r: eight independent sums (enough to hide the FMA latency) from six loads per eight
    multiply-adds. The scores of decode (heads by cached rows) and of prefill (queries by
    expanded keys); the callers keep the four rows across their loop over pairs."""
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    b0 = np.float32(0.0)
    b1 = np.float32(0.0)
    b2 = np.float32(0.0)
    b3 = np.float32(0.0)
    for d in range(x.shape[0]):
        xd = x[d]
        yd = y[d]
        a0 += q0[d] * xd
        a1 += q1[d] * xd
        a2 += q2[d] * xd
        a3 += q3[d] * xd
        b0 += q0[d] * yd
        b1 += q1[d] * yd
        b2 += q2[d] * yd
        b3 += q3[d] * yd
    out[r0, j] = a0 * scale
    out[r0 + 1, j] = a1 * scale
    out[r0 + 2, j] = a2 * scale
    out[r0 + 3, j] = a3 * scale
    out[r0, j + 1] = b0 * scale
    out[r0 + 1, j + 1] = b1 * scale
    out[r0 + 2, j + 1] = b2 * scale
    out[r0 + 3, j + 1] = b3 * scale


@parallel_kernel
def _decode(q, latent, n, scale, kv_rank, nchunks, block, probs, out):
    H, D = q.shape
    # Token-major in blocks of `block` rows: a block stays in L1/L2 while all H queries are
    # scored against it, so the cache streams through memory once, not once per head.
    # Four heads by two cached rows at a time (_score_4x2).
    for b in prange((n + block - 1) // block):
        j0, j1 = b * block, min(b * block + block, n)
        for h in range(0, H - 3, 4):
            q0, q1, q2, q3 = q[h], q[h + 1], q[h + 2], q[h + 3]
            for j in range(j0, j1 - 1, 2):
                _score_4x2(q0, q1, q2, q3, latent[j], latent[j + 1], scale, probs, h, j)
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
    partial = np.empty((nchunks, H, kv_rank), np.float32)
    for c in prange(nchunks):
        partial[c] = 0.0  # here, not np.zeros: that would be a parallel region of its own
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


@kernel
def _head_times(x, w, y, h):
    """y[t, h] = x[t, h] @ w[h] for every t, summed over A in order: a function of its own rather
    than the prange body, which came out in other bits from Numba's cache (see FIXED_ORDER_FASTMATH)."""
    T, _, A = x.shape
    B = w.shape[2]
    for t in range(T):
        for j in range(B):
            y[t, h, j] = np.float32(0.0)
        for a in range(A):
            xa = x[t, h, a]
            for j in range(B):
                y[t, h, j] += xa * w[h, a, j]


@parallel_kernel
def _heads_times(x, w, y):
    """y[t, h] = x[t, h] @ w[h] for x [T, H, A], w [H, A, B] -> y [T, H, B]; each output is summed
    over A in the same order whatever T is (rows never share a BLAS tile)."""
    for h in prange(x.shape[1]):
        _head_times(x, w, y, h)


def heads_times(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per-head products x [T, H, A] @ w [H, A, B] -> [T, H, B] float32, row-count invariant."""
    x = np.ascontiguousarray(x, np.float32)
    w = np.ascontiguousarray(w, np.float32)
    if x.ndim != 3 or w.ndim != 3 or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[1]:
        raise WasteError(f"per-head product needs x [T, H, A] and w [H, A, B], got {x.shape} and {w.shape}")
    y = np.empty((x.shape[0], x.shape[1], w.shape[2]), np.float32)
    _heads_times(x, w, y)
    return y


@kernel
def _dots8(x, w, r0, n, out, o0):
    """out[o0 + i] = x[:n] . w[r0 + i, :n] for i < 8: eight independent sums over n."""
    w0, w1, w2, w3 = w[r0], w[r0 + 1], w[r0 + 2], w[r0 + 3]
    w4, w5, w6, w7 = w[r0 + 4], w[r0 + 5], w[r0 + 6], w[r0 + 7]
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    a4 = np.float32(0.0)
    a5 = np.float32(0.0)
    a6 = np.float32(0.0)
    a7 = np.float32(0.0)
    for a in range(n):
        xa = x[a]
        a0 += xa * w0[a]
        a1 += xa * w1[a]
        a2 += xa * w2[a]
        a3 += xa * w3[a]
        a4 += xa * w4[a]
        a5 += xa * w5[a]
        a6 += xa * w6[a]
        a7 += xa * w7[a]
    out[o0] = a0
    out[o0 + 1] = a1
    out[o0 + 2] = a2
    out[o0 + 3] = a3
    out[o0 + 4] = a4
    out[o0 + 5] = a5
    out[o0 + 6] = a6
    out[o0 + 7] = a7


@parallel_kernel
def _heads_dot(x, w, y):
    """y[t, h] = w[h] @ x[t, h], one head and token at a time through the f32 one-token product
    (`waste.kernels.bf16`: its fixed order of multiply-adds, one row per pass on AMD). Eight rows
    side by side (eight sums the compiler vectorised) streamed W_UV at 26-28 GB/s where this runs
    at 34-35 on the Zen 4 EPYC ([32 or 96, 128, 512] from memory, 2 threads, 2026-12-05)."""
    T, H = x.shape[:2]
    B = w.shape[1]
    for h in prange(H):
        for t in range(T):
            _row_block(w[h], x[t, h:h + 1], y[t, h:h + 1], 0, B, w[h], 0, 0)


def heads_dot(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per-head products y[t, h] = w[h] @ x[t, h] for x [T, H, A], w [H, B, A] -> [T, H, B]
    float32; each output is one dot product whatever T is (decode's W_UV out of the latent)."""
    x = np.ascontiguousarray(x, np.float32)
    w = np.ascontiguousarray(w, np.float32)
    if x.ndim != 3 or w.ndim != 3 or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[2]:
        raise WasteError(f"per-head product needs x [T, H, A] and w [H, B, A], got {x.shape} and {w.shape}")
    y = np.empty((x.shape[0], x.shape[1], w.shape[1]), np.float32)
    _heads_dot(x, w, y)
    return y


# Rows of the output gate taken on the calling thread (entering the thread pool costs more).
GATE_SERIAL_ROWS = 16


@parallel_kernel
def _gated_rows(o, g, out):
    """out = o * sigmoid(g) elementwise, [T, N] float32 (K3's MLA output gate), with `fsigmoid`:
    each element the same bits whichever rows run together or on which thread."""
    if o.shape[0] <= GATE_SERIAL_ROWS:
        for t in range(o.shape[0]):
            _gated_row(o, g, out, t)
    else:
        for t in prange(o.shape[0]):
            _gated_row(o, g, out, t)


@kernel
def _gated_row(o, g, out, t):
    for i in range(o.shape[1]):
        out[t, i] = o[t, i] * fsigmoid(g[t, i])


def output_gate(o: np.ndarray, g: np.ndarray) -> np.ndarray:
    """o * sigmoid(g) for o, g [T, N] float32 (C-contiguous): the gated head outputs."""
    if o.shape != g.shape or o.ndim != 2:
        raise WasteError(f"output gate needs o and g of one shape [T, N], got {o.shape} and {g.shape}")
    o = np.ascontiguousarray(o, np.float32)
    out = np.empty_like(o)
    _gated_rows(o, np.ascontiguousarray(g, np.float32), out)
    return out


@kernel
def _expand(latent, jb, rows, kv_rank, w, out):
    """out[i, o] = w[o] . latent[jb + i, :kv_rank] for i < rows and every row o of w [B, R]:
    eight weight rows at a time against every cached row (the weights stay in L1)."""
    B = w.shape[0]
    for o in range(0, B - B % 8, 8):
        for i in range(rows):
            _dots8(latent[jb + i], w, o, kv_rank, out[i], o)
    for o in range(B - B % 8, B):
        for i in range(rows):
            c = latent[jb + i]
            acc = np.float32(0.0)
            for a in range(kv_rank):
                acc += c[a] * w[o, a]
            out[i, o] = acc


@kernel
def _expand_block(latent, jb, n, kv_rank, w_uk, w_uv, keys, values):
    """Rows jb.. of the cache (those below n) -> keys [KEY_BLOCK, nope + P] = [W_UK c | k_rope]
    and values [KEY_BLOCK, V] = W_UV c for one head; rows at or past n are zeroed."""
    nope = w_uk.shape[0]
    rows = min(keys.shape[0], n - jb)
    _expand(latent, jb, rows, kv_rank, w_uk, keys)
    _expand(latent, jb, rows, kv_rank, w_uv, values)
    for i in range(rows):
        for p in range(keys.shape[1] - nope):
            keys[i, nope + p] = latent[jb + i, kv_rank + p]
    for i in range(rows, keys.shape[0]):
        keys[i, :] = 0.0
        values[i, :] = 0.0


# Its running sum in KEY_GROUP fixed lanes (width is a multiple of KEY_GROUP): see FIXED_ORDER_FASTMATH.
@kernel(fastmath=set(FIXED_ORDER_FASTMATH))
def _softmax_step(s, nk, width, run, t, acc):
    """Online softmax of one query over its nk scores s[:nk] (nk may be <= 0: no keys here).

    Leaves exp(s - max) in s[:nk] and zeros in s[nk:width]; updates the running max run[0, t] and
    sum run[1, t], rescaling the unnormalised output acc [V] when the max rises."""
    top = np.float32(-np.inf)
    for j in range(nk):
        top = max(top, s[j])
    old = run[0, t]
    new = max(old, top)
    for j in range(nk):
        s[j] = fexp(s[j] - new)
    for j in range(max(nk, 0), width):
        s[j] = 0.0
    l0 = l1 = l2 = l3 = l4 = l5 = l6 = l7 = np.float32(0.0)  # the KEY_GROUP (8) lanes
    for j in range(0, width, KEY_GROUP):
        l0 += s[j]
        l1 += s[j + 1]
        l2 += s[j + 2]
        l3 += s[j + 3]
        l4 += s[j + 4]
        l5 += s[j + 5]
        l6 += s[j + 6]
        l7 += s[j + 7]
    total = ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))
    if new > old:
        # exp(-inf) = 0 on the query's first block, where acc and the sum are still zero
        alpha = fexp(old - new)
        run[1, t] *= alpha
        for v in range(acc.shape[0]):
            acc[v] *= alpha
        run[0, t] = new
    run[1, t] += total


@kernel
def _accumulate_tile(scores, values, width, acc, t0):
    """acc[t0 + i] += sum_j scores[i, j] values[j] over j < width (a multiple of KEY_GROUP) for the
    QUERY_TILE queries t0..: eight value rows at a time, each loaded once for the four queries.
    A score of zero adds exactly nothing, so each query's sum is its own whatever the tile."""
    V = values.shape[1]
    c0, c1, c2, c3 = acc[t0], acc[t0 + 1], acc[t0 + 2], acc[t0 + 3]
    s0, s1, s2, s3 = scores[0], scores[1], scores[2], scores[3]
    for j in range(0, width, KEY_GROUP):
        v0, v1, v2, v3 = values[j], values[j + 1], values[j + 2], values[j + 3]
        v4, v5, v6, v7 = values[j + 4], values[j + 5], values[j + 6], values[j + 7]
        # the 32 weights as scalars, so the loop below keeps them in registers
        p00, p01, p02, p03, p04, p05, p06, p07 = s0[j], s0[j + 1], s0[j + 2], s0[j + 3], \
            s0[j + 4], s0[j + 5], s0[j + 6], s0[j + 7]
        p10, p11, p12, p13, p14, p15, p16, p17 = s1[j], s1[j + 1], s1[j + 2], s1[j + 3], \
            s1[j + 4], s1[j + 5], s1[j + 6], s1[j + 7]
        p20, p21, p22, p23, p24, p25, p26, p27 = s2[j], s2[j + 1], s2[j + 2], s2[j + 3], \
            s2[j + 4], s2[j + 5], s2[j + 6], s2[j + 7]
        p30, p31, p32, p33, p34, p35, p36, p37 = s3[j], s3[j + 1], s3[j + 2], s3[j + 3], \
            s3[j + 4], s3[j + 5], s3[j + 6], s3[j + 7]
        for v in range(V):
            x0, x1, x2, x3, x4, x5, x6, x7 = v0[v], v1[v], v2[v], v3[v], v4[v], v5[v], v6[v], v7[v]
            c0[v] += ((p00 * x0 + p01 * x1) + (p02 * x2 + p03 * x3)) + ((p04 * x4 + p05 * x5) + (p06 * x6 + p07 * x7))
            c1[v] += ((p10 * x0 + p11 * x1) + (p12 * x2 + p13 * x3)) + ((p14 * x4 + p15 * x5) + (p16 * x6 + p17 * x7))
            c2[v] += ((p20 * x0 + p21 * x1) + (p22 * x2 + p23 * x3)) + ((p24 * x4 + p25 * x5) + (p26 * x6 + p27 * x7))
            c3[v] += ((p30 * x0 + p31 * x1) + (p32 * x2 + p33 * x3)) + ((p34 * x4 + p35 * x5) + (p36 * x6 + p37 * x7))


@parallel_kernel
def _prefill(q, latent, start, scale, kv_rank, w_uk, w_uv, out):
    T, H, QK = q.shape
    V = w_uv.shape[1]
    n = start + T
    # Queries in tiles of QUERY_TILE; the last tile repeats the last query (its copies discarded).
    Tp = (T + QUERY_TILE - 1) // QUERY_TILE * QUERY_TILE
    for h in prange(H):
        qs = np.empty((Tp, QK), np.float32)
        for t in range(Tp):
            qs[t] = q[min(t, T - 1), h]
        acc = np.zeros((Tp, V), np.float32)
        run = np.empty((2, Tp), np.float32)  # running max, running sum
        run[0] = -np.inf
        run[1] = 0.0
        keys = np.empty((KEY_BLOCK, QK), np.float32)
        values = np.empty((KEY_BLOCK, V), np.float32)
        scores = np.empty((QUERY_TILE, KEY_BLOCK), np.float32)
        for jb in range(0, n, KEY_BLOCK):
            _expand_block(latent, jb, n, kv_rank, w_uk[h], w_uv[h], keys, values)
            for t0 in range(max(0, jb - start) // QUERY_TILE * QUERY_TILE, Tp, QUERY_TILE):
                # keys of this block seen by the tile's last query (the tile's earlier ones see fewer)
                nk = min(KEY_BLOCK, start + min(t0 + QUERY_TILE, T) - jb)
                width = (nk + KEY_GROUP - 1) // KEY_GROUP * KEY_GROUP
                q0, q1, q2, q3 = qs[t0], qs[t0 + 1], qs[t0 + 2], qs[t0 + 3]
                for j in range(0, nk, 2):  # four queries by two keys
                    _score_4x2(q0, q1, q2, q3, keys[j], keys[j + 1], scale, scores, 0, j)
                for i in range(QUERY_TILE):
                    t = t0 + i
                    seen = min(KEY_BLOCK, start + min(t, T - 1) + 1 - jb)
                    _softmax_step(scores[i], seen, width, run, t, acc[t])
                _accumulate_tile(scores, values, width, acc, t0)
        for t in range(T):
            inv = np.float32(1.0) / run[1, t]
            for v in range(V):
                out[t, h, v] = acc[t, v] * inv


def _check_latent(latent: np.ndarray, q_width: int, kv_rank: int) -> None:
    if latent.dtype != np.float32 or latent.ndim != 2 or not latent.flags.c_contiguous:
        raise WasteError(f"MLA latent cache must be a C-contiguous float32 [capacity, D] array, got {latent.dtype} "
                         f"{latent.shape}")
    if latent.shape[1] != q_width:
        raise WasteError(f"MLA latent width {latent.shape[1]} does not match the absorbed query width {q_width}")
    if not 0 < kv_rank <= q_width:
        raise WasteError(f"MLA kv_rank {kv_rank} must lie in 1..{q_width}")


def decode_ranges(length: int) -> int:
    """The token ranges decode sums the weighted latents of `length` cached rows in."""
    return min(DECODE_RANGES, -(-length // DECODE_RANGE))


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
    _decode(q_abs, latent, length, np.float32(scale), kv_rank, decode_ranges(length), DECODE_BLOCK, probs, out)
    return out, probs


def mla_prefill(
    q: np.ndarray,
    latent: np.ndarray,
    start: int,
    scale: float,
    w_uk: np.ndarray,
    w_uv: np.ndarray,
    *,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """T queries at positions start..start+T-1, causal over the cache, in the expanded form.

    The queries' own latents must already sit in rows start..start+T-1 of `latent`; rows from
    start+T on are never read. q [T, H, nope + P], latent [capacity, R + P], w_uk [H, nope, R],
    w_uv [H, V, R] -> o [T, H, V].
    """
    q = np.ascontiguousarray(q, np.float32)
    w_uk = np.ascontiguousarray(w_uk, np.float32)
    w_uv = np.ascontiguousarray(w_uv, np.float32)
    if q.ndim != 3 or w_uk.ndim != 3 or w_uv.ndim != 3:
        raise WasteError(f"MLA prefill needs q [T, H, nope + P], w_uk [H, nope, R] and w_uv [H, V, R], got "
                         f"{q.shape}, {w_uk.shape} and {w_uv.shape}")
    T, H, qk = q.shape
    nope, kv_rank = w_uk.shape[1], w_uk.shape[2]
    if w_uk.shape[0] != H or w_uv.shape[0] != H or w_uv.shape[2] != kv_rank or not 0 < nope <= qk:
        raise WasteError(f"MLA prefill weights do not fit {H} heads of width {qk}: w_uk {w_uk.shape}, "
                         f"w_uv {w_uv.shape}")
    _check_latent(latent, kv_rank + qk - nope, kv_rank)
    if start < 0 or start + T > latent.shape[0]:
        raise WasteError(f"MLA prefill of {T} tokens at position {start} exceeds the cache capacity {latent.shape[0]}")
    if out is None:
        out = np.empty((T, H, w_uv.shape[1]), np.float32)
    if out.shape != (T, H, w_uv.shape[1]) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise WasteError(f"MLA prefill output must be a C-contiguous float32 [T, H, V] = {(T, H, w_uv.shape[1])} "
                         f"array, got {out.dtype} {out.shape}")
    if T:
        _prefill(q, latent, start, np.float32(scale), kv_rank, w_uk, w_uv, out)
    return out
