"""Several products of one input in one kernel call: a chunk's projections of the same rows
(KDA's q, k, v, f_a, b and gate). The input is prepared once (quantised for q formats, rounded
to bf16 for bf16) instead of once per matrix, and every matrix's row blocks share one parallel
region, where a narrow matrix alone (KDA's b, 8 rows) leaves a core idle. (A SwiGLU's gate and
up pair gained nothing this way: `waste.kernels.quant.matmul_pair` runs q pairs faster.)"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from waste.errors import WasteError
from waste.kernels.bf16 import DENSE_FORMATS
from waste.kernels.dense_batch import DenseBatch
from waste.kernels.qbatch import QBatch, batchable
from waste.kernels.quant import QMatrix


class SameInput:
    """`SameInput(matrices)(X)` -> [X W_m^T for each matrix], each bit for bit W_m.matmul(X):
    in one call (QBatch or DenseBatch spans) when the matrices are q matrices of at most two
    formats, or all f32 or all bf16, of one input width; else one matmul each."""

    def __init__(self, matrices: Sequence[QMatrix]):
        self.matrices = list(matrices)
        self.k = self.matrices[0].shape[1]
        fmts = {m.fmt for m in self.matrices}
        one_width = all(m.shape[1] == self.k for m in self.matrices)
        self.batch: QBatch | DenseBatch | None = None
        if batchable(self.matrices):
            self.batch = QBatch(self.matrices, checked=True)
        elif one_width and len(fmts) == 1 and next(iter(fmts)) in DENSE_FORMATS:
            self.batch = DenseBatch(self.matrices)

    def __call__(self, X: np.ndarray) -> list[np.ndarray]:
        """X [T, K] float32 -> [Y_m [T, N_m] float32, C-contiguous]."""
        X = np.ascontiguousarray(X, np.float32)
        if X.ndim != 2 or X.shape[1] != self.k:
            raise WasteError(f"products of width {self.k} take [T, {self.k}] inputs, got {X.shape}")
        if self.batch is None:
            return [m.matmul(X) for m in self.matrices]
        T, M = X.shape[0], len(self.matrices)
        # Matrix m on all of X, its rows of Y at m T.
        Y = self.batch.spans(X, np.zeros(M, np.int64), np.full(M, T, np.int64), np.arange(M, dtype=np.int64) * T,
                             M * T)
        return [np.ascontiguousarray(Y[m * T:(m + 1) * T, :w.shape[0]]) for m, w in enumerate(self.matrices)]
