"""RMSNorm over rows and the finiteness check of a layer's output, as Numba kernels.

A decode step normalises and checks a handful of 1-row vectors per layer; in NumPy each took
12-31 us on a 2-core AMD EPYC (several temporaries, and the interpreter runs slower beside
Numba's spinning worker thread), 0.5 ms of a 7 ms `mini` step. Each row is computed by the
same loop whatever the number of rows, so a row's bits do not depend on the chunk it is in.
"""

from __future__ import annotations

import numpy as np

from waste.errors import WasteError
from waste.jit import FIXED_ORDER_FASTMATH, kernel, parallel_kernel, prange

# Rows normalised on the calling thread: a decode step's one row, a short chunk.
SERIAL_ROWS = 64


@kernel(fastmath=set(FIXED_ORDER_FASTMATH))
def _rms_norm_row(x, weight, eps, out, t):
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, in float32; the squares summed in eight
    fixed lanes, then the rest (see FIXED_ORDER_FASTMATH)."""
    D = x.shape[1]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    lanes_end = D - D % 8
    for i in range(0, lanes_end, 8):
        a0 += x[t, i] * x[t, i]
        a1 += x[t, i + 1] * x[t, i + 1]
        a2 += x[t, i + 2] * x[t, i + 2]
        a3 += x[t, i + 3] * x[t, i + 3]
        a4 += x[t, i + 4] * x[t, i + 4]
        a5 += x[t, i + 5] * x[t, i + 5]
        a6 += x[t, i + 6] * x[t, i + 6]
        a7 += x[t, i + 7] * x[t, i + 7]
    s = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
    for i in range(lanes_end, D):
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


# Serial: its parallel region is _rms_norm_rows'.
@kernel
def _add_check_norm_rows(h, delta, weight, eps, out_h, out_x):
    """out_h = h + delta and out_x = the RMSNorm of out_h's rows times weight, all [T, D] float32
    -> whether delta is all finite: the bits of `h + delta`, `all_finite(delta)` and `rms_norm`."""
    T, D = h.shape
    bad = np.float32(0.0)
    for t in range(T):
        for i in range(D):
            bad += delta[t, i] * np.float32(0.0)  # as _all_finite
            out_h[t, i] = h[t, i] + delta[t, i]
    _rms_norm_rows(out_h, weight, eps, out_x)
    return bad == np.float32(0.0)


def add_check_norm(h: np.ndarray, delta: np.ndarray, weight: np.ndarray,
                   eps: float) -> tuple[np.ndarray, np.ndarray] | None:
    """(h + delta, rms_norm(h + delta, weight, eps)) for float32 C-contiguous h and delta [T, D]
    and weight [D] (the caller's promise: unchecked), or None when delta holds a NaN or an
    infinity. A residual stream's step between two layers in one kernel call, where adding,
    checking and normalising took three (each a few microseconds of Python in a decode step)."""
    out_h, out_x = np.empty_like(h), np.empty_like(h)
    if not _add_check_norm_rows(h, delta, weight, np.float32(eps), out_h, out_x):
        return None
    return out_h, out_x


@kernel
def _all_finite(flat):
    bad = np.float32(0.0)
    for i in range(flat.size):
        bad += flat[i] * np.float32(0.0)  # 0 for a finite value, NaN for NaN or an infinity
    return bad == np.float32(0.0)


def all_finite(x: np.ndarray) -> bool:
    """Whether every value of the float32 array x is finite (no NaN, no infinity)."""
    return bool(_all_finite(np.ascontiguousarray(x, np.float32).reshape(-1)))
