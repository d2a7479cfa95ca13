"""One KDA decode step in one kernel call, for a layer whose products are q formats.

A decode step of a KDA layer makes eight kernel calls (its input products in two batches, the
q/k/v convs, the decay gate, the recurrence, the gated RMSNorm, the output product) with NumPy
between them; on `mini` the Python around them cost about as much as the kernels (260 us a
layer against ~120 of reading its weights and state, on the 2-core EPYC). `kda_decode_step`
makes the same calls, in the same order on arrays of the same types, inside one compiled
function: the bits of the step made call by call (`waste.engine.kda_layer.KDALayer`, which
keeps the call-by-call form for f32 and bf16 trunks and tests the two against each other).
"""

from __future__ import annotations

import numpy as np

from waste.jit import kernel, parallel_kernel
from waste.kernels.fastmath import fsigmoid
from waste.kernels.kda import _gate_kernel, _gated_rmsnorm_kernel
from waste.kernels.kda_decode import _deferred_decode_kernel
from waste.kernels.quant import _q_product, _q_products
from waste.kernels.short_conv import _conv_step_kernel
from waste.qformat import ROWS


@kernel
def sigmoid_into(x, out):
    """out = sigmoid(x) elementwise over float32 arrays [n] (fsigmoid; the betas of prefill and decode)."""
    for i in range(x.shape[0]):
        out[i] = fsigmoid(x[i])


@parallel_kernel
def kda_decode_step(x, first_rows, first_table, first_tscales, first_format, first_qs, first_scales, first_qs_b,
                    first_scales_b, mid_rows, mid_table, mid_tscales, mid_format, mid_qs, mid_scales, mid_qs_b,
                    mid_scales_b, low_rank_gate, taps3, ring, gate_a, gate_bias, lower_bound, scale, l2norm_qk, base,
                    pending_k, pending_d, o_norm, eps, o_qs, o_scales, o_tscale, o_no_qs, o_no_scales, y, g, beta):
    """One token x [1, hidden] through a KDA layer -> y [1, padded hidden] (the output product's
    rows, padded to 16), g [H, K] the log decays, beta [H]; advances the conv ring and the
    recurrent state (base, pending_k, pending_d) as `KDALayer._decode` does.

    first_*: the QBatch of the six products that read x (q, k, v, f_a, the gate's first or
    only matrix, b); mid_*: the QBatch of the rank-K products (f_b on f_a x; g_b on the gate's
    low rank when low_rank_gate); o_*: the output matrix's q arguments (QMatrix._qargs).
    l2norm_qk arrives as an argument (True): passed as a literal here, it compiled the
    recurrence specialised, which then rounded an ulp away from the call-by-call step."""
    H, K = g.shape
    HK = H * K
    products = np.empty((first_table.shape[0], 1, ROWS * first_table[:, 2].max()), np.float32)
    _q_products(x, first_rows, first_table, first_tscales, first_format, first_qs, first_scales, first_qs_b,
                first_scales_b, products)
    n_mid = mid_table.shape[0]
    low = np.empty((n_mid, K), np.float32)  # f_a x, and the gate's low rank
    for r in range(n_mid):
        low[r] = products[3 + r, 0, :K]
    mid = np.empty((n_mid, 1, ROWS * mid_table[:, 2].max()), np.float32)
    _q_products(low, mid_rows, mid_table, mid_tscales, mid_format, mid_qs, mid_scales, mid_qs_b, mid_scales_b, mid)
    qkv = np.empty((3, HK), np.float32)
    for r in range(3):
        qkv[r] = products[r, 0, :HK]
    conv = np.empty((3, HK), np.float32)
    _conv_step_kernel(qkv, taps3, ring, conv)
    conv3 = conv.reshape((3, H, K))
    fb = np.empty((1, H, K), np.float32)
    fb[0] = mid[0, 0, :HK].reshape((H, K))
    g3 = np.empty((1, H, K), np.float32)
    _gate_kernel(fb, gate_a, gate_bias, lower_bound, g3)
    g[:, :] = g3[0]
    sigmoid_into(products[5, 0, :H].copy(), beta)
    o = np.empty((H, K), np.float32)
    _deferred_decode_kernel(conv3[0], conv3[1], conv3[2], g, beta, scale, l2norm_qk, base, pending_k, pending_d, o)
    gate = np.empty((H, K), np.float32)
    if low_rank_gate:
        gate[:, :] = mid[1, 0, :HK].reshape((H, K))
    else:
        gate[:, :] = products[4, 0, :HK].reshape((H, K))
    normed = np.empty((H, K), np.float32)
    _gated_rmsnorm_kernel(o, gate, o_norm, eps, normed)
    _q_product(normed.reshape((1, HK)), o_qs, o_scales, o_tscale, o_no_qs, o_no_scales, o_tscale, y, y)
