"""Float64 oracles for the weight formats of `waste.kernels.quant`.

They read a QMatrix's buffers by the byte-layout formulas of docs/QUANT.md, element by
element index arithmetic rather than the fast code's reshapes, and never call the kernels.

- `reference_dequantize(qm)`: the weights [N, K] in float64 (exact: code * scale * tscale).
- `reference_quantize_activation(X)`: int8 codes [T, G, 32] and scales [T, G] per group of
  32; the codes are defined by IEEE float32 arithmetic (scale amax / 127, inverse 127 / amax,
  round half to even), reproduced here with NumPy float32 scalars so they match exactly.
- `reference_matmul(qm, X)` / `reference_matvec(qm, x)`: the product in float64 from those
  integers (q formats) or from the float32/bfloat16 weights (unquantised formats).
"""

from __future__ import annotations

import numpy as np

GROUP = 32
ROWS = 16


def _codes_and_scales(qm) -> tuple[np.ndarray, np.ndarray]:
    """Signed integer codes [N, G, 32] (value / scale) and float64 scales [N, G] of a q matrix."""
    n, _ = qm.shape
    qs = np.asarray(qm.buffers["qs"])  # [NB, G, bytes of one group of one block]
    g_count = qs.shape[1]
    rows = np.arange(n)[:, None, None]  # [N, 1, 1]
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


def reference_dequantize(qm) -> np.ndarray:
    """The weights [N, K] a QMatrix stands for, in float64."""
    n, k = qm.shape
    if qm.fmt == "f32":
        return np.asarray(qm.buffers["w"], np.float64)
    if qm.fmt == "bf16":
        bits = np.asarray(qm.buffers["w"]).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    codes, scales = _codes_and_scales(qm)
    return (codes * scales[:, :, None]).reshape(n, codes.shape[1] * GROUP)[:, :k]


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


def reference_matmul(qm, X: np.ndarray) -> np.ndarray:
    """Y [T, N] = X W^T in float64; q formats multiply the int8 activation codes."""
    X = np.asarray(X, np.float32)
    if qm.fmt in ("f32", "bf16"):
        return X.astype(np.float64) @ reference_dequantize(qm).T
    wcodes, wscales = _codes_and_scales(qm)  # [N, G, 32], [N, G]
    xcodes, xscales = reference_quantize_activation(X)  # [T, G, 32], [T, G]
    dots = np.einsum("ngj,tgj->tng", wcodes, xcodes)  # exact integers
    return np.einsum("tng,ng,tg->tn", dots.astype(np.float64), wscales, xscales)


def reference_matvec(qm, x: np.ndarray) -> np.ndarray:
    """y [N] = W x in float64 (the one-token case of reference_matmul)."""
    return reference_matmul(qm, np.asarray(x)[None, :])[0]
