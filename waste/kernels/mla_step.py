"""One MLA decode step in one kernel call, for a layer whose products are q formats.

An MLA decode step (waste.engine.mla_layer.MLALayer.decode) makes seven kernel calls (the query
and latent products, the latent's RMSNorm, W_UK into the query, the attention over the cache,
W_UV out of the attended latent, the output product) with NumPy between them; on `mini` that
Python took about as long as the calls themselves. `mla_decode_step` makes the same calls, on
arrays of the same types, inside one compiled function (the products of x in one batch, bit for
bit the products one by one: `QBatch`), for both query forms (K3's low-rank one adds its RMSNorm
and q_b_proj) with or without K3's output gate: the bits of the step made call by call, which
the layer keeps for float weights (the tests compare the two).
"""

from __future__ import annotations

import numpy as np

from waste.jit import kernel
from waste.kernels.mla import _decode, _gated_rows, _heads_dot, _heads_times
from waste.kernels.norm import _rms_norm_rows
from waste.kernels.qbatch import _q_products
from waste.kernels.quant import _q_product
from waste.kernels.serial import column_max
from waste.qformat import ROWS


# Serial: its parallel regions are those of the kernels it calls.
@kernel
def mla_decode_step(x, rows, table, tscales, first_format, like_qs, like_scales, like_qs_b, like_scales_b, low_rank,
                    q_norm, qb_qs, qb_scales, qb_tscale, qb_no_qs, qb_no_scales, gated, kv_norm, eps, w_uk, w_uv,
                    latent, length, scale, nchunks, block, o_qs, o_scales, o_tscale, o_no_qs, o_no_scales, probs, y,
                    threads):
    """One token x [1, hidden] through an MLA layer -> y [1, padded hidden] (the output product's
    rows, padded to 16) and probs [H, length], the attention weights. Row length - 1 of latent
    [capacity, R + P] (the cache, already holding the tokens before it) receives the token's
    normalised latent and rope part.

    rows, table .. like_scales_b: the QBatch of the products of x: the query's (q_proj, or
    q_a_proj when low_rank), kv_a_proj, then g_proj when gated; low_rank: the query is
    q_b_proj (qb_*: its q arguments, QMatrix._qargs) of q_a_proj x normalised by q_norm [Q]
    (else qb_* and q_norm hold nothing); gated: the heads' outputs are multiplied by
    sigmoid(g_proj x) before o_proj (`output_gate`); kv_norm [R], eps float32: the RMSNorms'
    weight and epsilon (kv_a_layernorm, q_a_layernorm); w_uk [H, nope, R], w_uv [H, V, R];
    scale float32, nchunks and block: `mla_decode`'s; o_*: o_proj's q arguments; threads:
    numba.get_num_threads()."""
    H, nope, R = w_uk.shape
    V = w_uv.shape[1]
    D = latent.shape[1]
    rope = D - R
    products = np.empty((table.shape[0], 1, ROWS * column_max(table, 2)), np.float32)
    _q_products(x, rows, table, tscales, first_format, like_qs, like_scales, like_qs_b, like_scales_b, products,
                threads)
    # The cache row: the normalised latent, then the rope part of the key.
    ckv = np.empty((1, R), np.float32)
    for r in range(R):
        ckv[0, r] = products[1, 0, r]
    normed = np.empty((1, R), np.float32)
    _rms_norm_rows(ckv, kv_norm, eps, normed)
    row = length - 1
    for r in range(R):
        latent[row, r] = normed[0, r]
    for r in range(R, D):
        latent[row, r] = products[1, 0, r]
    # The query [H * (nope + P)]: q_proj x, or q_b_proj of the normalised q_a_proj x.
    q_b = np.empty((1, ROWS * qb_qs.shape[0]), np.float32)
    if low_rank:
        Q = q_norm.shape[0]
        q_a = np.empty((1, Q), np.float32)
        for i in range(Q):
            q_a[0, i] = products[0, 0, i]
        q_a_normed = np.empty((1, Q), np.float32)
        _rms_norm_rows(q_a, q_norm, eps, q_a_normed)
        _q_product(q_a_normed, qb_qs, qb_scales, qb_tscale, qb_no_qs, qb_no_scales, qb_tscale, q_b, q_b, threads)
    query = q_b[0] if low_rank else products[0, 0]
    # Absorbed queries [H, R + P]: W_UK^T q_nope per head, then q_rope.
    width = nope + rope
    q_nope = np.empty((1, H, nope), np.float32)
    q_abs = np.empty((H, D), np.float32)
    for h in range(H):
        for d in range(nope):
            q_nope[0, h, d] = query[h * width + d]
        for d in range(rope):
            q_abs[h, R + d] = query[h * width + nope + d]
    absorbed = np.empty((1, H, R), np.float32)
    _heads_times(q_nope, w_uk, absorbed)
    for h in range(H):
        for r in range(R):
            q_abs[h, r] = absorbed[0, h, r]
    o_latent = np.empty((H, R), np.float32)
    _decode(q_abs, latent, length, scale, R, nchunks, block, probs, o_latent)
    heads = np.empty((1, H, V), np.float32)
    _heads_dot(o_latent.reshape((1, H, R)), w_uv, heads)
    o = heads.reshape((1, H * V))
    if gated:
        g = np.empty((1, H * V), np.float32)
        for i in range(H * V):
            g[0, i] = products[2, 0, i]
        gated_o = np.empty((1, H * V), np.float32)
        _gated_rows(o, g, gated_o)
        o = gated_o
    _q_product(o, o_qs, o_scales, o_tscale, o_no_qs, o_no_scales, o_tscale, y, y, threads)
