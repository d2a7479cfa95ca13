"""The SwiGLU and SiTU experts over QMatrix weights: one expert, or a MoE layer's experts in a
few kernel calls (a decode step's on its token, a prefill's on the tokens routed to each).
Routing is `waste.kernels.routing`.

K3's SiTU (FACTS.md), in float32: act(g, u) = b tanh(g / b) sigmoid(g) * (bl tanh(u / bl)), where
b = situ_beta (1 when null) and the second factor is plain u when situ_linear_beta is null.

Shapes: x [T, in]; expert weights gate/up [I, in], down [out, I].
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from waste.errors import WasteError
from waste.jit import kernel, num_threads, parallel_kernel, prange
from waste.kernels.bf16 import DENSE_FORMATS, _operand_into, dense_operand, operand_buffer, operand_mode
from waste.kernels.dense_batch import DenseBatch, _dense_products, dense_table
from waste.kernels.qbatch import QBatch, _q_products
from waste.kernels.quant import Q_FORMATS, QMatrix, matmul_pair
from waste.kernels.serial import column_max, row_ids, zero_ids
from waste.qformat import ROWS


@kernel
def _silu_mul(gate, up, out):
    T, n = gate.shape
    one = np.float32(1.0)
    for t in range(T):
        for i in range(n):
            g = gate[t, i]
            out[t, i] = g / (one + np.exp(-g)) * up[t, i]


@kernel
def _tanh(y):
    """tanh of a float32 within 3 ulp, as -m / (2 + m) with m = expm1(-2|y|), which does not
    cancel near 0. libm's tanhf, which np.tanh calls, took a third of k3-mini's prefill; expm1f
    costs less. NaN gives NaN; +-inf gives +-1."""
    m = np.expm1(np.float32(-2.0) * abs(y))
    t = -m / (np.float32(2.0) + m)
    return -t if y < 0 else t


# linear_beta 0 stands for a null linear beta (plain u): situ_betas refuses 0 as a real value.
@kernel
def _situ(g, u, beta, linear_beta, out):
    """out = SiTU(g, u) over flat float32 arrays [n]."""
    one = np.float32(1.0)
    b = np.float32(beta)
    lb = np.float32(linear_beta)
    for i in range(g.size):
        x = g[i]
        # exp(-x) overflows to inf for x < -88: the sigmoid is then 0 and so is the product.
        a = b * _tanh(x / b) / (one + np.exp(-x))
        v = u[i]
        if lb > 0:
            v = lb * _tanh(v / lb)
        out[i] = a * v


# Elements of a SiTU from which it runs on all cores, in blocks of SITU_BLOCK: at 10-25 ns an
# element (two expm1f and an expf), 4096 take 40-100 us, more than entering the thread pool.
SITU_BLOCK = 4096


@parallel_kernel
def _situ_blocks(g, u, beta, linear_beta, out):
    """_situ over flat arrays [n] in blocks of SITU_BLOCK on all cores (elementwise: the same bits)."""
    n = g.size
    for blk in prange((n + SITU_BLOCK - 1) // SITU_BLOCK):
        start = blk * SITU_BLOCK
        end = min(n, start + SITU_BLOCK)
        _situ(g[start:end], u[start:end], beta, linear_beta, out[start:end])


def situ_betas(beta: float | None, linear_beta: float | None) -> tuple[float, float]:
    """The SiTU kernel's (beta, linear_beta): null beta is 1.0, null linear_beta is 0.0 (plain u)."""
    b = 1.0 if beta is None else float(beta)
    if not 0 < b < math.inf:
        raise WasteError(f"SiTU beta must be a positive finite number or null, got {beta}")
    if linear_beta is None:
        return b, 0.0
    if not 0 < float(linear_beta) < math.inf:
        raise WasteError(f"SiTU linear_beta must be a positive finite number or null, got {linear_beta}")
    return b, float(linear_beta)


def activation_args(situ_params: tuple[float | None, float | None] | None) -> tuple[bool, float, float]:
    """(use_situ, beta, linear_beta) of the kernels that take either activation: SwiGLU for
    situ_params None, else SiTU with `situ_betas`."""
    if situ_params is None:
        return False, 1.0, 0.0
    return (True, *situ_betas(*situ_params))


def situ(g: np.ndarray, u: np.ndarray, beta: float | None, linear_beta: float | None) -> np.ndarray:
    """SiTU(g, u) elementwise, float32, for gate and up values g, u of one shape."""
    g = np.ascontiguousarray(g, np.float32)
    u = np.ascontiguousarray(u, np.float32)
    if g.shape != u.shape:
        raise WasteError(f"SiTU gate and up must have the same shape, got {g.shape} and {u.shape}")
    out = np.empty_like(g)
    run = _situ_blocks if g.size > SITU_BLOCK else _situ
    run(g.reshape(-1), u.reshape(-1), *situ_betas(beta, linear_beta), out.reshape(-1))
    return out


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SiLU(gate) * up elementwise, float32 [T, I]."""
    gate = np.ascontiguousarray(gate, np.float32)
    up = np.ascontiguousarray(up, np.float32)
    if gate.shape != up.shape or gate.ndim != 2:
        raise WasteError(f"SwiGLU gate and up must be equal [T, I] arrays, got {gate.shape} and {up.shape}")
    out = np.empty_like(gate)
    _silu_mul(gate, up, out)
    return out


def swiglu(x: np.ndarray, w_gate: QMatrix, w_up: QMatrix, w_down: QMatrix) -> np.ndarray:
    """down(SiLU(gate x) * up x): x [T, in] -> [T, out], each projection one matmul over the rows."""
    x = np.ascontiguousarray(x, np.float32)
    gate, up = matmul_pair(x, w_gate, w_up)  # contiguous float32 [T, I]: silu_mul's checks but the shapes
    if gate.shape != up.shape:
        raise WasteError(f"SwiGLU gate and up must be equal [T, I] arrays, got {gate.shape} and {up.shape}")
    h = np.empty_like(gate)
    _silu_mul(gate, up, h)
    return w_down.matmul(h)


def situ_mlp(x: np.ndarray, w_gate: QMatrix, w_up: QMatrix, w_down: QMatrix, beta: float | None,
             linear_beta: float | None) -> np.ndarray:
    """down(SiTU(gate x, up x)): x [T, in] -> [T, out], each projection one matmul over the rows."""
    x = np.ascontiguousarray(x, np.float32)
    gate, up = matmul_pair(x, w_gate, w_up)
    return w_down.matmul(situ(gate, up, beta, linear_beta))


@kernel
def _activate_rows(gate, up, use_situ, beta, linear_beta, out):
    """out[e] = act(gate[e], up[e]) for each row e of [E, I] arrays: each row through the very
    call, on arrays of the very types, that swiglu and situ_mlp make for one token."""
    for e in range(gate.shape[0]):
        _activate_row(gate, up, use_situ, beta, linear_beta, out, e)


@kernel
def _activate_row(gate, up, use_situ, beta, linear_beta, out, e):
    """Row e of _activate_rows."""
    if use_situ:
        _situ(gate[e], up[e], beta, linear_beta, out[e])
    else:
        _silu_mul(gate[e:e + 1], up[e:e + 1], out[e:e + 1])


@parallel_kernel
def _activate_rows_parallel(gate, up, use_situ, beta, linear_beta, out):
    """_activate_rows with the rows shared out between the cores (a prefill's experts' rows)."""
    for e in prange(gate.shape[0]):
        _activate_row(gate, up, use_situ, beta, linear_beta, out, e)


# Elements of a SwiGLU activation from which _activate_rows runs on all cores: 2-3 ns an element
# (an expf and a division), so 16384 take 30-50 us, several times the thread pool's entry.
PARALLEL_ACTIVATION = 16384


# fastmath off: no fused multiply-add, so each product is rounded to float32 before the sum.
@kernel(fastmath=False)
def _add_weighted_rows(y, rows, weights, outs):
    """y[rows[i]] += weights[i] * outs[i] for i = 0, 1, .. in turn, in float32."""
    for i in range(rows.shape[0]):
        r = rows[i]
        w = weights[i]
        for j in range(y.shape[1]):
            y[r, j] += w * outs[i, j]


def add_weighted_rows(y: np.ndarray, rows: np.ndarray, weights: np.ndarray, outs: np.ndarray) -> None:
    """y[rows[i]] += weights[i] * outs[i] for each i in turn, in float32: the bits of NumPy's
    `y[rows] += weights[:, None] * outs` (rows distinct), in one call without temporaries (a
    prefill adds each expert's outputs to its tokens' rows: three NumPy operations an expert
    took 14-20 ms of a 256-token `mini` prefill of 165 ms). y [T, N], rows [n] int64 in [0, T),
    weights [n] float32, outs [n, N] float32."""
    if (y.dtype != np.float32 or outs.dtype != np.float32 or y.ndim != 2 or outs.shape != (len(rows), y.shape[1])
            or len(weights) != len(rows)):
        raise WasteError(f"add_weighted_rows: float32 y [T, N], outs [n, N] and n rows and weights expected, got "
                         f"{y.shape}, {outs.shape}, {len(rows)} and {len(weights)}")
    _add_weighted_rows(y, np.asarray(rows, np.int64), np.asarray(weights, np.float32), outs)


# fastmath off: no fused multiply-add, so each product is rounded to float32 before the sum.
@kernel(fastmath=False)
def _add_weighted(outs, weights, y):
    for e in range(outs.shape[0]):
        w = weights[e]
        for j in range(y.shape[0]):
            y[j] += w * outs[e, j]


@kernel
def _weighted_sum(outs, weights, y):
    """y += weights[e] outs[e] for the first len(weights) rows in turn, then += outs[e] of each
    later one (1 w = w: the bits of y += w), all through `_add_weighted`."""
    n = weights.size
    _add_weighted(outs[:n], weights, y)
    _add_weighted(outs[n:], np.ones(outs.shape[0] - n, np.float32), y)


def add_weighted(y: np.ndarray, outs: np.ndarray, weights: np.ndarray) -> None:
    """y += weights[e] * outs[e] for e = 0, 1, .. in turn, in float32: the bits of NumPy's
    `y += w * out` row by row, in one call; y [N], outs [E, N], weights [E], float32."""
    if y.dtype != np.float32 or outs.dtype != np.float32 or outs.shape[1:] != y.shape or y.ndim != 1:
        raise WasteError(f"add_weighted: float32 y [N] and outs [E, N] expected, got {y.shape} and {outs.shape}")
    _add_weighted(np.ascontiguousarray(outs), np.ascontiguousarray(weights, np.float32), y)


def run_together(experts: Sequence[tuple[QMatrix, QMatrix, QMatrix]]) -> bool:
    """Whether gated_experts_one_token runs these experts together: their gate and up matrices
    q matrices of one shape and at most two formats (a q4 layer's q4g routed experts with its
    q8g shared expert), and their down matrices too (`batchable`, with one shape)."""
    for kinds in ({(m.fmt, m.shape) for e in experts for m in e[:2]}, {(e[2].fmt, e[2].shape) for e in experts}):
        if len(kinds) > 2 or len({shape for _, shape in kinds}) != 1 or any(f not in Q_FORMATS for f, _ in kinds):
            return False
    return True


# Serial: its parallel regions are those of the kernels it calls.
@kernel
def _gated_one_token(x, gu_table, gu_tscales, gu_first, gu_qs, gu_scales, gu_qs_b, gu_scales_b,
                     down_table, down_tscales, down_first, down_qs, down_scales, down_qs_b, down_scales_b,
                     inner, use_situ, beta, linear_beta, outs, weights, y, threads):
    """outs [E, out] = the gated MLPs of E experts [inner, in] -> [out, inner] on one token x
    [1, in]: every gate and up product (rows 2e and 2e + 1 of the gate/up table) in one
    parallel region, the activations, every down product in another, all in one call (each
    product `_q_products`, each argument triple (table, tscales, first format) and likes as a
    QBatch holds them). When y [out] is not empty, also y += weights[e] outs[e] for the first
    len(weights) experts in turn (`_add_weighted`), then += outs[e] of each later one."""
    n = outs.shape[0]
    gate_up = np.empty((2 * n, 1, ROWS * column_max(gu_table, 2)), np.float32)
    _q_products(x, zero_ids(2 * n), gu_table, gu_tscales, gu_first, gu_qs, gu_scales, gu_qs_b,
                gu_scales_b, gate_up, threads)
    # Contiguous [E, inner] gate and up, as swiglu and situ_mlp hand the activation.
    gate = np.empty((n, inner), np.float32)
    up = np.empty((n, inner), np.float32)
    for e in range(n):
        gate[e] = gate_up[2 * e, 0, :inner]
        up[e] = gate_up[2 * e + 1, 0, :inner]
    h = np.empty((n, inner), np.float32)
    _activate_rows(gate, up, use_situ, beta, linear_beta, h)
    down = np.empty((n, 1, ROWS * column_max(down_table, 2)), np.float32)
    _q_products(h, row_ids(n), down_table, down_tscales, down_first, down_qs, down_scales, down_qs_b,
                down_scales_b, down, threads)
    _sum_outputs(down, weights, outs, y)


def gated_experts_one_token(x: np.ndarray, experts: Sequence[tuple[QMatrix, QMatrix, QMatrix]],
                            situ_params: tuple[float | None, float | None] | None) -> np.ndarray | None:
    """The gated MLPs of several experts on one token x [1, in] -> [E, out], row e equal bit for
    bit to swiglu(x, *experts[e]) (situ_params None) or situ_mlp(x, *experts[e], *situ_params)
    (situ_params = (beta, linear_beta)).

    For q matrices, one kernel call whatever the number of experts (`_gated_one_token`): every
    expert's gate and up rows in one parallel region (x quantised once), the activations,
    every down product in one more region; one by one, each expert takes four calls and two
    parallel regions of 16-64 row blocks. For f32 or bf16 experts, one call too
    (`_dense_gated_one_token`). None when the experts are neither q matrices of one shape and at
    most two formats per projection (`run_together`) nor float matrices of one format and
    shape (`dense_together`): the caller runs them one by one.
    """
    return _one_token(x, experts, situ_params, None)


def gated_experts_sum_one_token(x: np.ndarray, experts: Sequence[tuple[QMatrix, QMatrix, QMatrix]],
                                weights: np.ndarray, situ_params: tuple[float | None, float | None] | None
                                ) -> np.ndarray | None:
    """y [out] = sum of weights[e] times expert e's output for the first len(weights) experts,
    then plus the output of each later one (a decode step's routed experts in id order, then
    its shared ones), in that order in float32: the bits of `add_weighted` and `+=` over the
    rows of gated_experts_one_token, in the same single call. None as gated_experts_one_token."""
    return _one_token(x, experts, situ_params, np.ascontiguousarray(weights, np.float32))


def _one_token(x: np.ndarray, experts: Sequence[tuple[QMatrix, QMatrix, QMatrix]],
               situ_params: tuple[float | None, float | None] | None, weights: np.ndarray | None) -> np.ndarray | None:
    """gated_experts_one_token's rows (weights None), or gated_experts_sum_one_token's sum."""
    if weights is not None and not weights.shape[0] <= len(experts):
        raise WasteError(f"{weights.shape[0]} weights for {len(experts)} experts")
    together = run_together(experts)
    if not together and not dense_together(experts):
        return None
    (inner, width), out = experts[0][0].shape, experts[0][2].shape[0]
    x = np.ascontiguousarray(x, np.float32)
    if x.shape != (1, width) or experts[0][2].shape[1] != inner:
        raise WasteError(f"experts [{inner}, {width}] -> [{out}, {experts[0][2].shape[1]}] cannot take x {x.shape}")
    if not together:
        return _dense_one_token(x, experts, situ_params, weights)
    gates_ups = QBatch([m for e in experts for m in e[:2]], checked=True)
    downs = QBatch([e[2] for e in experts], checked=True)
    outs = np.empty((len(experts), out), np.float32)
    y = np.zeros(0 if weights is None else out, np.float32)
    _gated_one_token(x, gates_ups.table, gates_ups.tscales, gates_ups.first_format, *gates_ups.likes,
                     downs.table, downs.tscales, downs.first_format, *downs.likes,
                     inner, *activation_args(situ_params), outs, _NO_WEIGHTS if weights is None else weights, y,
                     num_threads())
    return outs if weights is None else y


_NO_WEIGHTS = np.zeros(0, np.float32)


@kernel
def _sum_outputs(down, weights, outs, y):
    """outs[e] = the down products' rows down [n, 1, W]; when y is not empty, y += their
    weighted sum (`_weighted_sum`)."""
    for e in range(outs.shape[0]):
        outs[e] = down[e, 0, :outs.shape[1]]
    if y.size:
        _weighted_sum(outs, weights, y)


def dense_together(experts: Sequence[tuple[QMatrix, QMatrix, QMatrix]]) -> bool:
    """Whether gated_experts_one_token runs these float experts together: every matrix f32, or
    every one bf16, the gate and up matrices of one shape and the down matrices of one shape."""
    gates_ups, downs = {(m.fmt, m.shape) for e in experts for m in e[:2]}, {(e[2].fmt, e[2].shape) for e in experts}
    return (len(gates_ups) == len(downs) == 1 and next(iter(gates_ups))[0] == next(iter(downs))[0]
            and next(iter(gates_ups))[0] in DENSE_FORMATS)


def _dense_one_token(x: np.ndarray, experts: Sequence[tuple[QMatrix, QMatrix, QMatrix]],
                     situ_params: tuple[float | None, float | None] | None, weights: np.ndarray | None
                     ) -> np.ndarray:
    """_one_token for f32 or bf16 experts (`dense_together`), in one call
    (`_dense_gated_one_token`)."""
    fmt, n, inner, out = experts[0][0].fmt, len(experts), experts[0][0].shape[0], experts[0][2].shape[0]
    gates_ups, downs = [m for e in experts for m in e[:2]], [e[2] for e in experts]
    outs = np.empty((n, out), np.float32)
    y = np.zeros(0 if weights is None else out, np.float32)
    _dense_gated_one_token(dense_operand(x, fmt), dense_table(gates_ups), gates_ups[0].buffers["w"][:0],
                           dense_table(downs), downs[0].buffers["w"][:0], inner, *activation_args(situ_params),
                           operand_mode(fmt), operand_buffer(fmt, n, inner), outs,
                           _NO_WEIGHTS if weights is None else weights, y)
    return outs if weights is None else y


# Serial: its parallel regions are those of the kernels it calls.
@kernel
def _dense_gated_one_token(xs, gu_table, gu_like, down_table, down_like, inner, use_situ, beta, linear_beta,
                           operand_mode, hs, outs, weights, y):
    """_gated_one_token for E f32 or bf16 experts (one format): every gate and up product (rows
    2e and 2e + 1 of gu_table, `dense_table`) in one parallel region on xs (x as the tiles read
    it), the activations, written into hs in the same form (`_operand_into`), every down
    product in one more region; y += the weighted rows as there. Each row the bits of swiglu /
    situ_mlp, the sum those of add_weighted and += (the calls and arrays of dense_products)."""
    n, out = outs.shape
    gate_up = np.empty((2 * n, 1, column_max(gu_table, 1)), np.float32)
    _dense_products(xs, zero_ids(2 * n), gu_table, gu_like, gate_up)
    gate = np.empty((n, inner), np.float32)
    up = np.empty((n, inner), np.float32)
    for e in range(n):
        gate[e] = gate_up[2 * e, 0, :inner]
        up[e] = gate_up[2 * e + 1, 0, :inner]
    h = np.empty((n, inner), np.float32)
    _activate_rows(gate, up, use_situ, beta, linear_beta, h)
    _operand_into(h, hs, operand_mode)
    down = np.empty((n, 1, column_max(down_table, 1)), np.float32)
    _dense_products(hs, row_ids(n), down_table, down_like, down)
    for e in range(n):
        outs[e] = down[e, 0, :out]
    if y.size:
        _weighted_sum(outs, weights, y)


def gated_experts(x: np.ndarray, experts: Sequence[tuple[QMatrix, QMatrix, QMatrix]], x_start: np.ndarray,
                  count: np.ndarray, situ_params: tuple[float | None, float | None] | None,
                  take: np.ndarray | None = None, prepared: dict | None = None) -> np.ndarray | None:
    """The gated MLPs of several experts, each on its own run of rows of x [R, in]: expert e on
    x[x_start[e]:x_start[e] + count[e]] -> [sum(count), out], expert e's rows after those of the
    experts before it, equal bit for bit to swiglu(x[its rows], *experts[e]) (situ_params None)
    or situ_mlp(x[its rows], *experts[e], *situ_params) (situ_params = (beta, linear_beta)).
    With `take` (int64 row ids into x), the rows are those of x[take] instead: a prefill's
    tokens, each routed to several experts, are then quantised (q experts) or rounded to bf16
    once each rather than once per expert (the same bits: each row is prepared on its own),
    and once per chunk when the caller keeps a dict `prepared` for this x across its calls.

    Three kernel calls whatever the number of experts (a decode step's experts on its one token,
    or a prefill's on the tokens routed to each): every expert's gate and up products in one
    parallel region (qbatch `_q_products` when every expert has one row, else `_q_spans`; each
    row of x quantised once; f32 or bf16 experts through `waste.kernels.dense_batch.DenseBatch` alike), the
    activations, every down product in one more region. None when the experts are neither q
    matrices of one shape and at most two formats per projection (`run_together`) nor float
    matrices of one format and shape (`dense_together`): the caller runs them one by one.
    x_start, count [E] int64, the runs inside x (the caller's promise: unchecked).
    """
    if run_together(experts):
        batch: type[QBatch] | type[DenseBatch] = QBatch
    elif dense_together(experts):
        batch = DenseBatch
    else:
        return None
    n = len(experts)
    (inner, width), out = experts[0][0].shape, experts[0][2].shape[0]
    x = np.ascontiguousarray(x, np.float32)
    if x.ndim != 2 or x.shape[1] != width or experts[0][2].shape[1] != inner:
        raise WasteError(f"experts [{inner}, {width}] -> [{out}, {experts[0][2].shape[1]}] cannot take x {x.shape}")
    gates_ups, downs = batch([m for e in experts for m in e[:2]]), batch([e[2] for e in experts])
    one_row_each = bool((count == 1).all())  # a decode step's: the one-row driver, measured faster
    gathered = None
    if take is not None and one_row_each:
        x = np.ascontiguousarray(x[take])
    elif take is not None:
        # What x's rows become before the products: the same for every batch of one chunk's
        # experts (q: the groups of their width; f32 and bf16: the format).
        key = ("q", gates_ups.likes[0].shape[1]) if batch is QBatch else ("dense", gates_ups.fmt)
        whole = prepared.get(key) if prepared is not None else None
        if whole is None:
            whole = gates_ups.prepare(x)
            if prepared is not None:
                prepared[key] = whole
        gathered = tuple(np.ascontiguousarray(a[take]) for a in whole)
    if one_row_each:
        gate_up = gates_ups(x, np.repeat(x_start, 2)).reshape(n, 2, -1)
        gate, up = np.ascontiguousarray(gate_up[:, 0, :inner]), np.ascontiguousarray(gate_up[:, 1, :inner])
    else:
        y_start = np.zeros(n, np.int64)
        np.cumsum(count[:-1], out=y_start[1:])
        rows = int(y_start[-1] + count[-1])
        # Gate e's rows at y_start[e], up e's at rows + y_start[e]: gate and up as two [rows, W] blocks.
        both = np.stack([y_start, y_start + rows], axis=1).reshape(-1)
        if gathered is None:
            gate_up = gates_ups.spans(x, np.repeat(x_start, 2), np.repeat(count, 2), both, 2 * rows)
        else:
            gate_up = gates_ups.prepared_spans(gathered, np.repeat(x_start, 2), np.repeat(count, 2), both, 2 * rows)
        gate, up = np.ascontiguousarray(gate_up[:rows, :inner]), np.ascontiguousarray(gate_up[rows:, :inner])
    h = np.empty_like(gate)
    use_situ, beta, linear_beta = activation_args(situ_params)
    if use_situ and gate.size > SITU_BLOCK:  # a prefill's: on all cores
        _situ_blocks(gate.reshape(-1), up.reshape(-1), beta, linear_beta, h.reshape(-1))
    elif gate.size > PARALLEL_ACTIVATION:
        _activate_rows_parallel(gate, up, use_situ, beta, linear_beta, h)
    else:
        _activate_rows(gate, up, use_situ, beta, linear_beta, h)
    if one_row_each:
        return downs(h, np.arange(n, dtype=np.int64))[:, :out]
    return downs.spans(h, y_start, count, y_start, rows)[:, :out]
