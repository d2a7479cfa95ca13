"""One KDA decode step in one kernel call.

A decode step of a KDA layer makes eight kernel calls (its input products in two batches, the
q/k/v convs, the decay gate, the recurrence, the gated RMSNorm, the output product) with NumPy
between them; on `mini` the Python around them cost about as much as the kernels (260 us a
layer against ~120 of reading its weights and state, on the 2-core EPYC). `kda_decode_step`
makes the same calls, in the same order on arrays of the same types, inside one compiled
function: the bits of the step made call by call (`waste.engine.kda_layer.KDALayer`, which
keeps the call-by-call form for mixed trunks; the tests compare the two). `kda_decode_step`
takes a layer whose products are q formats, `kda_decode_step_dense` one whose weights are all
f32 or all bf16.
"""

from __future__ import annotations

import numpy as np

from waste.jit import kernel
from waste.kernels.bf16 import _operand_into, _run_blocks
from waste.kernels.dense_batch import _dense_products
from waste.kernels.fastmath import fsigmoid
from waste.kernels.kda import _gate_kernel, _gated_rmsnorm_kernel
from waste.kernels.kda_decode import _deferred_decode_kernel
from waste.kernels.qbatch import _q_products
from waste.kernels.quant import _q_product
from waste.kernels.serial import column_max
from waste.kernels.short_conv import _conv_step_kernel
from waste.qformat import ROWS


@kernel
def sigmoid_into(x, out):
    """out = sigmoid(x) elementwise over float32 arrays [n] (fsigmoid; the betas of prefill and decode)."""
    for i in range(x.shape[0]):
        out[i] = fsigmoid(x[i])


# Serial: its parallel regions are those of the kernels it calls.
@kernel
def kda_decode_step(x, first_rows, first_table, first_tscales, first_format, first_qs, first_scales, first_qs_b,
                    first_scales_b, mid_rows, mid_table, mid_tscales, mid_format, mid_qs, mid_scales, mid_qs_b,
                    mid_scales_b, low_rank_gate, taps3, ring, gate_a, gate_bias, lower_bound, scale, l2norm_qk, base,
                    pending_k, pending_d, o_norm, eps, o_qs, o_scales, o_tscale, o_no_qs, o_no_scales, y, g, beta,
                    threads):
    """One token x [1, hidden] through a KDA layer -> y [1, padded hidden] (the output product's
    rows, padded to 16), g [H, K] the log decays, beta [H]; advances the conv ring and the
    recurrent state (base, pending_k, pending_d) as `KDALayer._decode` does.

    first_*: the QBatch of the six products that read x (q, k, v, f_a, the gate's first or
    only matrix, b); mid_*: the QBatch of the rank-K products (f_b on f_a x; g_b on the gate's
    low rank when low_rank_gate); o_*: the output matrix's q arguments (QMatrix._qargs);
    threads: numba.get_num_threads() (the products share their row blocks out between them).
    l2norm_qk arrives as an argument (True): passed as a literal here, it compiled the
    recurrence specialised, which then rounded an ulp away from the call-by-call step."""
    H, K = g.shape
    products = np.empty((first_table.shape[0], 1, ROWS * column_max(first_table, 2)), np.float32)
    _q_products(x, first_rows, first_table, first_tscales, first_format, first_qs, first_scales, first_qs_b,
                first_scales_b, products, threads)
    low = _low_rank(products, mid_table.shape[0], K)
    mid = np.empty((mid_table.shape[0], 1, ROWS * column_max(mid_table, 2)), np.float32)
    _q_products(low, mid_rows, mid_table, mid_tscales, mid_format, mid_qs, mid_scales, mid_qs_b, mid_scales_b, mid,
                threads)
    normed = np.empty((H, K), np.float32)
    _after_products(products, mid, low_rank_gate, taps3, ring, gate_a, gate_bias, lower_bound, scale, l2norm_qk,
                    base, pending_k, pending_d, o_norm, eps, g, beta, normed)
    _q_product(normed.reshape((1, H * K)), o_qs, o_scales, o_tscale, o_no_qs, o_no_scales, o_tscale, y, y, threads)


# Serial: its parallel regions are those of the kernels it calls.
@kernel
def kda_decode_step_dense(xs, first_rows, first_table, first_like, mid_rows, mid_table, mid_like, operand_mode,
                          low_operand, low_rank_gate, taps3, ring, gate_a, gate_bias, lower_bound, scale, l2norm_qk,
                          base, pending_k, pending_d, o_norm, eps, o_w, o_operand, y, g, beta):
    """kda_decode_step for a layer whose weights are all f32 or all bf16: the products through
    bf16's `_dense_products` (first_* and mid_* as `dense_table` and the weights' dtype give
    them; xs is x as the tiles read it, `dense_operand`) and the output product through
    `_run_blocks` on o_w [hidden, H*K]; operand_mode (`operand_mode`) turns the rank-K inputs
    and the normed output into the tiles' form, in the buffers low_operand [1-2, *] and
    o_operand [1, *]. y [1, hidden]. The bits of the call-by-call step."""
    H, K = g.shape
    products = np.empty((first_table.shape[0], 1, column_max(first_table, 1)), np.float32)
    _dense_products(xs, first_rows, first_table, first_like, products)
    _operand_into(_low_rank(products, mid_table.shape[0], K), low_operand, operand_mode)
    mid = np.empty((mid_table.shape[0], 1, column_max(mid_table, 1)), np.float32)
    _dense_products(low_operand, mid_rows, mid_table, mid_like, mid)
    normed = np.empty((H, K), np.float32)
    _after_products(products, mid, low_rank_gate, taps3, ring, gate_a, gate_bias, lower_bound, scale, l2norm_qk,
                    base, pending_k, pending_d, o_norm, eps, g, beta, normed)
    _operand_into(normed.reshape((1, H * K)), o_operand, operand_mode)
    _run_blocks(o_w, o_operand, y)


@kernel
def _low_rank(products, n_mid, K):
    """[n_mid, K]: f_a x, and the gate's low rank (rows 3 and 4 of the first products)."""
    low = np.empty((n_mid, K), np.float32)
    for r in range(n_mid):
        low[r] = products[3 + r, 0, :K]
    return low


@kernel
def _after_products(products, mid, low_rank_gate, taps3, ring, gate_a, gate_bias, lower_bound, scale, l2norm_qk,
                    base, pending_k, pending_d, o_norm, eps, g, beta, normed):
    """What a decode step does between its input products and its output product: the q/k/v
    convs, the decay gate, beta, the recurrence and the gated RMSNorm -> normed [H, K]."""
    H, K = g.shape
    HK = H * K
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
    _gated_rmsnorm_kernel(o, gate, o_norm, eps, normed)
