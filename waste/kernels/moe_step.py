"""A decode step's MoE layer in one kernel call, from tables of its experts' addresses.

`ExpertTables` holds a layer's routed experts (by id) and its shared experts as rows of the
tables the one-token kernels read, filled as experts are first handed out; `route_and_sum`
then routes a token and runs and sums its experts in one call: `_moe_one_token` for q formats
(one parallel region: the router, the choice, the gate/up, activation and down stages, their
work shared out by `waste.kernels.steal`), `_dense_moe_one_token` for f32 or bf16 experts.
The experts' arithmetic is `waste.kernels.moe`'s, bit for bit.
"""

from __future__ import annotations

import numpy as np

from waste.jit import kernel, num_threads, parallel_kernel, prange
from waste.kernels.activations import _quantize_token
from waste.kernels.bf16 import dense_operand, operand_buffer, operand_mode
from waste.kernels.dense_batch import dense_table
from waste.kernels.moe import (
    _activate_row,
    _dense_gated_one_token,
    _sum_outputs,
    activation_args,
    dense_together,
    run_together,
)
from waste.kernels.qbatch import QBatch, _fill_items, _take_items
from waste.kernels.quant import ITEM_GROUPS, QMatrix
from waste.kernels.routing import _route, _router_rows, route_one_token
from waste.kernels.serial import row_ids, zero_ids
from waste.kernels.steal import LINE, fetch_add, new_ranges, next_item, set_ranges, wait_until
from waste.qformat import GROUP, ROWS


class ExpertTables:
    """A MoE layer's routed experts (by id) and its shared experts (row E) as rows of the tables
    `_gated_one_token` (q formats) or `_dense_gated_one_token` (f32, bf16) reads, so that a
    decode step whose experts all have rows routes, gathers them and runs them in one kernel
    call (`route_and_sum`) instead of building the tables per step (in the engine, between
    kernels that stream megabytes, that Python cost 50-70 us a layer on the EPYC; routing,
    sorting and gathering by NumPy calls, 15-20 more). Rows are added as experts are
    first handed out (`add`); the tables hold the experts, so the addresses stay valid. `usable`
    turns False for experts that do not run together (formats, shapes: `run_together`,
    `dense_together`)."""

    def __init__(self, num_experts: int, shared: tuple[QMatrix, QMatrix, QMatrix] | None,
                 situ_params: tuple[float | None, float | None] | None):
        rows = num_experts + 1
        self.shared = shared
        self.known = np.zeros(rows, bool)
        self.experts: list[tuple[QMatrix, QMatrix, QMatrix] | None] = [None] * rows
        self.usable = True
        self._kind: tuple[tuple[str, tuple[int, int]], ...] | None = None  # every routed expert's
        self._dense_format: str | None = None  # "f32" or "bf16" for dense experts, None for q ones
        self._args: tuple = ()
        self._activation = activation_args(situ_params)

    def add(self, e: int, expert: tuple[QMatrix, QMatrix, QMatrix]) -> None:
        """Give expert e its rows (the shared experts' too, with the first one)."""
        kind = tuple((m.fmt, m.shape) for m in expert)
        if self._kind is None and self.usable:
            group = [expert] if self.shared is None else [expert, self.shared]
            inner, out = expert[0].shape[0], expert[2].shape[0]
            if run_together(group):
                gates_ups = QBatch([m for x in group for m in x[:2]], checked=True)
                downs = QBatch([x[2] for x in group], checked=True)
                self._args = (gates_ups.first_format, gates_ups.likes, downs.first_format, downs.likes, inner, out)
                width = 4  # a q row: address, shape, format as QBatch.table holds it
            elif dense_together(group):
                self._dense_format = expert[0].fmt
                self._args = (expert[0].buffers["w"][:0], expert[2].buffers["w"][:0], inner, out)
                width = 2  # address and row count (dense_table)
            else:
                self.usable = False
                return
            rows = len(self.known)
            self.gate_up = np.zeros((rows, 2, width), np.int64)
            self.down = np.zeros((rows, width), np.int64)
            self.gate_up_tscales = np.zeros((rows, 2), np.float32)  # q formats only
            self.down_tscales = np.zeros(rows, np.float32)
            self._kind = kind
            if self.shared is not None:
                self._set(rows - 1, self.shared)
        if kind != self._kind:
            self.usable = False
            return
        self._set(e, expert)

    def _set(self, row: int, expert: tuple[QMatrix, QMatrix, QMatrix]) -> None:
        gate, up, down = expert
        if self._dense_format is not None:
            self.gate_up[row] = dense_table([gate, up])
            self.down[row] = dense_table([down])[0]
        else:
            self.gate_up[row] = np.frombuffer(gate._qrow + up._qrow, np.int64).reshape(2, 4)
            self.gate_up_tscales[row] = np.frombuffer(gate._qtscale + up._qtscale, np.float32)
            self.down[row] = np.frombuffer(down._qrow, np.int64)
            self.down_tscales[row] = np.frombuffer(down._qtscale, np.float32)[0]
        self.experts[row] = expert
        self.known[row] = True

    def route_and_sum(self, x: np.ndarray, z: np.ndarray, router: tuple) -> tuple[np.ndarray, np.ndarray,
                                                                                   np.ndarray, np.ndarray | None]:
        """A decode step of the layer in one kernel call: route on x [1, hidden] (router: the
        arguments of `route_one_token` from the weight to `biased`, as MoELayer holds them), then,
        when every chosen expert has rows, sum the experts' outputs on z [1, in] as
        gated_experts_sum_one_token(z, [experts in id order..., shared], their weights) does ->
        (ids [1, k], weights [1, k], ids sorted [k], y [out] or None when an expert has no rows
        or the tables cannot run them). The bits of routing and summing call by call."""
        k = int(router[2])
        ids = np.empty((1, k), np.int64)
        weights = np.empty((1, k), np.float32)
        x = np.ascontiguousarray(x, np.float32)
        if not self.usable or self._kind is None:
            route_one_token(x, *router, ids, weights)
            return ids, weights, np.sort(ids[0]), None
        rows = np.empty(k + (self.shared is not None), np.int64)
        z = np.ascontiguousarray(z, np.float32)
        fmt = self._dense_format
        if fmt is None:
            gu_first, gu_likes, down_first, down_likes, inner, out = self._args
            y = np.zeros(out, np.float32)
            ran = _moe_one_token(x, z, *router, self.known, ids, weights, rows, self.gate_up, self.gate_up_tscales,
                                 gu_first, *gu_likes, self.down, self.down_tscales, down_first, *down_likes, inner,
                                 *self._activation, y, num_threads())
        else:
            gu_like, down_like, inner, out = self._args
            y = np.zeros(out, np.float32)
            ran = _dense_moe_one_token(x, dense_operand(z, fmt), *router, self.known, ids, weights, rows,
                                       self.gate_up, gu_like, self.down, down_like, inner, *self._activation,
                                       operand_mode(fmt), operand_buffer(fmt, len(rows), inner), y)
        return ids, weights, rows[:k].copy(), y if ran else None


@kernel
def _route_rows(x, router_weight, bias, top_k, n_group, topk_group, renormalize, scaling, biased, known, ids, weights,
                rows, row_weights):
    """Route one token x [1, hidden] into ids, weights [1, k] (`route_one_token`); then rows[:k]
    = its ids ascending with row_weights [k] their weights in that order, rows[k] (when there)
    the shared experts' row, the last of `known` [E + 1] -> whether every row is known."""
    route_one_token(x, router_weight, bias, top_k, n_group, topk_group, renormalize, scaling, biased, ids, weights)
    return _sorted_rows(ids, weights, known, rows, row_weights)


@kernel
def _gather_rows(rows, gate_up, down):
    """The gate/up table [2n, W] (rows 2i, 2i + 1: gate and up of rows[i]) and the down table
    [n, W] of the n rows, from ExpertTables' gate_up [E + 1, 2, W] and down [E + 1, W]."""
    n, width = rows.shape[0], down.shape[1]
    gu = np.empty((2 * n, width), np.int64)
    dn = np.empty((n, width), np.int64)
    _gather_into(rows, gate_up, down, gu, dn)
    return gu, dn


@kernel
def _gather_into(rows, gate_up, down, gu, dn):
    """_gather_rows into gu [2n, W] and dn [n, W] (tables of int64, or their tensor scales of
    float32 [2n] and [n] from gate_up [E + 1, 2] and down [E + 1])."""
    for i in range(rows.shape[0]):
        gu[2 * i] = gate_up[rows[i], 0]
        gu[2 * i + 1] = gate_up[rows[i], 1]
        dn[i] = down[rows[i]]


# Experts per router work item of a decode step (`_moe_one_token`): 8 rows of a 2304-wide router
# are 74 KB of float32.
ROUTER_ITEM = 8
# _moe_one_token's counters, each on a cache line of its own (steal.LINE words apart): items done
# per stage, the serial step's completion, whether every routed expert has rows, item counts.
_ROUTED, _SERIAL, _OK, _GATE_UP, _ACTIVATED, _DOWN, _N_GATE_UP, _N_DOWN, _GU_FIRST, _DN_FIRST = (
    LINE * i for i in range(10))


@parallel_kernel
def _moe_one_token(x, z, router_weight, bias, top_k, n_group, topk_group, renormalize, scaling, biased, known, ids,
                   weights, rows, gate_up, gate_up_tscales, gu_first, gu_qs, gu_scales, gu_qs_b, gu_scales_b, down,
                   down_tscales, down_first, down_qs, down_scales, down_qs_b, down_scales_b, inner, use_situ, beta,
                   linear_beta, y, threads):
    """ExpertTables.route_and_sum for q experts -> whether every routed expert had rows (else
    only ids, weights and rows are set): route x (`_route_rows`' router and choice), then y +=
    the weighted sum of the experts' outputs on z, the bits of `_gated_one_token` on the
    gathered rows, in ONE parallel region on `threads` threads.

    The region's stages, each one's items shared out by `waste.kernels.steal` (a thread that
    finds no item left waits for the others at `wait_until`, a spin on a counter, where a
    region per stage would pay a fork and a join): the router's experts in blocks of
    ROUTER_ITEM, with z quantised for the gate/up products as one more item; then, on the thread
    that finishes the last of those, the choice, the row sort and the gathers (serial, short);
    the gate and up products; per expert its activation and quantised down input; the down
    products; then, on the thread that finishes the last down item, the weighted sum. Every
    item is computed by the code of the call-by-call path, so the bits do not depend on the
    thread that takes it."""
    E = router_weight.shape[0]
    k = ids.shape[1]
    n = rows.shape[0]
    out = y.shape[0]
    logits = np.empty((1, E), np.float32)
    row_weights = np.empty(k, np.float32)
    # Gate/up: z quantised once (row 0), the gathered table, outputs.
    G = gu_qs.shape[1]
    xq = np.empty((1, G * GROUP), np.int8)
    xsum = np.empty((1, G), np.int32)
    xs = np.empty((1, G), np.float32)
    gu = np.empty((2 * n, gate_up.shape[2]), np.int64)
    gu_ts = np.empty(2 * n, np.float32)
    gu_rows = zero_ids(2 * n)
    gu_per = max(1, ITEM_GROUPS // G)
    gu_blocks = 0  # row blocks of a gate or up matrix: one shape for all (run_together)
    for r in range(E + 1):
        gu_blocks = max(gu_blocks, gate_up[r, 0, 2])
    gu_out = np.empty((2 * n, 1, ROWS * gu_blocks), np.float32)
    gu_items = 2 * n * ((gu_blocks + gu_per - 1) // gu_per)
    gu_matrix = np.empty(gu_items, np.int64)
    gu_block = np.empty(gu_items, np.int64)
    # Down: each expert's activation quantised (row e), the table, outputs.
    Gd = down_qs.shape[1]
    hq = np.empty((n, Gd * GROUP), np.int8)
    hsum = np.empty((n, Gd), np.int32)
    hs = np.empty((n, Gd), np.float32)
    dn = np.empty((n, down.shape[1]), np.int64)
    dn_ts = np.empty(n, np.float32)
    dn_rows = row_ids(n)
    dn_per = max(1, ITEM_GROUPS // Gd)
    dn_blocks = 0
    for r in range(E + 1):
        dn_blocks = max(dn_blocks, down[r, 2])
    dn_out = np.empty((n, 1, ROWS * dn_blocks), np.float32)
    dn_items = n * ((dn_blocks + dn_per - 1) // dn_per)
    dn_matrix = np.empty(dn_items, np.int64)
    dn_block = np.empty(dn_items, np.int64)
    gate = np.empty((n, inner), np.float32)
    up = np.empty((n, inner), np.float32)
    h = np.empty((n, inner), np.float32)
    outs = np.empty((n, out), np.float32)

    sync = np.zeros(10 * LINE, np.int64)
    n_routed = 1 + (E + ROUTER_ITEM - 1) // ROUTER_ITEM
    routed_words = new_ranges(n_routed, threads)
    activated_words = new_ranges(n, threads)
    gu_words, gu_words_b = new_ranges(0, threads), new_ranges(0, threads)  # set by the serial step
    dn_words, dn_words_b = new_ranges(0, threads), new_ranges(0, threads)
    for t in prange(threads):
        cursor = np.zeros(1, np.int64)
        i = next_item(routed_words, t, cursor)
        while i >= 0:
            if i == 0:
                _quantize_token(z, 0, xq, xsum, xs)
            else:
                e0 = (i - 1) * ROUTER_ITEM
                _router_rows(x, router_weight, logits, 0, e0, min(E, e0 + ROUTER_ITEM))
            if fetch_add(sync, _ROUTED, 1) == n_routed - 1:  # the last one: the serial step
                _route(logits, bias, top_k, n_group, topk_group, renormalize, scaling, biased, ids, weights)
                if _sorted_rows(ids, weights, known, rows, row_weights):
                    _gather_into(rows, gate_up, down, gu, dn)
                    _gather_into(rows, gate_up_tscales, down_tscales, gu_ts, dn_ts)
                    first, total = _fill_items(gu, gu_first, gu_per, gu_matrix, gu_block)
                    set_ranges(gu_words, first)
                    set_ranges(gu_words_b, total - first)
                    sync[_GU_FIRST] = first
                    sync[_N_GATE_UP] = total
                    first, total = _fill_items(dn, down_first, dn_per, dn_matrix, dn_block)
                    set_ranges(dn_words, first)
                    set_ranges(dn_words_b, total - first)
                    sync[_DN_FIRST] = first
                    sync[_N_DOWN] = total
                    sync[_OK] = 1
                fetch_add(sync, _SERIAL, 1)
            i = next_item(routed_words, t, cursor)
        wait_until(sync, _SERIAL, 1)
        if sync[_OK] == 1:
            # Gate and up products, the first format's items then the other's.
            _take_items(t, gu_words, gu_words_b, sync[_GU_FIRST], gu_rows, gu, gu_ts, gu_qs, gu_scales, gu_qs_b,
                        gu_scales_b, gu_out, xq, xsum, xs, gu_matrix, gu_block, gu_per, sync, _GATE_UP,
                        sync[_N_GATE_UP])
            wait_until(sync, _GATE_UP, sync[_N_GATE_UP])
            # Per expert: the activation and its quantised row for the down products.
            cursor[0] = 0
            e = next_item(activated_words, t, cursor)
            while e >= 0:
                gate[e] = gu_out[2 * e, 0, :inner]
                up[e] = gu_out[2 * e + 1, 0, :inner]
                _activate_row(gate, up, use_situ, beta, linear_beta, h, e)
                _quantize_token(h, e, hq, hsum, hs)
                fetch_add(sync, _ACTIVATED, 1)
                e = next_item(activated_words, t, cursor)
            wait_until(sync, _ACTIVATED, n)
            # Down products, the first format's items then the other's; the thread that
            # finishes the last one sums the outputs.
            if _take_items(t, dn_words, dn_words_b, sync[_DN_FIRST], dn_rows, dn, dn_ts, down_qs, down_scales,
                           down_qs_b, down_scales_b, dn_out, hq, hsum, hs, dn_matrix, dn_block, dn_per, sync, _DOWN,
                           sync[_N_DOWN]):
                _sum_outputs(dn_out, row_weights, outs, y)
    return sync[_OK] == 1


@kernel
def _sorted_rows(ids, weights, known, rows, row_weights):
    """rows[:k] = a token's routed ids [1, k] ascending, row_weights [k] their weights [1, k] in
    that order, rows[k] (when there) the shared experts' row, the last of `known` [E + 1] ->
    whether every row is known."""
    k = ids.shape[1]
    for i in range(k):  # insertion sort of the distinct ids, carrying their weights
        e, w = ids[0, i], weights[0, i]
        j = i
        while j > 0 and rows[j - 1] > e:
            rows[j], row_weights[j] = rows[j - 1], row_weights[j - 1]
            j -= 1
        rows[j], row_weights[j] = e, w
    if rows.shape[0] > k:
        rows[k] = known.shape[0] - 1
    for r in rows:
        if not known[r]:
            return False
    return True


@kernel
def _dense_moe_one_token(x, zs, router_weight, bias, top_k, n_group, topk_group, renormalize, scaling, biased, known,
                         ids, weights, rows, gate_up, gu_like, down, down_like, inner, use_situ, beta, linear_beta,
                         operand_mode, hs, y):
    """_moe_one_token for f32 or bf16 experts (`_dense_gated_one_token`; zs: z as the tiles read it)."""
    row_weights = np.empty(ids.shape[1], np.float32)
    if not _route_rows(x, router_weight, bias, top_k, n_group, topk_group, renormalize, scaling, biased, known, ids,
                       weights, rows, row_weights):
        return False
    gu, dn = _gather_rows(rows, gate_up, down)
    outs = np.empty((rows.shape[0], y.shape[0]), np.float32)
    _dense_gated_one_token(zs, gu, gu_like, dn, down_like, inner, use_situ, beta, linear_beta, operand_mode, hs, outs,
                           row_weights, y)
    return True
