"""RMSNorm over rows and the finiteness check of a layer's output, as Numba kernels.

A decode step normalises and checks a handful of 1-row vectors per layer; in NumPy each took
12-31 us on a 2-core AMD EPYC (several temporaries, and the interpreter runs slower beside
Numba's spinning worker thread), 0.5 ms of a 7 ms `mini` step. Each row is computed by the
same loop whatever the number of rows, so a row's bits do not depend on the chunk it is in.
"""

from __future__ import annotations

import numpy as np

from waste.errors import WasteError
from waste.jit import kernel, parallel_kernel, prange

# Rows normalised on the calling thread: a decode step's one row, a short chunk.
SERIAL_ROWS = 64


@kernel
def _rms_norm_row(x, weight, eps, out, t):
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, in float32."""
    D = x.shape[1]
    s = np.float32(0.0)
    for i in range(D):
        s += x[t, i] * x[t, i]
    r = np.float32(1.0) / np.sqrt(s / np.float32(D) + eps)
    for i in range(D):
        out[t, i] = x[t, i] * r * weight[i]


@parallel_kernel
def _rms_norm_rows(x, weight, eps, out):
    if x.shape[0] <= SERIAL_ROWS:
        for t in range(x.shape[0]):
            _rms_norm_row(x, weight, eps, out, t)
    else:
        for t in prange(x.shape[0]):
            _rms_norm_row(x, weight, eps, out, t)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Row-wise RMSNorm of x [T, D] times weight [D] -> float32 [T, D]."""
    x = np.ascontiguousarray(x, np.float32)
    weight = np.ascontiguousarray(weight, np.float32)
    if x.ndim != 2 or weight.shape != (x.shape[1],):
        raise WasteError(f"RMSNorm of x {x.shape} with weight {weight.shape}: expected [T, D] and [D]")
    out = np.empty_like(x)
    _rms_norm_rows(x, weight, np.float32(eps), out)
    return out


@kernel
def _all_finite(flat):
    bad = np.float32(0.0)
    for i in range(flat.size):
        bad += flat[i] * np.float32(0.0)  # 0 for a finite value, NaN for NaN or an infinity
    return bad == np.float32(0.0)


def all_finite(x: np.ndarray) -> bool:
    """Whether every value of the float32 array x is finite (no NaN, no infinity)."""
    return bool(_all_finite(np.ascontiguousarray(x, np.float32).reshape(-1)))
