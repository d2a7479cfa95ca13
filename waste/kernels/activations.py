"""Activations quantised for the integer products (`waste.kernels.quant`): per token, int8
codes in [-127, 127] per group of 32 inputs, their sum per group and a float32 scale per group
(the largest |x| over 127), so that x ~ scale * code. The float64 oracle
`waste.reference.quant.reference_quantize_activation` gives the same codes and scales
(tests/kernels/test_quant.py).
"""

from __future__ import annotations

import numpy as np

from waste.jit import kernel, parallel_kernel, prange
from waste.qformat import GROUP


# fastmath off: the integer codes must follow IEEE float32 exactly (127 / amax is one correctly
# rounded division, not a reciprocal times 127), so the float64 reference reproduces them.
@kernel(fastmath=False)
def _quantize_token(X, t, xq, xsum, xs):
    """Quantise token t of X [T, K] into xq [T, 32G], xsum [T, G], xs [T, G] (see below)."""
    K = X.shape[1]
    bits = X.view(np.uint32)
    for g in range(xs.shape[1]):
        k0 = g * GROUP
        k1 = min(K, k0 + GROUP)
        # |x| ordered as the integers of its bits: a vectorisable max that also sees NaN and inf
        # (bits above 0x7f800000 are NaN, 0x7f800000 is inf).
        top = np.uint32(0)
        for k in range(k0, k1):
            top = max(top, np.uint32(bits[t, k] & np.uint32(0x7FFFFFFF)))
        finite = top < np.uint32(0x7F800000)
        amax = np.uint32(top).view(np.float32) if finite else np.float32(0.0)
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        s = np.int32(0)
        for k in range(k0, k1):
            q = np.int32(min(np.float32(127.0), max(np.float32(-127.0), np.rint(X[t, k] * inv)))) if finite else 0
            xq[t, k] = q
            s += q
        for k in range(k1, k0 + GROUP):
            xq[t, k] = 0
        xsum[t, g] = s
        # A NaN or an infinity leaves codes 0 and a NaN scale: the group's outputs become NaN.
        xs[t, g] = amax / np.float32(127.0) if finite else np.float32(np.nan)


@parallel_kernel
def quantize_activations(X, xq, xsum, xs):
    """X [T, K] float32 -> codes xq [T, 32G] int8 (zero padded), their group sums xsum [T, G]
    int32 and scales xs [T, G] float32 (NaN where a group holds NaN or inf): X ~ xs * xq."""
    for t in prange(X.shape[0]):
        _quantize_token(X, t, xq, xsum, xs)


def quantized_activations(X: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(xq [T, 32 groups], xsum [T, groups], xs [T, groups]) of X [T, K] float32 C-contiguous,
    K <= 32 groups: `quantize_activations` into fresh arrays."""
    T = X.shape[0]
    xq = np.empty((T, groups * GROUP), np.int8)
    xsum = np.empty((T, groups), np.int32)
    xs = np.empty((T, groups), np.float32)
    quantize_activations(X, xq, xsum, xs)
    return xq, xsum, xs
