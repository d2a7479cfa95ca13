"""Small serial helpers for the parallel drivers.

In a `parallel_kernel`, Numba turns NumPy array expressions (a max over a column, np.zeros,
np.arange, a slice assignment) into parallel regions of their own: a decode step's drivers
made four to six such regions of a few elements each, every one a fork and a join of the
thread pool between the products. These loops run on the calling thread instead.
"""

from __future__ import annotations

import numpy as np

from waste.jit import kernel


@kernel
def column_max(table, column):
    """The largest value of table[:, column] (int64 table [M, *], M >= 1)."""
    top = table[0, column]
    for m in range(1, table.shape[0]):
        top = max(top, table[m, column])
    return top


@kernel
def row_ids(n):
    """[0, 1, .., n - 1] as int64."""
    ids = np.empty(n, np.int64)
    for i in range(n):
        ids[i] = i
    return ids


@kernel
def zero_ids(n):
    """n zeros as int64."""
    ids = np.empty(n, np.int64)
    for i in range(n):
        ids[i] = 0
    return ids
