"""Many q matrices in one kernel call: a decode step's batch of small products, each on one
row of its input (`_q_products`), or a prefill's experts, each on its own run of rows
(`_q_spans`); `QBatch` builds what the calls read (addresses, row blocks, formats) once. The
row blocks themselves are `waste.kernels.quant`'s; the work items are shared out between the
threads by `waste.kernels.steal`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np

from waste.errors import WasteError
from waste.jit import kernel, num_threads, parallel_kernel, prange
from waste.kernels.activations import _quantize_token, quantized_activations
from waste.kernels.pointers import pointer
from waste.kernels.quant import ITEM_GROUPS, Q_FORMATS, SERIAL_BYTES, QMatrix, _rows, _rows_one
from waste.kernels.steal import fetch_add, new_ranges, next_item
from waste.qformat import GROUP, ROWS


def batchable(matrices: Sequence[QMatrix]) -> bool:
    """Whether q_products multiplies these matrices in one call: q matrices (q8g, q4g, mxfp4) of
    at most two formats and one input width K (any number of rows each)."""
    kinds = {(m.fmt, m.shape[1]) for m in matrices}
    return (len({k for _, k in kinds}) == 1 and len({f for f, _ in kinds}) <= 2
            and all(f in Q_FORMATS for f, _ in kinds))


class QBatch:
    """A fixed list of q matrices multiplied in one kernel call (`_q_products` for a decode step,
    `_q_spans` for a prefill), with everything the call derives from the matrices (addresses, row
    blocks, formats, scales) built once: a decode step runs the same products on every token, a
    MoE prefill every expert of a layer. Holds the matrices, so the addresses stay valid.

    `QBatch(matrices)(X, rows)` -> Y [M, Nmax]: Y[m, :N_m] = W_m X[rows[m]], bit for bit
    W_m.matvec(X[rows[m]]) (decode). `.spans(X, x_start, count, y_start, out_rows)` -> Y
    [out_rows, Nmax]: Y[y_start[m] + j, :N_m] = W_m X[x_start[m] + j] for j < count[m], bit for
    bit W_m.matmul(X[x_start[m]:x_start[m] + count[m]]) (the experts of a prefill, each on its
    own rows). Y is a fresh array per call."""

    def __init__(self, matrices: Sequence[QMatrix], *, checked: bool = False):
        """`checked`: the caller has seen `batchable(matrices)` hold (a decode step's experts,
        `waste.kernels.moe.run_together`), which is then not tested again."""
        if not checked and (not matrices or not batchable(matrices)):
            raise WasteError("q_products multiplies q matrices (q8g, q4g, mxfp4) of at most two formats and one "
                             "input width, got " + ", ".join(sorted({f"{m.fmt} {m.shape}" for m in matrices})))
        self.matrices = list(matrices)
        self.k = matrices[0].shape[1]
        # [M, 4]: codes' address, scales' address, row blocks of 16, format (index in Q_FORMATS)
        rows = bytearray(b"".join([m._qrow for m in matrices]))
        self.table = np.frombuffer(rows, np.int64).reshape(-1, 4)
        tscales = bytearray(b"".join([m._qtscale for m in matrices]))
        self.tscales = np.frombuffer(tscales, np.float32)  # [M]
        first = matrices[0]
        other = next((m for m in matrices if m.fmt != first.fmt), first)
        self.first_format = Q_FORMATS.index(first.fmt)
        # (codes, scales) that hold no rows, one pair per format: they pick each format's kernel
        self.likes = (*first._qargs[4:], *other._qargs[4:])
        self.width = max(m._qargs[3] for m in matrices)  # rows padded to 16

    def __call__(self, X: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """X [R, K] float32 C-contiguous, rows [M] int64 in [0, R) (the caller's promise: unchecked)."""
        Y = np.empty((len(self.matrices), 1, self.width), np.float32)
        _q_products(X, rows, self.table, self.tscales, self.first_format, *self.likes, Y, num_threads())
        return Y[:, 0]

    def spans(self, X: np.ndarray, x_start: np.ndarray, count: np.ndarray, y_start: np.ndarray,
              out_rows: int) -> np.ndarray:
        """X [R, K] float32 C-contiguous; x_start, count, y_start [M] int64 with every span inside X
        and inside the out_rows output rows (the caller's promise: unchecked)."""
        return self.prepared_spans(self.prepare(X), x_start, count, y_start, out_rows)

    def prepare(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(xq, xsum, xs) of X [R, K] float32 C-contiguous, as the products read it: each row
        quantised on its own, so the rows of a gather of X are the gather of these rows."""
        return quantized_activations(X, self.likes[0].shape[1])

    def prepared_spans(self, prepared: tuple[np.ndarray, np.ndarray, np.ndarray], x_start: np.ndarray,
                       count: np.ndarray, y_start: np.ndarray, out_rows: int) -> np.ndarray:
        """`spans` on rows already quantised (`prepare`, or rows gathered from its arrays,
        C-contiguous)."""
        Y = np.empty((out_rows, self.width), np.float32)
        _q_spans(*prepared, x_start, count, y_start, self.table, self.tscales, self.first_format, *self.likes, Y,
                 num_threads())
        return Y


def q_products(X: np.ndarray, matrices: Sequence[QMatrix], rows: Sequence[int]) -> np.ndarray:
    """Y [M, Nmax] with Y[m, :N_m] = W_m X[rows[m]], for X [R, K] float32 and M q matrices W_m
    [N_m, K] of at most two formats (`batchable`), in one kernel call (`_q_products`); Nmax is
    the largest N_m, and Y[m, N_m:] is left unspecified. Y[m, :N_m] equals
    W_m.matvec(X[rows[m]]) bit for bit."""
    batch = QBatch(matrices)
    X = np.ascontiguousarray(X, np.float32)
    rows = [int(r) for r in rows]
    if X.ndim != 2 or X.shape[1] != batch.k or len(rows) != len(matrices) or min(rows) < 0 or max(rows) >= len(X):
        raise WasteError(f"q matrices of width {batch.k}: inputs must be [R, {batch.k}] with row ids in [0, R) "
                         f"for each of {len(matrices)} matrices, got {X.shape} and {len(rows)} row ids")
    return batch(X, np.array(rows, np.int64))[:, :max(m.shape[0] for m in matrices)]


def q_spans(X: np.ndarray, matrices: Sequence[QMatrix], x_start: Sequence[int], count: Sequence[int],
            y_start: Sequence[int], out_rows: int) -> np.ndarray:
    """Y [out_rows, Nmax] with Y[y_start[m] + j, :N_m] = W_m X[x_start[m] + j] for j < count[m]:
    each of M q matrices W_m [N_m, K] (at most two formats, `batchable`) on its own run of rows
    of X [R, K] float32, in one kernel call (`_q_spans`). Rows of Y that no span writes, and
    Y[:, N_m:] of a span's rows, are left unspecified. Each span's rows equal
    W_m.matmul(X[x_start[m]:x_start[m] + count[m]]) bit for bit."""
    batch = QBatch(matrices)
    X = np.ascontiguousarray(X, np.float32)
    a, n, b = (np.array([int(v) for v in s], np.int64).reshape(-1) for s in (x_start, count, y_start))
    M = len(matrices)
    if (X.ndim != 2 or X.shape[1] != batch.k or not len(a) == len(n) == len(b) == M or (n < 0).any()
            or (a < 0).any() or (a + n > len(X)).any() or (b < 0).any() or (b + n > out_rows).any()):
        raise WasteError(f"q matrices of width {batch.k}: inputs must be [R, {batch.k}] with {M} spans of rows "
                         f"inside them and inside {out_rows} output rows, got {X.shape}")
    return batch.spans(X, a, n, b, int(out_rows))[:, :max(m.shape[0] for m in matrices)]




@parallel_kernel
def _q_products(X, rows, table, tscales, first_format, like_qs, like_scales, like_qs_b, like_scales_b, Y,
                threads):
    """Y[m, 0, :16 NB_m] = X[rows[m]] W_m^T for M q matrices of one input width (G groups) and at
    most two formats. table [M, 4] (QBatch) holds per matrix the addresses of its codes and
    scales, its row blocks NB_m and its format: where that is first_format the matrix is read
    as (like_qs, like_scales), else as (like_qs_b, like_scales_b) (arrays of each format's
    dtypes and block size that hold no rows); tscales [M], Y [M, 1, W], W >= 16 max NB_m. Each
    row of X is quantised once, then the row blocks of all the matrices run in one parallel
    region, shared out between `threads` (numba.get_num_threads(); `waste.kernels.steal`).

    One decode step multiplies many small matrices (a MoE layer's experts, a KDA layer's six
    input projections), and a call and a parallel region per product cost microseconds each
    against products of 10-60 us (`bench/moe_decode.py` measures a MoE layer's experts in one
    call against one by one; docs/MEASURED.md). The callers keep the matrices alive during the call: the kernel reads
    them by address. `_q_spans` does the same for runs of rows (a prefill's experts); decode
    keeps this driver, measured 10-15% faster on one token (nine down products of `mini` q4:
    39 against 45 us on one thread, 23-24 against 28-29 on two)."""
    R = X.shape[0]
    M = table.shape[0]
    G = like_qs.shape[1]
    xq = np.empty((R, G * GROUP), np.int8)
    xsum = np.empty((R, G), np.int32)
    xs = np.empty((R, G), np.float32)
    for r in range(R):
        _quantize_token(X, r, xq, xsum, xs)
    # Work item i is row block item_block[i] of matrix item_matrix[i], the first format's items
    # first. Each format's items run in a loop of their own: a branch on the format inside one
    # loop measured 25% slower (16 q4g 256 x 1024 matrices, one token, one thread: 108 against
    # 87 us), the inlined kernels no longer specialised.
    per = max(1, ITEM_GROUPS // G)  # row blocks per work item
    items = 0
    first = 0
    code_bytes = 0
    for m in range(M):
        n = (table[m, 2] + per - 1) // per
        items += n
        if table[m, 3] == first_format:
            first += n
            code_bytes += table[m, 2] * G * like_qs.shape[2]
        else:
            code_bytes += table[m, 2] * G * like_qs_b.shape[2]
    item_matrix = np.empty(items, np.int64)
    item_block = np.empty(items, np.int64)  # the item's first row block
    _fill_items(table, first_format, per, item_matrix, item_block)
    if code_bytes <= SERIAL_BYTES:  # every item on this thread, in order
        _take_items(0, new_ranges(first, 1), new_ranges(items - first, 1), first, rows, table, tscales, like_qs,
                    like_scales, like_qs_b, like_scales_b, Y, xq, xsum, xs, item_matrix, item_block, per, _NO_COUNT, 0,
                    0)
        return
    # Both formats' items in one region, each format's in a loop of its own (above); a thread
    # done with the first format's items goes on to the second's without waiting.
    words, words_b = new_ranges(first, threads), new_ranges(items - first, threads)
    for t in prange(threads):
        _take_items(t, words, words_b, first, rows, table, tscales, like_qs, like_scales, like_qs_b, like_scales_b, Y,
                    xq, xsum, xs, item_matrix, item_block, per, _NO_COUNT, 0, 0)


_NO_COUNT = np.zeros(0, np.int64)


@kernel
def _take_items(t, words, words_b, first, rows, table, tscales, like_qs, like_scales, like_qs_b, like_scales_b, Y, xq,
                xsum, xs, item_matrix, item_block, per, done, counter, total):
    """Thread t's share of _q_products' work items (`waste.kernels.steal`): the first format's
    (ranges `words`, items 0 .. first - 1), then the other's (`words_b`, items first ..). With a
    `done` array, each item taken adds one to done[counter] -> whether this thread did the last
    of `total` (another stage may then start: `waste.kernels.moe_step._moe_one_token`)."""
    last = False
    cursor = np.zeros(1, np.int64)
    i = next_item(words, t, cursor)
    while i >= 0:
        _matrix_rows(rows, table, tscales, like_qs, like_scales, Y, xq, xsum, xs, item_matrix[i], item_block[i], per)
        if done.size and fetch_add(done, counter, 1) == total - 1:
            last = True
        i = next_item(words, t, cursor)
    cursor[0] = 0
    i = next_item(words_b, t, cursor)
    while i >= 0:
        _matrix_rows(rows, table, tscales, like_qs_b, like_scales_b, Y, xq, xsum, xs, item_matrix[first + i],
                     item_block[first + i], per)
        if done.size and fetch_add(done, counter, 1) == total - 1:
            last = True
        i = next_item(words_b, t, cursor)
    return last


@kernel
def _fill_items(table, first_format, per, item_matrix, item_block):
    """The work items of _q_products' matrices (table [M, 4]) of `per` row blocks each: item i is
    row blocks item_block[i] .. + per - 1 of matrix item_matrix[i], the first format's items
    first -> (their count, the count of all)."""
    i = 0
    first = 0
    for pass_ in range(2):
        for m in range(table.shape[0]):
            if (table[m, 3] == first_format) == (pass_ == 0):
                for b in range(0, table[m, 2], per):
                    item_matrix[i] = m
                    item_block[i] = b
                    i += 1
        if pass_ == 0:
            first = i
    return first, i


@kernel
def _matrix_rows(rows, table, tscales, like_qs, like_scales, Y, xq, xsum, xs, m, b0, blocks):
    """Row blocks b0 .. b0 + blocks - 1 (those the matrix has) of matrix m of _q_products, its
    format given by like_qs and like_scales."""
    NB = table[m, 2]
    G = like_qs.shape[1]
    qs = numba.carray(pointer(table[m, 0], like_qs), (NB, G, like_qs.shape[2]))
    scales = numba.carray(pointer(table[m, 1], like_scales), (NB, G, ROWS))
    r = rows[m]
    for b in range(b0, min(NB, b0 + blocks)):
        _rows_one(qs, scales, xq[r:r + 1], xsum[r:r + 1], xs[r:r + 1], Y[m], tscales[m], b)


@parallel_kernel
def _q_spans(xq, xsum, xs, x_start, count, y_start, table, tscales, first_format, like_qs, like_scales,
             like_qs_b, like_scales_b, Y, threads):
    """Y[y_start[m] + j, :16 NB_m] = X[x_start[m] + j] W_m^T for j < count[m], for M q matrices of
    one input width (G groups) and at most two formats, X given as its quantised rows (xq, xsum,
    xs: `quantized_activations`). table [M, 4] (QBatch) holds per matrix the addresses of its
    codes and scales, its row blocks NB_m and its format: where that is first_format the matrix
    is read as (like_qs, like_scales), else as (like_qs_b, like_scales_b) (arrays of each
    format's dtypes and block size that hold no rows); tscales [M], Y [RY, W], W >= 16 max NB_m.
    The row blocks of all the matrices run in one parallel region, split between the `threads`
    by their rows' work (the caller passes numba.get_num_threads(): called in a kernel it keeps
    Numba from caching it).

    A prefill runs each of a MoE layer's experts on the few tokens routed to it: a call and a
    parallel region per expert cost more than its products where they are small (k3-mini's;
    `waste.engine.moe_layer.GROUP_ROWS` has the measurements). The callers keep the matrices
    alive during the call: the kernel reads them by address."""
    M = table.shape[0]
    G = like_qs.shape[1]
    # Work item i is row block item_block[i] of matrix item_matrix[i], the first format's items
    # first. Each format's items run in a loop of their own: a branch on the format inside one
    # loop measured 25% slower (16 q4g 256 x 1024 matrices, one token, one thread: 108 against
    # 87 us), the inlined kernels no longer specialised.
    items = 0
    first = 0
    work = 0  # code bytes times rows
    for m in range(M):
        items += table[m, 2]
        block_bytes = G * (like_qs.shape[2] if table[m, 3] == first_format else like_qs_b.shape[2])
        work += table[m, 2] * block_bytes * count[m]
        if table[m, 3] == first_format:
            first += table[m, 2]
    item_matrix = np.empty(items, np.int64)
    item_block = np.empty(items, np.int64)
    # A block's work: its code bytes times its rows plus one (reading the codes whatever the rows).
    done_after = np.empty(items, np.int64)  # the work of items 0..i
    i = 0
    total = 0
    for pass_ in range(2):
        for m in range(M):
            if (table[m, 3] == first_format) == (pass_ == 0):
                block_bytes = like_qs.shape[2] if pass_ == 0 else like_qs_b.shape[2]
                for b in range(table[m, 2]):
                    item_matrix[i] = m
                    item_block[i] = b
                    total += block_bytes * (count[m] + 1)
                    done_after[i] = total
                    i += 1
    parts = 1 if work <= SERIAL_BYTES else max(1, min(threads, items))  # serial below SERIAL_BYTES
    # Part p takes the items whose work ends in (total p / parts, total (p + 1) / parts]: about the
    # same work each, whatever the tokens each expert was routed.
    bounds = np.zeros(parts + 1, np.int64)
    i = 0
    for p in range(1, parts):
        while i < items and done_after[i] * parts <= total * p:
            i += 1
        bounds[p] = i
    bounds[parts] = items
    if work <= SERIAL_BYTES:
        for i in range(first):
            _span_rows(x_start, count, y_start, table, tscales, like_qs, like_scales, Y, xq, xsum, xs, item_matrix[i],
                       item_block[i])
        for i in range(first, items):
            _span_rows(x_start, count, y_start, table, tscales, like_qs_b, like_scales_b, Y, xq, xsum, xs,
                       item_matrix[i], item_block[i])
        return
    # The item loops sit in the prange body itself (one thread too), not in a function it calls or
    # in this function's serial code: compiled as the parallel region's own function they ran 2.5x
    # faster (a decode step's nine down products of `mini` q4 on one thread: 44 against 110 us;
    # why LLVM does better there, we have not pinned down).
    for p in prange(parts):
        lo, hi = bounds[p], bounds[p + 1]
        for i in range(lo, min(hi, first)):
            _span_rows(x_start, count, y_start, table, tscales, like_qs, like_scales, Y, xq, xsum, xs, item_matrix[i],
                       item_block[i])
        for i in range(max(lo, first), hi):
            _span_rows(x_start, count, y_start, table, tscales, like_qs_b, like_scales_b, Y, xq, xsum, xs,
                       item_matrix[i], item_block[i])


@kernel
def _span_rows(x_start, count, y_start, table, tscales, like_qs, like_scales, Y, xq, xsum, xs, m, b):
    """Row block b of matrix m of _q_spans on its rows, its format given by like_qs and like_scales."""
    NB = table[m, 2]
    G = like_qs.shape[1]
    qs = numba.carray(pointer(table[m, 0], like_qs), (NB, G, like_qs.shape[2]))
    scales = numba.carray(pointer(table[m, 1], like_scales), (NB, G, ROWS))
    x0, n, y0 = x_start[m], count[m], y_start[m]
    _rows(qs, scales, xq[x0:x0 + n], xsum[x0:x0 + n], xs[x0:x0 + n], Y[y0:y0 + n], tscales[m], b)
