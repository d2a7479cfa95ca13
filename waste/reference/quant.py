"""Float64 oracles for the weight formats of `waste.kernels.quant`.

They read a QMatrix's buffers by the byte-layout formulas of docs/QUANT.md, element by
element index arithmetic rather than the fast code's reshapes, and never call the kernels.

- `reference_dequantize(qm, rows=None)`: the weights [N, K] (or only the given rows, the
  embedding lookup) in float64 (exact: code * scale * tscale), for f32, bf16, q8g and q4g;
  mxfp4 from its E2M1 and E8M0 definitions (waste.reference.mxfp4).
- `reference_quantize_activation(X)`: int8 codes [T, G, 32] and scales [T, G] per group of
  32; the codes are defined by IEEE float32 arithmetic (scale amax / 127, inverse 127 / amax,
  round half to even), reproduced here with NumPy float32 scalars so they match exactly.
- `reference_matmul(qm, X)` / `reference_matvec(qm, x)`: the product in float64 from those
  integers (q formats and mxfp4), from the float32 weights and activations (f32), or from the
  bfloat16 weights and the activations rounded to bfloat16 (bf16, `reference_round_to_bf16`).
- `reference_quantize(w, fmt)`: the q8g/q4g buffers (qs, scales, tscale) of a weight matrix in
  NumPy float64 whole-array operations (the first implementation, kept as the oracle; it lays the
  bytes out by reshapes, which `reference_dequantize`'s formulas check). The Numba quantiser
  must match it byte for byte.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from waste.errors import WasteError
from waste.reference.mxfp4 import reference_dequantize_mxfp4

GROUP = 32
ROWS = 16
QMAX = {"q8g": 127, "q4g": 8}  # |code - offset| of the group's extreme weight
Q4_OFFSET = 8  # a q4g nibble stores the signed value + 8 (q8g stores the int8 value)
BLOCK_BYTES = {"q8g": GROUP * ROWS, "q4g": GROUP * ROWS // 2}  # one group of one 16-row block
SCALE_EXPONENT = 14  # the largest group scale / tscale lies in [2**14, 2**15)
BLOCK_ROWS = 4096  # rows quantised at once, bounding the float64 temporaries


def _codes_and_scales(qm, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Signed integer codes [R, G, 32] (value / scale) and float64 scales [R, G] of a q matrix's
    rows (all N rows when `rows` is None)."""
    n, _ = qm.shape
    qs = np.asarray(qm.buffers["qs"])  # [NB, G, bytes of one group of one block]
    g_count = qs.shape[1]
    rows = (np.arange(n) if rows is None else np.asarray(rows, np.int64))[:, None, None]  # [R, 1, 1]
    groups = np.arange(g_count)[None, :, None]  # [1, G, 1]
    j = np.arange(GROUP)[None, None, :]  # [1, 1, 32] position inside the group
    block, lane = rows // ROWS, rows % ROWS
    if qm.fmt == "q8g":
        # 64-byte chunk j // 4 holds codes 4 (j // 4) .. + 3 of the 16 rows, 4 bytes per row.
        pos = (j // 4) * 64 + 4 * lane + j % 4
        codes = qs[block, groups, pos].astype(np.int64)
    elif qm.fmt == "q4g":
        # codes j and j + 16 share a byte (low and high nibble) at the q8g position of j % 16.
        jj = j % 16
        pos = (jj // 4) * 64 + 4 * lane + jj % 4
        byte = qs[block, groups, pos].astype(np.int64)
        codes = np.where(j < 16, byte & 15, byte >> 4) - 8
    else:
        raise ValueError(f"not a grouped format: {qm.fmt}")
    scales = np.asarray(qm.buffers["scales"])[block[:, :, 0], groups[:, :, 0], lane[:, :, 0]]
    return codes, scales.astype(np.float64) * float(qm.buffers["tscale"][0])


def reference_dequantize(qm, rows: np.ndarray | None = None) -> np.ndarray:
    """The weights [N, K] a QMatrix stands for in float64, or only rows `rows` [R] -> [R, K]
    (the embedding lookup: a real vocabulary's whole table would not fit in float64)."""
    n, k = qm.shape
    ids = np.arange(n) if rows is None else np.asarray(rows, np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        raise ValueError(f"row ids must lie in [0, {n}), got {ids.min()}..{ids.max()}")
    if qm.fmt == "f32":
        return np.asarray(qm.buffers["w"])[ids].astype(np.float64)
    if qm.fmt == "bf16":
        # bfloat16 is the top half of a float32: shift the 16 stored bits up and reinterpret.
        bits = np.asarray(qm.buffers["w"])[ids].astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    if qm.fmt == "mxfp4":
        return reference_dequantize_mxfp4(np.asarray(qm.buffers["packed"])[ids], np.asarray(qm.buffers["scales"])[ids])
    if qm.fmt not in QMAX:
        raise WasteError(f"the float64 reference has no dequantiser for weight format {qm.fmt!r}")
    codes, scales = _codes_and_scales(qm, ids)
    return (codes * scales[:, :, None]).reshape(ids.size, codes.shape[1] * GROUP)[:, :k]


def reference_quantize_activation(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """X [T, K] -> (codes [T, G, 32] int64, scales [T, G] float64), zero-padded to 32G.

    A group holding NaN or an infinity gets codes 0 and scale NaN.
    """
    X = np.asarray(X, np.float32)
    T, K = X.shape
    G = -(-K // GROUP)
    codes = np.zeros((T, G, GROUP), np.int64)
    scales = np.zeros((T, G), np.float64)
    for t in range(T):
        for g in range(G):
            part = X[t, g * GROUP:(g + 1) * GROUP]
            if not np.isfinite(part).all():
                scales[t, g] = np.nan
                continue
            amax = np.float32(np.abs(part).max())
            if amax == 0:
                continue
            inv = np.float32(127.0) / amax
            codes[t, g, : part.size] = np.clip(np.rint(part * inv), -127, 127).astype(np.int64)
            scales[t, g] = float(amax / np.float32(127.0))
    return codes, scales


def reference_round_activation_int8(X: np.ndarray) -> np.ndarray:
    """X [..., K] as a q8g, q4g or mxfp4 product sees it, in float64: per row and group of 32 along
    K, the codes rint(x * (127 / amax)) in [-127, 127] (float32 arithmetic) times amax / 127, as in
    docs/QUANT.md "Activations" (the values `reference_quantize_activation`'s codes and scales stand
    for). A group holding NaN or an infinity becomes NaN."""
    X = np.asarray(X, np.float32)
    K = X.shape[-1]
    rows = X.reshape(-1, K)
    G = -(-K // GROUP)
    groups = np.zeros((rows.shape[0], G * GROUP), np.float32)
    groups[:, :K] = rows
    groups = groups.reshape(rows.shape[0], G, GROUP)
    finite = np.isfinite(groups).all(axis=-1)
    amax = np.where(finite, np.abs(np.where(np.isfinite(groups), groups, 0)).max(axis=-1), np.float32(0))
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0)).astype(np.float32)
    codes = np.clip(np.rint(np.where(np.isfinite(groups), groups, 0) * inv[..., None]), -127, 127)
    scales = np.where(finite, (amax / np.float32(127.0)).astype(np.float64), np.nan)
    out = codes.astype(np.float64) * scales[..., None]
    return out.reshape(rows.shape[0], G * GROUP)[:, :K].reshape(X.shape)


def reference_round_to_bf16(X: np.ndarray) -> np.ndarray:
    """X float32 rounded to bfloat16 as vcvtneps2bf16 does, in float64: to nearest, ties to even;
    float32 subnormals become zeros of their sign; NaN stays NaN."""
    X = np.asarray(X, np.float32)
    rounded = X.astype(ml_dtypes.bfloat16).astype(np.float64)
    return np.where(np.abs(X) < np.float32(2.0**-126), np.copysign(0.0, X), rounded)


def reference_matmul(qm, X: np.ndarray) -> np.ndarray:
    """Y [T, N] = X W^T in float64; q formats multiply the int8 activation codes, bf16 the
    activations rounded to bfloat16."""
    X = np.asarray(X, np.float32)
    if qm.fmt == "f32":
        return X.astype(np.float64) @ reference_dequantize(qm).T
    if qm.fmt == "bf16":
        return reference_round_to_bf16(X) @ reference_dequantize(qm).T
    if qm.fmt == "mxfp4":
        # An E2M1 value times a power of two, times an int8 code, summed over a group: exact.
        n, k = qm.shape
        w = reference_dequantize(qm).reshape(n, k // GROUP, GROUP)
        xcodes, xscales = reference_quantize_activation(X)
        dots = np.einsum("tgj,ngj->tng", xcodes.astype(np.float64), w)  # exact group sums
        return np.einsum("tng,tg->tn", dots, xscales)
    wcodes, wscales = _codes_and_scales(qm)  # [N, G, 32], [N, G]
    xcodes, xscales = reference_quantize_activation(X)  # [T, G, 32], [T, G]
    dots = np.einsum("ngj,tgj->tng", wcodes, xcodes)  # exact integers
    return np.einsum("tng,ng,tg->tn", dots.astype(np.float64), wscales, xscales)


def reference_matvec(qm, x: np.ndarray) -> np.ndarray:
    """y [N] = W x in float64 (the one-token case of reference_matmul)."""
    return reference_matmul(qm, np.asarray(x)[None, :])[0]


def reference_quantize(w: np.ndarray, fmt: str) -> dict[str, np.ndarray]:
    """The buffers of w [N, K] in q8g or q4g: qs [NB, G, bytes], scales [NB, G, 16] float16 and
    tscale [1] float32 (docs/QUANT.md, "Values" and "Byte layout"). Weights are read as float64."""
    w = np.asarray(w)
    if w.ndim != 2 or fmt not in QMAX:
        raise ValueError(f"need a 2-D weight and format q8g or q4g, got {w.shape} and {fmt!r}")
    n, k = w.shape
    nb, g = -(-n // ROWS), -(-k // GROUP)
    wmax = 0.0
    for r0 in range(0, n, BLOCK_ROWS):
        part = np.asarray(w[r0:r0 + BLOCK_ROWS], np.float64)
        if not np.isfinite(part).all():
            raise ValueError("weights must be finite")
        wmax = max(wmax, float(np.abs(part).max(initial=0.0)))
    tscale = reference_tensor_scale(wmax / QMAX[fmt])
    qs = np.empty((nb, g, BLOCK_BYTES[fmt]), np.int8 if fmt == "q8g" else np.uint8)
    scales = np.empty((nb, g, ROWS), np.float16)
    step = BLOCK_ROWS // ROWS
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        qs[b0:b1], scales[b0:b1] = reference_quantize_blocks(w[b0 * ROWS:b1 * ROWS], b1 - b0, k, fmt, tscale)
    return {"qs": qs, "scales": scales, "tscale": np.array([tscale], np.float32)}


def reference_tensor_scale(dmax: float) -> float:
    """The power of two tscale that puts the largest group scale dmax / tscale in [2**14, 2**15)."""
    if dmax == 0.0:
        return 1.0
    exponent = math.frexp(dmax)[1] - 1 - SCALE_EXPONENT
    return math.ldexp(1.0, min(127, max(-126, exponent)))


def reference_quantize_blocks(w: np.ndarray, nb: int, k: int, fmt: str, tscale: float) -> tuple[np.ndarray, np.ndarray]:
    """Codes [nb, G, bytes] and float16 scales [nb, G, 16] of up to 16 nb rows of w [R, k]
    (rows past R and inputs past k are zero)."""
    g = -(-k // GROUP)
    wg = np.zeros((nb * ROWS, g * GROUP), np.float64)
    wg[: w.shape[0], :k] = w
    wg = wg.reshape(nb * ROWS, g, GROUP)
    if fmt == "q8g":
        # Symmetric: the largest |w| of the group maps to +-127.
        extreme = np.abs(wg).max(axis=-1)
    else:
        # ggml's Q4_0: the signed weight of largest magnitude (the first, on a tie) maps to code 0
        # (value -8), so all 16 levels are used; a weight of the opposite sign and equal size clips to +7.
        extreme = -np.take_along_axis(wg, np.abs(wg).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    s16 = (extreme / QMAX[fmt] / tscale).astype(np.float16)
    # Codes are chosen against the scale actually stored, so dequantised values are exact
    # multiples of it and quantising them again gives the same values.
    d = s16.astype(np.float64) * tscale
    ratio = np.divide(wg, d[..., None], out=np.zeros_like(wg), where=d[..., None] != 0)
    if fmt == "q8g":
        codes = np.clip(np.rint(ratio), -127, 127).astype(np.int8)
        qs = codes.reshape(nb, ROWS, g, GROUP // 4, 4).transpose(0, 2, 3, 1, 4)
    else:
        codes = np.clip(np.rint(ratio) + Q4_OFFSET, 0, 15).astype(np.uint8)
        packed = codes[..., : GROUP // 2] | (codes[..., GROUP // 2:] << 4)
        qs = packed.reshape(nb, ROWS, g, GROUP // 8, 4).transpose(0, 2, 3, 1, 4)
    return qs.reshape(nb, g, BLOCK_BYTES[fmt]), s16.reshape(nb, ROWS, g).transpose(0, 2, 1)


# How each stored format's product rounds its input (`RoundedInputWeights`); f32 does not.
ACTIVATION_ROUNDING = {"q8g": reference_round_activation_int8, "q4g": reference_round_activation_int8,
                       "mxfp4": reference_round_activation_int8, "bf16": reference_round_to_bf16}


class RoundedInputWeights:
    """Float64 weights w [N, K] whose products `x @ w.T` first round x as the engine's product over
    the stored format does (`ACTIVATION_ROUNDING`): the rounding model behind `waste check`'s
    tolerance. `np.asarray` gives the plain weights, for uses that are no such product (MLA's
    kv_b_proj, which the engine applies in float32 from its dequantised weights)."""

    __array_ufunc__ = None  # `x @ self.T` defers to `_RoundedTranspose.__rmatmul__`

    def __init__(self, w: np.ndarray, fmt: str):
        self.w, self.round_input = w, ACTIVATION_ROUNDING[fmt]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    @property
    def T(self) -> _RoundedTranspose:  # noqa: N802 - numpy's spelling
        return _RoundedTranspose(self)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:  # noqa: ANN001 - numpy's protocol
        return self.w if dtype is None else self.w.astype(dtype, copy=False)


class _RoundedTranspose:
    __array_ufunc__ = None

    def __init__(self, weights: RoundedInputWeights):
        self.weights = weights

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        return self.weights.round_input(x) @ self.weights.w.T


def product_weights(w) -> np.ndarray | RoundedInputWeights:  # noqa: ANN001 - an array or RoundedInputWeights
    """The weights of a product `x @ w.T` as float64, keeping a `RoundedInputWeights` as it is."""
    return w if isinstance(w, RoundedInputWeights) else np.asarray(w, np.float64)
