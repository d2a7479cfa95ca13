"""Weight storage formats and the matrix products over them.

A weight matrix `[N, K]` (N output rows, K inputs, PyTorch's Linear layout) is held as a
`QMatrix`: a format name, the logical shape, and named NumPy buffers whose dtypes and
shapes follow from (format, shape) alone, so a container can store the buffers back to
back and hand out zero-copy views on read.

Formats (byte layouts, bits per weight and the measurements behind them: docs/QUANT.md):
- "f32": float32, exact; products in a Numba kernel whose rows do not depend on the token count.
- "bf16": bfloat16 bits as uint16; products round the activations to bf16 and follow
  AVX512_BF16's vdpbf16ps (waste/kernels/bf16.py).
- "q8g": int8 codes in [-127, 127], one float16 scale per group of 32 along K (8.5 bits).
- "q4g": 4-bit codes 0..15 standing for (code - 8), one float16 scale per group (4.5 bits).
- "mxfp4": OCP MXFP4 as compressed-tensors stores it, E2M1 nibbles and one E8M0 scale byte
  per group of 32 (4.25 bits; K must be a multiple of 32): `waste.kernels.mxfp4`.

The formats' constants and buffer layouts are in `waste.qformat` (no Numba, so the container
and the planner read them without compiling kernels); the q8g / q4g quantiser is in
`waste.kernels.quantize`; the integer dot-product blocks in `waste.kernels.int8_blocks`.

The q formats pad K to a multiple of 32 and N to a multiple of 16, and interleave 16 rows so
that one group of one 16-row block is a run of 64-byte chunks, each holding 4 consecutive K
codes for each of the 16 rows: the layout of AVX-512 VNNI's `vpdpbusd` (64 unsigned bytes
times 4 broadcast signed bytes, summed into 16 int32 lanes). A per-matrix power of two
(`tscale`) keeps every float16 group scale in the normal range whatever the weights' size.

`quantize` converts in two streaming Numba passes (the largest |w|, then codes and scales) that
give byte for byte the buffers of the float64 NumPy oracle `reference_quantize`.

Products quantise the activations once per call to int8 per group of 32 with a float32
scale (`waste.kernels.activations`), sum integer products per group in int32 (exact), then
scale in float32.

Shapes: x [K], X [T, K], y [N], Y [T, N].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numba
import numpy as np

from waste.errors import WasteError
from waste.jit import kernel, num_threads, parallel_kernel, prange
from waste.kernels import mxfp4
from waste.kernels.activations import _quantize_token, quantized_activations
from waste.kernels.bf16 import bf16_matmul, f32_matmul
from waste.kernels.int8_blocks import ISA, make_rows
from waste.kernels.pointers import pointer
from waste.kernels.quantize import _f16_value, quantize_grouped
from waste.kernels.steal import fetch_add, new_ranges, next_item
from waste.qformat import BLOCK_BYTES, CODE_OFFSET, FORMATS, GROUP, ROWS, buffer_layout, padded_shape

Q_FORMATS = ("q8g", "q4g", "mxfp4")  # the formats of the integer products
# An mxfp4 product sums twice the E2M1 values: the per-matrix scale halves it.
MXFP4_TSCALE = np.array([0.5], np.float32)


@dataclass(frozen=True)
class QMatrix:
    """A weight matrix [N, K] in one storage format."""

    fmt: str
    shape: tuple[int, int]
    buffers: dict[str, np.ndarray]

    def __post_init__(self) -> None:
        # A one-token decode makes hundreds of products, so what a q product derives from the
        # buffers (the kernel, contiguous buffers, the scales' uint16 view) is derived once here.
        if self.fmt in ("q8g", "q4g"):
            qs, scales, tscale = (np.ascontiguousarray(self.buffers[b]) for b in ("qs", "scales", "tscale"))
            scales = scales.view(np.uint16)
        elif self.fmt == "mxfp4":
            # The stored bytes stay as they are; the kernels read a copy in the 16-row interleave,
            # made once here, as large as the stored bytes (waste.kernels.mxfp4).
            nb, g = padded_shape(self.shape)
            qs, scales = np.empty((nb, g, BLOCK_BYTES["mxfp4"]), np.uint8), np.empty((nb, g, ROWS), np.uint8)
            mxfp4.repack_interleaved(self.buffers["packed"], self.buffers["scales"], qs, scales)
            tscale = MXFP4_TSCALE
        else:
            # A row of a dense_products table: where the weights live, and their rows.
            object.__setattr__(self, "_drow", np.array((self.buffers["w"].ctypes.data, self.shape[0]),
                                                       np.int64).tobytes())
            return
        # qs[:0], scales[:0]: the empty second matrix of a single product
        object.__setattr__(self, "_qargs", (qs, scales, tscale, qs.shape[0] * ROWS, qs[:0], scales[:0]))
        # This matrix's row of a QBatch table (where the kernels' buffers live, its row blocks, its
        # format) and its tensor scale, as bytes: a batch joins its matrices' bytes into arrays in
        # about a microsecond, where NumPy takes ten to convert a list of tuples.
        row = (qs.ctypes.data, scales.ctypes.data, qs.shape[0], Q_FORMATS.index(self.fmt))
        object.__setattr__(self, "_qrow", np.array(row, np.int64).tobytes())
        object.__setattr__(self, "_qtscale", np.float32(tscale[0]).tobytes())

    @property
    def nbytes(self) -> int:
        """Bytes of the stored buffers (mxfp4's repacked copy for the kernels is as large again)."""
        return sum(int(b.nbytes) for b in self.buffers.values())

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """y = W x for one token: x [K] float32 -> y [N] float32."""
        x = np.asarray(x)
        if x.shape != (self.shape[1],):
            raise WasteError(f"{self.fmt} matrix {self.shape}: matvec input must have shape ({self.shape[1]},), "
                             f"got {x.shape}")
        if self.fmt == "f32":
            return f32_matmul(self.buffers["w"], np.ascontiguousarray(x, np.float32).reshape(1, -1))[0]
        if self.fmt == "bf16":
            return bf16_matmul(self.buffers["w"], np.ascontiguousarray(x, np.float32).reshape(1, -1))[0]
        return _qproduct(self, np.ascontiguousarray(x, np.float32).reshape(1, -1))[0]

    def matmul(self, X: np.ndarray) -> np.ndarray:
        """Y = X W^T for a chunk: X [T, K] float32 -> Y [T, N] float32 (any T; blocks of 4 tokens)."""
        X = np.asarray(X)
        n, k = self.shape
        if X.ndim != 2 or X.shape[1] != k:
            raise WasteError(f"{self.fmt} matrix {self.shape}: matmul input must have shape [T, {k}], got {X.shape}")
        X = np.ascontiguousarray(X, np.float32)
        if self.fmt == "f32":
            return f32_matmul(self.buffers["w"], X)
        if self.fmt == "bf16":
            return bf16_matmul(self.buffers["w"], X)
        return _qproduct(self, X)

    def dequantize(self) -> np.ndarray:
        """The float32 weights [N, K] this matrix stands for."""
        if self.fmt == "f32":
            return self.buffers["w"]
        if self.fmt == "bf16":
            return _bf16_to_f32(self.buffers["w"])
        return self.take_rows(np.arange(self.shape[0]))

    def take_rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantised rows W[ids]: ids [L] int -> [L, K] float32 (the embedding lookup)."""
        ids = np.asarray(ids)
        n, k = self.shape
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise WasteError(f"row ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            raise WasteError(f"row id out of range [0, {n}): min {ids.min()}, max {ids.max()}")
        if self.fmt == "f32":
            return np.ascontiguousarray(self.buffers["w"][ids])
        if self.fmt == "bf16":
            return _bf16_to_f32(self.buffers["w"][ids])
        if self.fmt == "mxfp4":
            return mxfp4.dequantize_mxfp4(self.buffers["packed"][ids], self.buffers["scales"][ids])
        out = np.empty((len(ids), k), np.float32)
        qs, scales, tscale = self._qargs[:3]  # type: ignore[attr-defined]
        _take_q_rows(qs, scales, tscale[0], ids.astype(np.int64), out)
        return out


Q4_BLOCK_BYTES = BLOCK_BYTES["q4g"]
CODE_OFFSET_Q4 = CODE_OFFSET["q4g"]


@kernel(fastmath=False)
def _take_q_rows(qs, scales, tscale, ids, out):
    """out [L, K] = rows ids [L] of a q8g (int8 codes) or q4g (uint8, two a byte) matrix: each
    code times its group's scale times tscale, in float32 (scale x tscale is exact: tscale is a
    power of two). One call with no temporaries: in a decode step's embedding lookup NumPy's
    gathers took 64-80 us (docs/QUANT.md), the row's codes spread over the 16-row interleave."""
    K = out.shape[1]
    G = qs.shape[1]
    four_bit = qs.shape[2] == Q4_BLOCK_BYTES
    for i in range(ids.shape[0]):
        b, r = ids[i] // ROWS, ids[i] % ROWS
        for g in range(G):
            scale = np.float32(_f16_value(np.int64(scales[b, g, r]))) * tscale
            for k in range(GROUP):
                col = g * GROUP + k
                if col >= K:
                    break
                # Element k = 4c + j sits at byte 64c + 4r + j of the group (q4g: the low nibble
                # for k < 16, the high nibble of element k - 16 above).
                if four_bit:
                    byte = np.int32(qs[b, g, 64 * ((k % 16) // 4) + 4 * r + k % 4])
                    code = ((byte >> 4) if k >= 16 else (byte & 15)) - CODE_OFFSET_Q4
                else:
                    code = np.int32(qs[b, g, 64 * (k // 4) + 4 * r + k % 4])
                out[i, col] = np.float32(code) * scale


def matmul_pair(X: np.ndarray, a: QMatrix, b: QMatrix) -> tuple[np.ndarray, np.ndarray]:
    """(X a^T, X b^T) for X [T, K] float32: a SwiGLU's gate and up products.

    Equal to (a.matmul(X), b.matmul(X)) bit for bit; when both are q matrices of one format and
    shape it is one kernel call that quantises X once and runs both in one parallel region.
    """
    if a.fmt != b.fmt or a.fmt not in ("q8g", "q4g", "mxfp4") or a.shape != b.shape:
        return a.matmul(X), b.matmul(X)
    X = np.asarray(X)
    if X.ndim != 2 or X.shape[1] != a.shape[1]:
        raise WasteError(f"{a.fmt} matrix {a.shape}: matmul input must have shape [T, {a.shape[1]}], got {X.shape}")
    X = np.ascontiguousarray(X, np.float32)
    qa, sa, ta, padded, _, _ = a._qargs  # type: ignore[attr-defined]
    qb, sb, tb, _, _, _ = b._qargs  # type: ignore[attr-defined]
    Ya = np.empty((X.shape[0], padded), np.float32)
    Yb = np.empty_like(Ya)
    _q_product(X, qa, sa, ta, qb, sb, tb, Ya, Yb, num_threads())
    if padded != a.shape[0]:
        return np.ascontiguousarray(Ya[:, :a.shape[0]]), np.ascontiguousarray(Yb[:, :a.shape[0]])
    return Ya, Yb


def batchable(matrices: Sequence[QMatrix]) -> bool:
    """Whether q_products multiplies these matrices in one call: q matrices (q8g, q4g, mxfp4) of
    at most two formats and one input width K (any number of rows each)."""
    kinds = {(m.fmt, m.shape[1]) for m in matrices}
    return (len({k for _, k in kinds}) == 1 and len({f for f, _ in kinds}) <= 2
            and all(f in Q_FORMATS for f, _ in kinds))


class QBatch:
    """A fixed list of q matrices multiplied in one kernel call (`_q_products` for a decode step,
    `_q_spans` for a prefill), with everything the call derives from the matrices (addresses, row
    blocks, formats, scales) built once: a decode step runs the same products on every token, a
    MoE prefill every expert of a layer. Holds the matrices, so the addresses stay valid.

    `QBatch(matrices)(X, rows)` -> Y [M, Nmax]: Y[m, :N_m] = W_m X[rows[m]], bit for bit
    W_m.matvec(X[rows[m]]) (decode). `.spans(X, x_start, count, y_start, out_rows)` -> Y
    [out_rows, Nmax]: Y[y_start[m] + j, :N_m] = W_m X[x_start[m] + j] for j < count[m], bit for
    bit W_m.matmul(X[x_start[m]:x_start[m] + count[m]]) (the experts of a prefill, each on its
    own rows). Y is a fresh array per call."""

    def __init__(self, matrices: Sequence[QMatrix], *, checked: bool = False):
        """`checked`: the caller has seen `batchable(matrices)` hold (a decode step's experts,
        `waste.kernels.moe.run_together`), which is then not tested again."""
        if not checked and (not matrices or not batchable(matrices)):
            raise WasteError("q_products multiplies q matrices (q8g, q4g, mxfp4) of at most two formats and one "
                             "input width, got " + ", ".join(sorted({f"{m.fmt} {m.shape}" for m in matrices})))
        self.matrices = list(matrices)
        self.k = matrices[0].shape[1]
        # [M, 4]: codes' address, scales' address, row blocks of 16, format (index in Q_FORMATS)
        rows = bytearray(b"".join([m._qrow for m in matrices]))  # type: ignore[attr-defined]
        self.table = np.frombuffer(rows, np.int64).reshape(-1, 4)
        tscales = bytearray(b"".join([m._qtscale for m in matrices]))  # type: ignore[attr-defined]
        self.tscales = np.frombuffer(tscales, np.float32)  # [M]
        first = matrices[0]
        other = next((m for m in matrices if m.fmt != first.fmt), first)
        self.first_format = Q_FORMATS.index(first.fmt)
        # (codes, scales) that hold no rows, one pair per format: they pick each format's kernel
        self.likes = (*first._qargs[4:], *other._qargs[4:])  # type: ignore[attr-defined]
        self.width = max(m._qargs[3] for m in matrices)  # type: ignore[attr-defined]  # rows padded to 16

    def __call__(self, X: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """X [R, K] float32 C-contiguous, rows [M] int64 in [0, R) (the caller's promise: unchecked)."""
        Y = np.empty((len(self.matrices), 1, self.width), np.float32)
        _q_products(X, rows, self.table, self.tscales, self.first_format, *self.likes, Y, num_threads())
        return Y[:, 0]

    def spans(self, X: np.ndarray, x_start: np.ndarray, count: np.ndarray, y_start: np.ndarray,
              out_rows: int) -> np.ndarray:
        """X [R, K] float32 C-contiguous; x_start, count, y_start [M] int64 with every span inside X
        and inside the out_rows output rows (the caller's promise: unchecked)."""
        Y = np.empty((out_rows, self.width), np.float32)
        _q_spans(*quantized_activations(X, self.likes[0].shape[1]), x_start, count, y_start, self.table,
                 self.tscales, self.first_format, *self.likes, Y, num_threads())
        return Y


def q_products(X: np.ndarray, matrices: Sequence[QMatrix], rows: Sequence[int]) -> np.ndarray:
    """Y [M, Nmax] with Y[m, :N_m] = W_m X[rows[m]], for X [R, K] float32 and M q matrices W_m
    [N_m, K] of at most two formats (`batchable`), in one kernel call (`_q_products`); Nmax is
    the largest N_m, and Y[m, N_m:] is left unspecified. Y[m, :N_m] equals
    W_m.matvec(X[rows[m]]) bit for bit."""
    batch = QBatch(matrices)
    X = np.ascontiguousarray(X, np.float32)
    rows = [int(r) for r in rows]
    if X.ndim != 2 or X.shape[1] != batch.k or len(rows) != len(matrices) or min(rows) < 0 or max(rows) >= len(X):
        raise WasteError(f"q matrices of width {batch.k}: inputs must be [R, {batch.k}] with row ids in [0, R) "
                         f"for each of {len(matrices)} matrices, got {X.shape} and {len(rows)} row ids")
    return batch(X, np.array(rows, np.int64))[:, :max(m.shape[0] for m in matrices)]


def q_spans(X: np.ndarray, matrices: Sequence[QMatrix], x_start: Sequence[int], count: Sequence[int],
            y_start: Sequence[int], out_rows: int) -> np.ndarray:
    """Y [out_rows, Nmax] with Y[y_start[m] + j, :N_m] = W_m X[x_start[m] + j] for j < count[m]:
    each of M q matrices W_m [N_m, K] (at most two formats, `batchable`) on its own run of rows
    of X [R, K] float32, in one kernel call (`_q_spans`). Rows of Y that no span writes, and
    Y[:, N_m:] of a span's rows, are left unspecified. Each span's rows equal
    W_m.matmul(X[x_start[m]:x_start[m] + count[m]]) bit for bit."""
    batch = QBatch(matrices)
    X = np.ascontiguousarray(X, np.float32)
    a, n, b = (np.array([int(v) for v in s], np.int64).reshape(-1) for s in (x_start, count, y_start))
    M = len(matrices)
    if (X.ndim != 2 or X.shape[1] != batch.k or not len(a) == len(n) == len(b) == M or (n < 0).any()
            or (a < 0).any() or (a + n > len(X)).any() or (b < 0).any() or (b + n > out_rows).any()):
        raise WasteError(f"q matrices of width {batch.k}: inputs must be [R, {batch.k}] with {M} spans of rows "
                         f"inside them and inside {out_rows} output rows, got {X.shape}")
    return batch.spans(X, a, n, b, int(out_rows))[:, :max(m.shape[0] for m in matrices)]


def quantize(w: np.ndarray, fmt: str) -> QMatrix:
    """Store a float weight matrix [N, K] in format `fmt` (q formats: finite weights only)."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise WasteError(f"weight must be 2-D [N, K], got shape {w.shape}")
    shape = (int(w.shape[0]), int(w.shape[1]))
    if fmt == "f32":
        return QMatrix(fmt, shape, {"w": np.ascontiguousarray(w, np.float32)})
    if fmt == "bf16":
        bits = np.ascontiguousarray(w.astype(ml_dtypes.bfloat16)).view(np.uint16)
        return QMatrix(fmt, shape, {"w": bits})
    if fmt == "mxfp4":
        packed, scales = mxfp4.quantize_mxfp4(w)
        return QMatrix(fmt, shape, {"packed": packed, "scales": scales})
    if fmt not in ("q8g", "q4g"):
        raise WasteError(f"unknown weight format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return QMatrix(fmt, shape, quantize_grouped(w, fmt))


def from_buffers(fmt: str, shape: tuple[int, int], buffers: dict[str, np.ndarray]) -> QMatrix:
    """Wrap existing buffers (e.g. views into a memory map) as a QMatrix, checking them."""
    for name, dtype, bshape in buffer_layout(fmt, shape):
        b = buffers.get(name)
        if b is None or b.dtype != dtype or tuple(b.shape) != bshape:
            raise WasteError(f"{fmt} matrix {shape}: buffer {name!r} must be {dtype} {bshape}")
    return QMatrix(fmt, shape, buffers)


def quantization_snr_db(w: np.ndarray, fmt: str, x: np.ndarray) -> float:
    """Signal-to-noise ratio (dB) of quantize(w, fmt) times x against the float64 product.

    w [N, K], x [K] or [T, K]; the noise includes the int8 rounding of the activations.
    """
    X = np.atleast_2d(np.asarray(x, np.float64))
    exact = X @ np.asarray(w, np.float64).T
    noise = quantize(w, fmt).matmul(X.astype(np.float32)).astype(np.float64) - exact
    return float(10.0 * np.log10(np.sum(exact**2) / max(np.sum(noise**2), 1e-300)))


# -- float32 and bfloat16 ----------------------------------------------------------------------


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits [..] uint16 -> float32: the upper half of a float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _qproduct(m: QMatrix, X: np.ndarray) -> np.ndarray:
    """Y [T, N] = X W^T for a q-format matrix; X [T, K] float32 contiguous."""
    qs, scales, tscale, padded, no_qs, no_scales = m._qargs  # type: ignore[attr-defined]
    Y = np.empty((X.shape[0], padded), np.float32)
    _q_product(X, qs, scales, tscale, no_qs, no_scales, tscale, Y, Y, num_threads())
    return Y if padded == m.shape[0] else np.ascontiguousarray(Y[:, :m.shape[0]])




# Entering Numba's thread pool costs microseconds, more than quantising a few tokens or
# multiplying a small matrix; below these sizes the work runs on the calling thread. Every
# output element is computed by the same code either way, so the bits do not change.
SERIAL_TOKENS = 4  # tokens quantised serially
SERIAL_BYTES = 32768  # code bytes x tokens of a product run serially

# Groups of codes a one-token work item covers at least (_q_product, _q_products): a matrix of
# fewer groups per row takes several row blocks per item. Against one block per item, measured
# interleaved in one process (random matrices of 256-512 from DRAM, 2 threads, EPYC, median):
# MoE down products (1024 x 256) q4g 39.4 -> 33.9 us, q8g 55.6 -> 49.1; KDA's rank-128 products
# 10.7 -> 9.5; 1024-wide ones 2-3% (two blocks an item); 128 groups as 64.
ITEM_GROUPS = 64


# Row block b of Y for all tokens, in the host's tiles (int8_blocks.make_rows). Numba's own
# cache would key the kernels that call it (_q_product, _q_products, _q_spans below) on this
# file alone, though they inline the blocks' generated code; waste.jit's cache directory, keyed
# on every source of the package, is what recompiles them when int8_blocks changes.
_rows = make_rows(ISA)


@parallel_kernel
def _q_product(X, qa, sa, ta, qb, sb, tb, Ya, Yb, threads):
    """Ya [T, 16NA] = X A^T and Yb [T, 16NB] = X B^T for q8g (int8 codes q [NB, G, 512]), q4g
    or repacked mxfp4 (uint8 codes q [NB, G, 256]) matrices A, B of one format with the same G
    (B may have no row blocks); scales [NB, G, 16] (float16 bits; mxfp4: E8M0 bytes), tscale [1].
    The activations are quantised once, then the row blocks of both run in parallel, shared out
    between `threads` (numba.get_num_threads(); `waste.kernels.steal`)."""
    T = X.shape[0]
    G = qa.shape[1]
    xq = np.empty((T, G * GROUP), np.int8)
    xsum = np.empty((T, G), np.int32)
    xs = np.empty((T, G), np.float32)
    if T <= SERIAL_TOKENS:
        for t in range(T):
            _quantize_token(X, t, xq, xsum, xs)
    else:
        for t in prange(T):
            _quantize_token(X, t, xq, xsum, xs)
    NA = qa.shape[0]
    if (qa.size + qb.size) * T <= SERIAL_BYTES:
        for i in range(NA + qb.shape[0]):
            if i < NA:
                _rows(qa, sa, xq, xsum, xs, Ya, ta[0], i)
            else:
                _rows(qb, sb, xq, xsum, xs, Yb, tb[0], i - NA)
    else:
        # One token: work items of several row blocks (ITEM_GROUPS); a chunk's blocks are work enough.
        per = max(1, ITEM_GROUPS // G) if T == 1 else 1
        items_a = (NA + per - 1) // per
        words = new_ranges(items_a + (qb.shape[0] + per - 1) // per, threads)
        for t in prange(threads):
            cursor = np.zeros(1, np.int64)
            i = next_item(words, t, cursor)
            while i >= 0:
                if i < items_a:
                    for b in range(i * per, min(NA, i * per + per)):
                        _rows(qa, sa, xq, xsum, xs, Ya, ta[0], b)
                else:
                    for b in range((i - items_a) * per, min(qb.shape[0], (i - items_a) * per + per)):
                        _rows(qb, sb, xq, xsum, xs, Yb, tb[0], b)
                i = next_item(words, t, cursor)



@parallel_kernel
def _q_products(X, rows, table, tscales, first_format, like_qs, like_scales, like_qs_b, like_scales_b, Y,
                threads):
    """Y[m, 0, :16 NB_m] = X[rows[m]] W_m^T for M q matrices of one input width (G groups) and at
    most two formats. table [M, 4] (QBatch) holds per matrix the addresses of its codes and
    scales, its row blocks NB_m and its format: where that is first_format the matrix is read
    as (like_qs, like_scales), else as (like_qs_b, like_scales_b) (arrays of each format's
    dtypes and block size that hold no rows); tscales [M], Y [M, 1, W], W >= 16 max NB_m. Each
    row of X is quantised once, then the row blocks of all the matrices run in one parallel
    region, shared out between `threads` (numba.get_num_threads(); `waste.kernels.steal`).

    One decode step multiplies many small matrices (a MoE layer's experts, a KDA layer's six
    input projections), and a call and a parallel region per product cost microseconds each
    against products of 10-60 us (`bench/moe_decode.py` measures a MoE layer's experts in one
    call against one by one; README "Measured"). The callers keep the matrices alive during the call: the kernel reads
    them by address. `_q_spans` does the same for runs of rows (a prefill's experts); decode
    keeps this driver, measured 10-15% faster on one token (nine down products of `mini` q4:
    39 against 45 us on one thread, 23-24 against 28-29 on two)."""
    R = X.shape[0]
    M = table.shape[0]
    G = like_qs.shape[1]
    xq = np.empty((R, G * GROUP), np.int8)
    xsum = np.empty((R, G), np.int32)
    xs = np.empty((R, G), np.float32)
    for r in range(R):
        _quantize_token(X, r, xq, xsum, xs)
    # Work item i is row block item_block[i] of matrix item_matrix[i], the first format's items
    # first. Each format's items run in a loop of their own: a branch on the format inside one
    # loop measured 25% slower (16 q4g 256 x 1024 matrices, one token, one thread: 108 against
    # 87 us), the inlined kernels no longer specialised.
    per = max(1, ITEM_GROUPS // G)  # row blocks per work item
    items = 0
    first = 0
    code_bytes = 0
    for m in range(M):
        n = (table[m, 2] + per - 1) // per
        items += n
        if table[m, 3] == first_format:
            first += n
            code_bytes += table[m, 2] * G * like_qs.shape[2]
        else:
            code_bytes += table[m, 2] * G * like_qs_b.shape[2]
    item_matrix = np.empty(items, np.int64)
    item_block = np.empty(items, np.int64)  # the item's first row block
    _fill_items(table, first_format, per, item_matrix, item_block)
    if code_bytes <= SERIAL_BYTES:
        for i in range(first):
            _matrix_rows(rows, table, tscales, like_qs, like_scales, Y, xq, xsum, xs, item_matrix[i], item_block[i],
                         per)
        for i in range(first, items):
            _matrix_rows(rows, table, tscales, like_qs_b, like_scales_b, Y, xq, xsum, xs, item_matrix[i],
                         item_block[i], per)
        return
    # Both formats' items in one region, each format's in a loop of its own (above); a thread
    # done with the first format's items goes on to the second's without waiting.
    words, words_b = new_ranges(first, threads), new_ranges(items - first, threads)
    for t in prange(threads):
        _take_items(t, words, words_b, first, rows, table, tscales, like_qs, like_scales, like_qs_b, like_scales_b, Y,
                    xq, xsum, xs, item_matrix, item_block, per, _NO_COUNT, 0, 0)


_NO_COUNT = np.zeros(0, np.int64)


@kernel
def _take_items(t, words, words_b, first, rows, table, tscales, like_qs, like_scales, like_qs_b, like_scales_b, Y, xq,
                xsum, xs, item_matrix, item_block, per, done, counter, total):
    """Thread t's share of _q_products' work items (`waste.kernels.steal`): the first format's
    (ranges `words`, items 0 .. first - 1), then the other's (`words_b`, items first ..). With a
    `done` array, each item taken adds one to done[counter] -> whether this thread did the last
    of `total` (another stage may then start: `waste.kernels.moe_step._moe_one_token`)."""
    last = False
    cursor = np.zeros(1, np.int64)
    i = next_item(words, t, cursor)
    while i >= 0:
        _matrix_rows(rows, table, tscales, like_qs, like_scales, Y, xq, xsum, xs, item_matrix[i], item_block[i], per)
        if done.size and fetch_add(done, counter, 1) == total - 1:
            last = True
        i = next_item(words, t, cursor)
    cursor[0] = 0
    i = next_item(words_b, t, cursor)
    while i >= 0:
        _matrix_rows(rows, table, tscales, like_qs_b, like_scales_b, Y, xq, xsum, xs, item_matrix[first + i],
                     item_block[first + i], per)
        if done.size and fetch_add(done, counter, 1) == total - 1:
            last = True
        i = next_item(words_b, t, cursor)
    return last


@kernel
def _fill_items(table, first_format, per, item_matrix, item_block):
    """The work items of _q_products' matrices (table [M, 4]) of `per` row blocks each: item i is
    row blocks item_block[i] .. + per - 1 of matrix item_matrix[i], the first format's items
    first -> (their count, the count of all)."""
    i = 0
    first = 0
    for pass_ in range(2):
        for m in range(table.shape[0]):
            if (table[m, 3] == first_format) == (pass_ == 0):
                for b in range(0, table[m, 2], per):
                    item_matrix[i] = m
                    item_block[i] = b
                    i += 1
        if pass_ == 0:
            first = i
    return first, i


@kernel
def _matrix_rows(rows, table, tscales, like_qs, like_scales, Y, xq, xsum, xs, m, b0, blocks):
    """Row blocks b0 .. b0 + blocks - 1 (those the matrix has) of matrix m of _q_products, its
    format given by like_qs and like_scales."""
    NB = table[m, 2]
    G = like_qs.shape[1]
    qs = numba.carray(pointer(table[m, 0], like_qs), (NB, G, like_qs.shape[2]))
    scales = numba.carray(pointer(table[m, 1], like_scales), (NB, G, ROWS))
    r = rows[m]
    for b in range(b0, min(NB, b0 + blocks)):
        _rows(qs, scales, xq[r:r + 1], xsum[r:r + 1], xs[r:r + 1], Y[m], tscales[m], b)


@parallel_kernel
def _q_spans(xq, xsum, xs, x_start, count, y_start, table, tscales, first_format, like_qs, like_scales,
             like_qs_b, like_scales_b, Y, threads):
    """Y[y_start[m] + j, :16 NB_m] = X[x_start[m] + j] W_m^T for j < count[m], for M q matrices of
    one input width (G groups) and at most two formats, X given as its quantised rows (xq, xsum,
    xs: `quantized_activations`). table [M, 4] (QBatch) holds per matrix the addresses of its
    codes and scales, its row blocks NB_m and its format: where that is first_format the matrix
    is read as (like_qs, like_scales), else as (like_qs_b, like_scales_b) (arrays of each
    format's dtypes and block size that hold no rows); tscales [M], Y [RY, W], W >= 16 max NB_m.
    The row blocks of all the matrices run in one parallel region, split between the `threads`
    by their rows' work (the caller passes numba.get_num_threads(): called in a kernel it keeps
    Numba from caching it).

    A prefill runs each of a MoE layer's experts on the few tokens routed to it: a call and a
    parallel region per expert cost more than its products where they are small (k3-mini's;
    `waste.engine.moe_layer.GROUP_ROWS` has the measurements). The callers keep the matrices
    alive during the call: the kernel reads them by address."""
    M = table.shape[0]
    G = like_qs.shape[1]
    # Work item i is row block item_block[i] of matrix item_matrix[i], the first format's items
    # first. Each format's items run in a loop of their own: a branch on the format inside one
    # loop measured 25% slower (16 q4g 256 x 1024 matrices, one token, one thread: 108 against
    # 87 us), the inlined kernels no longer specialised.
    items = 0
    first = 0
    work = 0  # code bytes times rows
    for m in range(M):
        items += table[m, 2]
        block_bytes = G * (like_qs.shape[2] if table[m, 3] == first_format else like_qs_b.shape[2])
        work += table[m, 2] * block_bytes * count[m]
        if table[m, 3] == first_format:
            first += table[m, 2]
    item_matrix = np.empty(items, np.int64)
    item_block = np.empty(items, np.int64)
    # A block's work: its code bytes times its rows plus one (reading the codes whatever the rows).
    done_after = np.empty(items, np.int64)  # the work of items 0..i
    i = 0
    total = 0
    for pass_ in range(2):
        for m in range(M):
            if (table[m, 3] == first_format) == (pass_ == 0):
                block_bytes = like_qs.shape[2] if pass_ == 0 else like_qs_b.shape[2]
                for b in range(table[m, 2]):
                    item_matrix[i] = m
                    item_block[i] = b
                    total += block_bytes * (count[m] + 1)
                    done_after[i] = total
                    i += 1
    parts = 1 if work <= SERIAL_BYTES else max(1, min(threads, items))  # serial below SERIAL_BYTES
    # Part p takes the items whose work ends in (total p / parts, total (p + 1) / parts]: about the
    # same work each, whatever the tokens each expert was routed.
    bounds = np.zeros(parts + 1, np.int64)
    i = 0
    for p in range(1, parts):
        while i < items and done_after[i] * parts <= total * p:
            i += 1
        bounds[p] = i
    bounds[parts] = items
    if work <= SERIAL_BYTES:
        for i in range(first):
            _span_rows(x_start, count, y_start, table, tscales, like_qs, like_scales, Y, xq, xsum, xs, item_matrix[i],
                       item_block[i])
        for i in range(first, items):
            _span_rows(x_start, count, y_start, table, tscales, like_qs_b, like_scales_b, Y, xq, xsum, xs,
                       item_matrix[i], item_block[i])
        return
    # The item loops sit in the prange body itself (one thread too), not in a function it calls or
    # in this function's serial code: compiled as the parallel region's own function they ran 2.5x
    # faster (a decode step's nine down products of `mini` q4 on one thread: 44 against 110 us;
    # why LLVM does better there, we have not pinned down).
    for p in prange(parts):
        lo, hi = bounds[p], bounds[p + 1]
        for i in range(lo, min(hi, first)):
            _span_rows(x_start, count, y_start, table, tscales, like_qs, like_scales, Y, xq, xsum, xs, item_matrix[i],
                       item_block[i])
        for i in range(max(lo, first), hi):
            _span_rows(x_start, count, y_start, table, tscales, like_qs_b, like_scales_b, Y, xq, xsum, xs,
                       item_matrix[i], item_block[i])


@kernel
def _span_rows(x_start, count, y_start, table, tscales, like_qs, like_scales, Y, xq, xsum, xs, m, b):
    """Row block b of matrix m of _q_spans on its rows, its format given by like_qs and like_scales."""
    NB = table[m, 2]
    G = like_qs.shape[1]
    qs = numba.carray(pointer(table[m, 0], like_qs), (NB, G, like_qs.shape[2]))
    scales = numba.carray(pointer(table[m, 1], like_scales), (NB, G, ROWS))
    x0, n, y0 = x_start[m], count[m], y_start[m]
    _rows(qs, scales, xq[x0:x0 + n], xsum[x0:x0 + n], xs[x0:x0 + n], Y[y0:y0 + n], tscales[m], b)
