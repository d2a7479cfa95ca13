"""Weight quantisation to q8g / q4g (`waste.kernels.quant.quantize` calls `quantize_grouped`).

Byte for byte the float64 NumPy oracle (`waste.reference.quant.reference_quantize`): float64
arithmetic with fastmath off, so w / d stays a correctly rounded division (not a reciprocal
product), rint rounds half to even and the sign of a zero scale survives. Formats, layout and
the measured speed: docs/QUANT.md.
"""

from __future__ import annotations

import math

import numpy as np

from waste.errors import WasteError
from waste.jit import kernel, parallel_kernel, prange
from waste.qformat import CODE_OFFSET, GROUP, QMAX, ROWS, SCALE_EXPONENT, buffer_layout

QUANTIZE_BLOCKS = 256  # row blocks quantised at once (bounds copies of other dtypes or layouts)


def quantize_grouped(w: np.ndarray, fmt: str) -> dict[str, np.ndarray]:
    """The q8g / q4g buffers (qs, scales, tscale) of a finite weight matrix w [N, K]."""
    shape = (int(w.shape[0]), int(w.shape[1]))
    buffers = {name: np.empty(bshape, dt) for name, dt, bshape in buffer_layout(fmt, shape)}
    # Two streaming passes of QUANTIZE_BLOCKS row blocks (the largest |w| sets tscale, then the
    # codes), so a huge matrix is never copied whole.
    wmax = 0.0
    for r0 in range(0, shape[0], QUANTIZE_BLOCKS * ROWS):
        part_max = _largest_magnitude(_quantizer_input(w[r0:r0 + QUANTIZE_BLOCKS * ROWS]))
        if not math.isfinite(part_max):
            raise WasteError(f"cannot quantise a {shape} matrix to {fmt}: it holds NaN or infinite weights")
        wmax = max(wmax, part_max)
    tscale = _tensor_scale(wmax / QMAX[fmt])
    buffers["tscale"][0] = tscale
    quantize_rows = _q8g_quantize if fmt == "q8g" else _q4g_quantize
    for b0 in range(0, buffers["qs"].shape[0], QUANTIZE_BLOCKS):
        b1 = min(buffers["qs"].shape[0], b0 + QUANTIZE_BLOCKS)
        quantize_rows(_quantizer_input(w[b0 * ROWS:b1 * ROWS]), tscale, buffers["qs"][b0:b1].view(np.uint32),
                      buffers["scales"][b0:b1].view(np.uint16))
    return buffers


def _tensor_scale(dmax: float) -> float:
    """The power of two that puts the largest group scale in [2**14, 2**15)."""
    if dmax == 0.0:
        return 1.0
    exponent = math.frexp(dmax)[1] - 1 - SCALE_EXPONENT
    return math.ldexp(1.0, min(127, max(-126, exponent)))


def _quantizer_input(part: np.ndarray) -> np.ndarray:
    """Rows w [R, K] as the quantiser kernels read them: C-contiguous float32 or float64 (other
    dtypes widen to float64, exactly as the float64 reference reads them)."""
    if part.dtype in (np.float32, np.float64):
        return np.ascontiguousarray(part)
    return np.ascontiguousarray(part, np.float64)


def _largest_magnitude(part: np.ndarray) -> float:
    """max |w| of rows w [R, K] (float32 or float64, C-contiguous): NaN or inf if w holds either."""
    ints = np.int32 if part.dtype == np.float32 else np.int64
    tops = np.zeros(len(part), np.int64)
    _row_abs_bits(part.view(ints), np.int64(np.iinfo(ints).max), tops)
    return float(np.array(tops.max(initial=0), ints).view(part.dtype))


_ABS = 0x7FFFFFFFFFFFFFFF  # the bits of a float64 without its sign
_Q8G_MAX, _Q4G_MAX, _Q4G_OFFSET = float(QMAX["q8g"]), float(QMAX["q4g"]), CODE_OFFSET["q4g"]


@parallel_kernel
def _row_abs_bits(bits, mask, tops):
    """tops[R] = the largest |w| of each row of w [R, K] as the integer bits of its float: bits
    [R, K] is w viewed as int32 or int64 and mask clears the sign. NaN and inf order above all
    finite |w|, and an integer max vectorises where a float max without fast-math does not."""
    for r in prange(bits.shape[0]):
        top = tops[r]
        for k in range(bits.shape[1]):
            top = max(top, bits[r, k] & mask)
        tops[r] = top


@kernel(fastmath=False)
def _f16_bits(x):
    """The binary16 bits of float64 x (not NaN), rounded to nearest, ties to even: the bits of
    np.float16(x) (NumPy rounds float64 directly, not through float32)."""
    bits = np.float64(x).view(np.int64)
    # Branch-free sign and rounding: in q4g the sign, everywhere the rounding direction, is random.
    sign = (bits >> 48) & 0x8000
    a = abs(x)
    if a >= 65520.0:  # halfway from the largest finite half, 65504, to the next step: inf
        return sign | 0x7C00
    if a < 2.0**-14:  # subnormal: a count of 2**-24 (1024 carries into the smallest normal)
        return sign | np.int64(np.rint(a * 2.0**24))
    # Keep 10 of the 52 mantissa bits, adding just under half of the dropped unit plus the kept
    # last bit (ties to even); a carry runs on into the exponent. Then rebias it, 1023 -> 15.
    magnitude = bits & _ABS
    rounded = (magnitude + (1 << 41) - 1 + ((magnitude >> 42) & 1)) >> 42
    return sign | (rounded - (1008 << 10))


@kernel(fastmath=False)
def _f16_value(h):
    """The float64 value of binary16 bits h (not NaN)."""
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:
        magnitude = np.float64(m * 2.0**-24).view(np.int64)
    elif e == 31:
        magnitude = 0x7FF0000000000000  # inf
    else:
        magnitude = ((e + 1008) << 52) | (m << 42)
    return np.int64(magnitude | ((h & 0x8000) << 48)).view(np.float64)


@kernel(fastmath=False, inline="always")
def _load_tile(w, b, g, tile):
    """tile[16, 32] float64 = w[16b : 16b + 16, 32g : 32g + 32] of w [R, K], zero past R and K."""
    R, K = w.shape
    k0 = g * GROUP
    for r in range(ROWS):
        n = b * ROWS + r
        valid = min(GROUP, K - k0) if n < R else 0
        for j in range(valid):
            tile[r, j] = w[n, k0 + j]
        for j in range(valid, GROUP):
            tile[r, j] = 0.0


@kernel(inline="always")
def _abs_top(bits):
    """The largest |w| of bits [32] (float64 weights viewed as int64), as the integer bits of its
    float64: the integer max vectorises, a float max without fast-math is a serial chain."""
    t = 0
    for j in range(GROUP):
        t = max(t, bits[j] & _ABS)
    return t


@parallel_kernel(fastmath=False)
def _q8g_quantize(w, tscale, qs, scales):
    """q8g codes qs [NB, G, 128] (uint32 words: 4 int8 codes of one row) and float16 scale bits
    scales [NB, G, 16] uint16 of the rows w [R, K] float32/float64 (R <= 16 NB)."""
    qmax = _Q8G_MAX
    for b in prange(qs.shape[0]):
        tile = np.empty((ROWS, GROUP))
        bits = tile.view(np.int64)
        d = np.empty(ROWS)
        codes = np.empty((ROWS, GROUP), np.int8)
        words = codes.view(np.uint32)  # [16, 8]
        for g in range(qs.shape[1]):
            _load_tile(w, b, g, tile)
            for r in range(ROWS):
                h = _f16_bits(np.int64(_abs_top(bits[r])).view(np.float64) / qmax / tscale)
                scales[b, g, r] = h
                d[r] = _f16_value(h) * tscale
            for r in range(ROWS):
                dr = d[r]
                if dr != 0:
                    for j in range(GROUP):
                        codes[r, j] = np.int8(min(qmax, max(-qmax, np.rint(tile[r, j] / dr))))
                else:
                    for j in range(GROUP):
                        codes[r, j] = 0
            for c in range(GROUP // 4):
                for r in range(ROWS):
                    qs[b, g, ROWS * c + r] = words[r, c]


@parallel_kernel(fastmath=False)
def _q4g_quantize(w, tscale, qs, scales):
    """q4g codes qs [NB, G, 64] (uint32 words: 4 bytes of one row, each holding inputs j and
    j + 16 in its low and high nibble) and float16 scale bits scales [NB, G, 16] uint16 of the
    rows w [R, K] float32/float64 (R <= 16 NB)."""
    qmax, offset = _Q4G_MAX, _Q4G_OFFSET
    for b in prange(qs.shape[0]):
        tile = np.empty((ROWS, GROUP))
        bits = tile.view(np.int64)
        d = np.empty(ROWS)
        top = np.empty(ROWS, np.int64)
        codes = np.empty((ROWS, GROUP), np.uint8)
        words = codes.view(np.uint32)  # [16, 8]
        for g in range(qs.shape[1]):
            _load_tile(w, b, g, tile)
            # All maxima first: in the loop below LLVM leaves the max reduction scalar.
            for r in range(ROWS):
                top[r] = _abs_top(bits[r])
            for r in range(ROWS):
                # The signed weight of largest magnitude, the first one on a tie (as np.argmax), is -8.
                first = 0
                for j in range(GROUP - 1, -1, -1):
                    if bits[r, j] & _ABS == top[r]:
                        first = j
                h = _f16_bits(-tile[r, first] / qmax / tscale)
                scales[b, g, r] = h
                d[r] = _f16_value(h) * tscale
            for r in range(ROWS):
                dr = d[r]
                if dr != 0:
                    for j in range(GROUP):
                        codes[r, j] = np.int8(min(qmax - 1, max(-qmax, np.rint(tile[r, j] / dr)))) + offset
                else:
                    for j in range(GROUP):
                        codes[r, j] = offset
            # Codes are 0..15: shifting a word of 4 codes by 4 keeps each in its byte's high nibble.
            for c in range(GROUP // 8):
                for r in range(ROWS):
                    qs[b, g, ROWS * c + r] = words[r, c] | (words[r, c + GROUP // 8] << 4)
