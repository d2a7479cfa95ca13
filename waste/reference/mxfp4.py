"""Float64 oracle for MXFP4 matrices (OCP Microscaling spec v1.0, compressed-tensors packing).

Written from the format's definition, not from `waste.kernels.mxfp4`'s tables:
- an E2M1 nibble has sign bit 3, exponent bits 1-2 (bias 1) and mantissa bit 0; exponent 0 is
  subnormal: value = (-1)^s * 2^(1 - 1) * (m / 2); otherwise (-1)^s * 2^(e - 1) * (1 + m / 2);
- an E8M0 byte s is the scale 2^(s - 127), and 255 is NaN;
- element 2j of a row is the low nibble of packed byte j, element 2j + 1 the high nibble.

- `reference_dequantize_mxfp4(packed, scales)`: the weights [N, K] in float64 (what
  `waste.reference.quant.reference_dequantize` and `reference_matmul` use for format "mxfp4").
- `reference_quantize_mxfp4(w)`: packed and scale bytes by the compressed-tensors rule (see
  waste.kernels.mxfp4), choosing each value by comparing distances to every grid point.
"""

from __future__ import annotations

import math

import numpy as np

GROUP = 32


def e2m1_value(nibble: int) -> float:
    """The real number an E2M1 nibble encodes."""
    sign = -1.0 if nibble & 8 else 1.0
    exponent = (nibble >> 1) & 3
    mantissa = nibble & 1
    if exponent == 0:
        return sign * mantissa / 2
    return sign * 2.0 ** (exponent - 1) * (1 + mantissa / 2)


def e8m0_value(byte: int) -> float:
    """The real number an E8M0 scale byte encodes (NaN for 255)."""
    return math.nan if byte == 255 else 2.0 ** (byte - 127)


def reference_dequantize_mxfp4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """packed uint8 [N, K/2], scales uint8 [N, K/32] -> weights [N, K] float64."""
    packed, scales = np.asarray(packed), np.asarray(scales)
    n, half = packed.shape
    value_of = np.array([e2m1_value(v) for v in range(16)])
    scale_of = np.array([e8m0_value(v) for v in range(256)])
    w = np.empty((n, 2 * half), np.float64)
    for j in range(2 * half):
        byte = packed[:, j // 2].astype(np.int64)
        nibble = byte & 15 if j % 2 == 0 else byte >> 4
        w[:, j] = value_of[nibble] * scale_of[scales[:, j // GROUP].astype(np.int64)]
    return w


def reference_quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] (K % 32 == 0) -> (packed uint8 [N, K/2], scales uint8 [N, K/32]), element by element."""
    w = np.asarray(w, np.float64)
    n, k = w.shape
    grid = [(e2m1_value(v), v) for v in range(8)]  # non-negative values and their codes
    packed = np.zeros((n, k // 2), np.uint8)
    scales = np.zeros((n, k // GROUP), np.uint8)
    for i in range(n):
        for g in range(k // GROUP):
            part = w[i, g * GROUP:(g + 1) * GROUP]
            amax = float(np.abs(part).max())
            if amax > 0:
                # floor(log2 amax), then one up when amax >= 1.75 * 2^floor (compressed-tensors'
                # rounding to a power of two); E2M1's largest exponent is 2.
                e = math.floor(math.log2(amax))
                while 2.0 ** e > amax:
                    e -= 1
                while 2.0 ** (e + 1) <= amax:
                    e += 1
                if amax >= 1.75 * 2.0**e:
                    e += 1
                scales[i, g] = min(254, max(0, e - 2 + 127))
            scale = e8m0_value(int(scales[i, g]))
            for j, v in enumerate(part):
                r = min(abs(v) / scale, 6.0)
                # nearest grid value; on a tie the even code (mantissa bit 0)
                best = min(grid, key=lambda gv, r=r: (abs(gv[0] - r), gv[1] % 2))
                code = best[1] | (8 if v < 0 and best[1] else 0)
                col = g * GROUP + j
                packed[i, col // 2] |= code << (4 * (col % 2))
    return packed, scales
