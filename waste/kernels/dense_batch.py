"""Many f32 or bf16 products in one kernel call, through `waste.kernels.bf16`'s tiles: a decode
step's matrices on one row each (`dense_products`, `DenseBatch.__call__`), a prefill's experts on
a run of rows each (`DenseBatch.spans`), as `waste.kernels.qbatch` does for the q formats."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numba
import numpy as np

from waste.errors import WasteError
from waste.jit import kernel, parallel_kernel, prange
from waste.kernels.bf16 import (
    CHUNK_BLOCK_BYTES,
    CHUNK_NATIVE,
    DENSE_FORMATS,
    ONE_TOKEN_ROWS,
    ROW_TILE,
    _row_block,
    bf16_operand,
    dense_operand,
)
from waste.kernels.pointers import pointer


def dense_products(X: np.ndarray, matrices: Sequence[Any], rows: np.ndarray) -> np.ndarray:
    """Y [M, Nmax] with Y[m, :N_m] = W_m X[rows[m]], for X [R, K] float32 and M QMatrix W_m
    [N_m, K] all f32 or all bf16 (waste.kernels.quant), in one
    kernel call (`_dense_products`): bit for bit W_m.matvec(X[rows[m]]), where calling each
    would take a parallel region per product. rows [M] int64 in [0, R) (unchecked)."""
    return DenseBatch(matrices)(X, rows)


class DenseBatch:
    """Several f32 or bf16 matrices of one format and width, multiplied in one kernel call: on
    one row of X each (`__call__`, as `dense_products`) or on a run of rows each (`spans`), as
    `waste.kernels.qbatch.QBatch` does for q formats."""

    def __init__(self, matrices: Sequence[Any]):
        fmt, k = matrices[0].fmt, matrices[0].shape[1]
        if fmt not in DENSE_FORMATS or any(m.fmt != fmt or m.shape[1] != k for m in matrices):
            raise WasteError(f"dense products multiply f32 or bf16 matrices of one format and width, "
                             f"got {sorted({(m.fmt, m.shape) for m in matrices})}")
        self.fmt, self.k = fmt, k
        self.table = dense_table(matrices)
        self.width = int(self.table[:, 1].max())
        self.like = matrices[0].buffers["w"][:0]

    def _checked(self, X: np.ndarray) -> np.ndarray:
        X = np.ascontiguousarray(X, np.float32)
        if X.ndim != 2 or X.shape[1] != self.k:
            raise WasteError(f"dense products of width {self.k} take [R, {self.k}] inputs, got {X.shape}")
        return X

    def __call__(self, X: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """[M, width]: matrix m on X[rows[m]]; rows [M] int64 in [0, R) (unchecked)."""
        Y = np.empty((len(self.table), 1, self.width), np.float32)
        _dense_products(dense_operand(self._checked(X), self.fmt), rows, self.table, self.like, Y)
        return Y[:, 0]

    def spans(self, X: np.ndarray, x_start: np.ndarray, count: np.ndarray, y_start: np.ndarray,
              out_rows: int) -> np.ndarray:
        """Y [out_rows, width] with Y[y_start[m] + j, :N_m] = W_m X[x_start[m] + j] for j <
        count[m], each span's rows bit for bit W_m.matmul(X[x_start[m]:x_start[m] + count[m]]);
        x_start, count, y_start [M] int64, every span inside X and Y (unchecked)."""
        return self.prepared_spans(self.prepare(X), x_start, count, y_start, out_rows)

    def prepare(self, X: np.ndarray) -> tuple[np.ndarray]:
        """(xs,): X [R, K] float32 as `spans` multiplies it (a chunk's operand: CHUNK_NATIVE),
        each row on its own, so the rows of a gather of X are the gather of these rows."""
        X = self._checked(X)
        return (X if self.fmt == "f32" else bf16_operand(X, native=CHUNK_NATIVE),)

    def prepared_spans(self, prepared: tuple[np.ndarray], x_start: np.ndarray, count: np.ndarray,
                       y_start: np.ndarray, out_rows: int) -> np.ndarray:
        """`spans` on rows already prepared (`prepare`, or rows gathered from it, C-contiguous)."""
        Y = np.empty((out_rows, self.width), np.float32)
        _dense_spans(prepared[0], x_start, count, y_start, self.table, self.like, Y)
        return Y


def dense_table(matrices: Sequence[Any]) -> np.ndarray:
    """[M, 2] int64: each f32 or bf16 QMatrix's weights address and row count, as
    `_dense_products` reads them. Writable, as the tables `waste.kernels.moe_step.ExpertTables`
    gathers from: a kernel given both compiles once, not once per array type."""
    return np.frombuffer(bytearray(b"".join([m._drow for m in matrices])), np.int64).reshape(-1, 2)


@kernel
def _row_items(table, rows):
    """The work items of the matrices in table [M, 2] (address, row count): (matrix, first row)
    of every block of `rows` rows, matrix by matrix."""
    items = 0
    for m in range(table.shape[0]):
        items += (table[m, 1] + rows - 1) // rows
    item_matrix = np.empty(items, np.int64)
    item_row = np.empty(items, np.int64)
    i = 0
    for m in range(table.shape[0]):
        for n0 in range(0, table[m, 1], rows):
            item_matrix[i] = m
            item_row[i] = n0
            i += 1
    return item_matrix, item_row


@parallel_kernel
def _dense_products(xs, rows, table, like, Y):
    """Y[m, 0, :N_m] = xs[rows[m]] W_m^T for M matrices of one dense format (like: the weights'
    dtype, K columns, no rows) read by address (table [M, 2]: address, N_m), in blocks of
    ONE_TOKEN_ROWS rows as f32_matmul and bf16_matmul make them for one token; xs as those pass
    it to the tiles. The blocks of all the matrices run in one parallel region."""
    item_matrix, item_row = _row_items(table, ONE_TOKEN_ROWS)
    for i in prange(len(item_matrix)):
        m, n0 = item_matrix[i], item_row[i]
        N = table[m, 1]
        w = numba.carray(pointer(table[m, 0], like), (N, like.shape[1]))
        r = rows[m]
        _row_block(w, xs[r:r + 1], Y[m], n0, min(N, n0 + ONE_TOKEN_ROWS), w, 0, 0)


@parallel_kernel
def _dense_spans(xs, x_start, count, y_start, table, like, Y):
    """Y[y_start[m] + j, :N_m] = xs[x_start[m] + j] W_m^T for j < count[m], for M matrices
    of one dense format read by address (table [M, 2], `dense_table`): every matrix's blocks of
    rows (as f32_matmul and bf16_matmul make them for a chunk) in one parallel region."""
    rows = max(1, CHUNK_BLOCK_BYTES // (like.shape[1] * like.itemsize) // ROW_TILE) * ROW_TILE
    item_matrix, item_row = _row_items(table, rows)
    for i in prange(len(item_matrix)):
        m, n0 = item_matrix[i], item_row[i]
        N = table[m, 1]
        w = numba.carray(pointer(table[m, 0], like), (N, like.shape[1]))
        a, y0, c = x_start[m], y_start[m], count[m]
        n1 = min(N, n0 + rows)
        _row_block(w, xs[a:a + c], Y[y0:y0 + c], n0, n1, w, n1, min(N, n1 + rows))
