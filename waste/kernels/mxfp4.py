"""MXFP4 weights: the OCP Microscaling FP4 format as compressed-tensors stores it.

A matrix [N, K] (K % 32 == 0) is two byte arrays, kept verbatim from a checkpoint's
`weight_packed` / `weight_scale` (compressed-tensors `mxfp4-pack-quantized`):
- `packed` uint8 [N, K/2]: element 2j is the low nibble of byte j, element 2j+1 the high one.
  A nibble is E2M1: bit 3 the sign, bits 0-2 index the magnitudes [0, .5, 1, 1.5, 2, 3, 4, 6].
- `scales` uint8 [N, K/32]: E8M0, byte s multiplies its 32 elements by 2^(s - 127); 255 is NaN.
Example (FACTS.md): [0.5, -1.5, 3, -6] at scale byte 127 pack to bytes b1 f5.

Quantising (`quantize_mxfp4`) follows compressed-tensors, whose checkpoints K3 ships:
- The shared exponent comes from the group's largest |w| = a. The OCP MX spec takes
  floor(log2 a) - 2 (2 is E2M1's largest exponent, 6 = 1.5 * 2^2), so a / scale lies in [4, 8)
  and everything above 6 clips to 6. compressed-tensors first rounds a to a power of two,
  upwards when its mantissa is >= 1.75 (it adds a quarter of the leading bit, then masks the
  mantissa off), so a / scale lies in [3.5, 7): a group whose largest weight would clip by more
  than a whole unit gets the next scale instead. We take compressed-tensors' rule.
  The byte is clamped to [0, 254]; an all-zero group gets byte 0.
- Each w / scale (exact: a power of two) rounds to the nearest E2M1 value, ties to the even
  code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4) and |w| / scale
  > 6 to 6, as compressed-tensors' cast does. A value that rounds to zero stores nibble 0
  (no negative zero).

Products (`waste.kernels.quant.QMatrix`) use that twice an E2M1 value is an integer in
[-12, 12]: the int8 dot of the q formats applies exactly, with the group scale 2^(s - 128).
For it the QMatrix repacks the bytes once (`repack_interleaved`) into q4g's 16-row interleave:
the same nibbles (E2M1, looked up in the kernel as 2v + 12 in [0, 24]) and the same scale bytes,
so the copy is as large as the stored bytes (4.25 bits per weight, rows padded to 16).
"""

from __future__ import annotations

import numpy as np

from waste.errors import WasteError
from waste.jit import kernel, parallel_kernel, prange
from waste.qformat import check_mxfp4_shape

MX_GROUP = 32  # elements sharing one E8M0 scale, along K
SCALE_BIAS = 127  # E8M0 byte s stands for 2^(s - 127)
SCALE_NAN = 255  # the E8M0 NaN encoding
E2M1_EMAX = 2  # exponent of E2M1's largest value, 6 = 1.5 * 2^2
# E2M1 value of each nibble: bits 0-2 index the magnitudes, bit 3 is the sign.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
E2M1_TWICE = (2 * E2M1_VALUES).astype(np.int8)  # integer codes in [-12, 12]
# |v| from which the rounded magnitude index moves up by one, and whether the boundary itself
# moves up (ties go to the even index: 0.75 -> 1.0 (index 2) but 1.25 -> 1.0 too).
_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
ROUND_UP_MANTISSA = 0.875  # frexp mantissa (in [0.5, 1)) of 1.75: compressed-tensors rounds a up from here
ROW_BLOCK = 1024  # rows quantised at once, bounding the temporaries


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] finite floats (K % 32 == 0) -> (packed uint8 [N, K/2], scales uint8 [N, K/32])."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise WasteError(f"weight must be 2-D [N, K], got shape {w.shape}")
    n, k = w.shape
    check_mxfp4_shape((n, k))
    packed = np.empty((n, k // 2), np.uint8)
    scales = np.empty((n, k // MX_GROUP), np.uint8)
    for r0 in range(0, n, ROW_BLOCK):
        part = np.asarray(w[r0:r0 + ROW_BLOCK], np.float32)
        if not np.isfinite(part).all():
            raise WasteError("mxfp4 weights must be finite (found NaN or infinite values)")
        packed[r0:r0 + ROW_BLOCK], scales[r0:r0 + ROW_BLOCK] = _quantize_rows(part)
    return packed, scales


def _quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Packed nibbles and scale bytes of float32 rows w [R, K]."""
    r, k = w.shape
    groups = w.reshape(r, k // MX_GROUP, MX_GROUP)
    amax = np.abs(groups).max(axis=-1, initial=0.0)  # [R, G]
    mantissa, exponent = np.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    shared = exponent.astype(np.int64) - 1 + (mantissa >= ROUND_UP_MANTISSA) - E2M1_EMAX
    byte = np.where(amax > 0, np.clip(shared + SCALE_BIAS, 0, SCALE_NAN - 1), 0)
    # Dividing by a power of two is exact (np.ldexp), so rounding sees the true ratio.
    ratio = np.ldexp(groups, (SCALE_BIAS - byte)[..., None].astype(np.int32))
    mag = np.abs(ratio)
    index = np.zeros(mag.shape, np.uint8)
    for bound, tie_up in _BOUNDS:
        index += (mag >= bound) if tie_up else (mag > bound)
    nibble = index | (((ratio < 0) & (index > 0)).astype(np.uint8) << 3)
    nibble = nibble.reshape(r, k)
    return nibble[:, 0::2] | (nibble[:, 1::2] << 4), byte.astype(np.uint8)


def scale_values(scales: np.ndarray, shift: int = 0) -> np.ndarray:
    """E8M0 bytes [..] -> float32 2^(s - 127 - shift) (NaN for byte 255); exact, subnormals included."""
    s = np.asarray(scales)
    out = np.ldexp(np.float32(1.0), np.minimum(s, SCALE_NAN - 1).astype(np.int32) - SCALE_BIAS - shift)
    return np.where(s == SCALE_NAN, np.float32(np.nan), out)


def nibbles(packed: np.ndarray) -> np.ndarray:
    """Packed bytes [R, K/2] -> nibbles [R, K] in element order."""
    packed = np.asarray(packed)
    out = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    out[:, 0::2] = packed & 15
    out[:, 1::2] = packed >> 4
    return out


def dequantize_mxfp4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 weights [R, K] of packed [R, K/2] and scales [R, K/32]: exact, except that
    values of 2^128 and more (scale bytes >= 253 only) become inf, as float32 has no such numbers."""
    values = E2M1_VALUES[nibbles(packed)]  # [R, K]
    r, k = values.shape
    scale = scale_values(scales)  # [R, G]
    with np.errstate(over="ignore"):
        return (values.reshape(r, k // MX_GROUP, MX_GROUP) * scale[..., None]).reshape(r, k)


@kernel
def repack_blocks(packed, scales, qs, sc, first, last):
    """packed [N, K/2] and scales [N, G] -> row blocks [first, last) of the interleave of the q
    kernels: qs [NB, G, 16 R] holds, for row r of block b and k = 4c + i (c < 4, i < 4) of group
    g, element k (low nibble) and k + 16 (high nibble) at byte 4 R c + 4 r + i; sc [NB, G, R]
    the scale bytes. R = rows per block (sc.shape[2]); rows past N get zero nibbles and scale
    byte 0. On the calling thread (the streaming store's readers repack what they read)."""
    N = packed.shape[0]
    G, R = sc.shape[1], sc.shape[2]
    for b in range(first, last):
        for g in range(G):
            for r in range(R):
                n = b * R + r
                sc[b, g, r] = scales[n, g] if n < N else 0
                for k in range(MX_GROUP // 2):
                    byte = 0
                    if n < N:
                        shift = 4 * (k % 2)
                        lo = (packed[n, g * (MX_GROUP // 2) + k // 2] >> shift) & 15
                        hi = (packed[n, g * (MX_GROUP // 2) + (k + MX_GROUP // 2) // 2] >> shift) & 15
                        byte = lo | (hi << 4)
                    qs[b, g, 4 * R * (k // 4) + 4 * r + k % 4] = byte


@parallel_kernel
def repack_interleaved(packed, scales, qs, sc):
    """`repack_blocks` of every row block, on all cores."""
    for b in prange(sc.shape[0]):
        repack_blocks(packed, scales, qs, sc, b, b + 1)


def stored_rows(qs: np.ndarray, sc: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `repack_blocks` for rows `ids` (in range): (packed [L, K/2], scales [L, G])
    as stored, from the interleave qs [NB, G, 16 R] and sc [NB, G, R]."""
    R = sc.shape[2]
    blocks, rows = ids // R, ids % R
    # [L, G, c, r, i] -> the row's [L, G, c, i]: the byte of elements 4c + i (low) and 4c + i + 16 (high)
    grouped = qs[blocks].reshape(len(ids), qs.shape[1], 4, R, 4)[np.arange(len(ids)), :, :, rows, :]
    half = MX_GROUP // 2
    elements = np.concatenate([(grouped & 15).reshape(len(ids), -1, half), (grouped >> 4).reshape(len(ids), -1, half)],
                              axis=2).reshape(len(ids), -1)  # [L, K] nibbles in element order
    packed = (elements[:, 0::2] | (elements[:, 1::2] << 4)).astype(np.uint8)
    return packed, np.ascontiguousarray(sc[blocks, :, rows])
