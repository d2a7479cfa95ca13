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

from dataclasses import dataclass
from functools import cached_property

import ml_dtypes
import numpy as np

from waste.errors import WasteError
from waste.jit import kernel, num_threads, parallel_kernel, prange
from waste.kernels import mxfp4
from waste.kernels.activations import _quantize_token
from waste.kernels.amx_blocks import AMX_MIN_TOKENS
from waste.kernels.bf16 import bf16_matmul, f32_matmul
from waste.kernels.int8_blocks import ISA
from waste.kernels.int8_rows import make_rows, vector_isa
from waste.kernels.quantize import _f16_value, quantize_grouped
from waste.kernels.steal import new_ranges, next_item
from waste.qformat import (
    BLOCK_BYTES,
    CODE_OFFSET,
    FORMATS,
    GROUP,
    ROWS,
    buffer_layout,
    check_mxfp4_shape,
    padded_shape,
)

Q_FORMATS = ("q8g", "q4g", "mxfp4")  # the formats of the integer products
# An mxfp4 product sums twice the E2M1 values: the per-matrix scale halves it.
MXFP4_TSCALE = np.array([0.5], np.float32)


@dataclass(frozen=True)
class QMatrix:
    """A weight matrix [N, K] in one storage format."""

    fmt: str
    shape: tuple[int, int]
    buffers: dict[str, np.ndarray]

    # What the products read, derived from the buffers once, at the first product or `prepare`, not
    # at construction: a writer storing an MXFP4 matrix verbatim never pays for its repack.
    @cached_property
    def _qargs(self) -> tuple:
        """A q product's arguments: (qs, scales, tscale, rows padded to 16, and qs[:0], scales[:0],
        the empty second matrix of a single product). A one-token decode makes hundreds of
        products, so the contiguous buffers and the scales' uint16 view are derived once."""
        if self.fmt in ("q8g", "q4g"):
            qs, scales, tscale = (np.ascontiguousarray(self.buffers[b]) for b in ("qs", "scales", "tscale"))
            scales = scales.view(np.uint16)
        elif self.fmt == "mxfp4" and "qs" in self.buffers:  # given in the interleave (`mxfp4_interleaved`)
            qs, scales, tscale = self.buffers["qs"], self.buffers["scales"], MXFP4_TSCALE
        elif self.fmt == "mxfp4":
            # The stored bytes stay as they are; the kernels read a copy in the 16-row interleave,
            # as large as the stored bytes (waste.kernels.mxfp4).
            nb, g = padded_shape(self.shape)
            qs, scales = np.empty((nb, g, BLOCK_BYTES["mxfp4"]), np.uint8), np.empty((nb, g, ROWS), np.uint8)
            mxfp4.repack_interleaved(self.buffers["packed"], self.buffers["scales"], qs, scales)
            tscale = MXFP4_TSCALE
        else:
            raise WasteError(f"{self.fmt} matrix {self.shape}: not a q format ({', '.join(Q_FORMATS)})")
        return qs, scales, tscale, qs.shape[0] * ROWS, qs[:0], scales[:0]

    @cached_property
    def _qrow(self) -> bytes:
        """This matrix's row of a QBatch table as bytes (where the kernels' buffers live, its row
        blocks, its format): a batch joins its matrices' bytes into arrays in about a microsecond,
        where NumPy takes ten to convert a list of tuples."""
        qs, scales = self._qargs[:2]
        return np.array((qs.ctypes.data, scales.ctypes.data, qs.shape[0], Q_FORMATS.index(self.fmt)),
                        np.int64).tobytes()

    @cached_property
    def _qtscale(self) -> bytes:
        """The tensor scale as float32 bytes, for a QBatch table."""
        return np.float32(self._qargs[2][0]).tobytes()

    @cached_property
    def _drow(self) -> bytes:
        """A float matrix's row of a dense_products table: where the weights live, and their rows."""
        return np.array((self.buffers["w"].ctypes.data, self.shape[0]), np.int64).tobytes()

    def prepare(self) -> QMatrix:
        """Derive what the products read now (MXFP4's repacked copy) instead of at the first
        product, e.g. on a reader thread rather than the model's; returns self."""
        _ = (self._qrow, self._qtscale) if self.fmt in Q_FORMATS else self._drow
        return self

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
            return bf16_to_f32(self.buffers["w"])
        return self.take_rows(np.arange(self.shape[0]))

    def take_rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantised rows W[ids]: ids [L] int -> [L, K] float32 (the embedding lookup)."""
        ids = checked_row_ids(ids, self.shape[0])
        k = self.shape[1]
        if self.fmt == "f32":
            return np.ascontiguousarray(self.buffers["w"][ids])
        if self.fmt == "bf16":
            return bf16_to_f32(self.buffers["w"][ids])
        if self.fmt == "mxfp4" and "qs" in self.buffers:
            return mxfp4.dequantize_mxfp4(*mxfp4.stored_rows(self.buffers["qs"], self.buffers["scales"], ids))
        if self.fmt == "mxfp4":
            return mxfp4.dequantize_mxfp4(self.buffers["packed"][ids], self.buffers["scales"][ids])
        out = np.empty((len(ids), k), np.float32)
        qs, scales, tscale = self._qargs[:3]
        take_q_rows(qs, scales, tscale[0], ids.astype(np.int64), out)
        return out


def checked_row_ids(ids: np.ndarray, n: int) -> np.ndarray:
    """`ids` as an array, refused unless a 1-D integer array of rows in [0, n)."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise WasteError(f"row ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        raise WasteError(f"row id out of range [0, {n}): min {ids.min()}, max {ids.max()}")
    return ids


Q4_BLOCK_BYTES = BLOCK_BYTES["q4g"]
CODE_OFFSET_Q4 = CODE_OFFSET["q4g"]


@kernel(fastmath=False)
def take_q_rows(qs, scales, tscale, ids, out):
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
    qa, sa, ta, padded, _, _ = a._qargs
    qb, sb, tb, _, _, _ = b._qargs
    Ya = np.empty((X.shape[0], padded), np.float32)
    Yb = np.empty_like(Ya)
    _q_product(X, qa, sa, ta, qb, sb, tb, Ya, Yb, num_threads())
    if padded != a.shape[0]:
        return np.ascontiguousarray(Ya[:, :a.shape[0]]), np.ascontiguousarray(Yb[:, :a.shape[0]])
    return Ya, Yb


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


def mxfp4_interleaved_layout(shape: tuple[int, int]) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """Buffers of an MXFP4 matrix held in the kernels' interleave (`mxfp4.repack_blocks`):
    qs [NB, G, 256] and scales [NB, G, 16] uint8, as many bytes as stored when N % 16 == 0."""
    check_mxfp4_shape(shape)
    nb, g = padded_shape(shape)
    return [("qs", np.dtype(np.uint8), (nb, g, BLOCK_BYTES["mxfp4"])), ("scales", np.dtype(np.uint8), (nb, g, ROWS))]


def mxfp4_interleaved(shape: tuple[int, int], buffers: dict[str, np.ndarray]) -> QMatrix:
    """An MXFP4 matrix given in the kernels' interleave (the streaming store repacks what it reads
    into its own buffer, so the matrix is held once): products read it as it is; `take_rows` and
    `dequantize` undo the interleave. Its buffers are not the stored layout, so never written."""
    for name, dtype, bshape in mxfp4_interleaved_layout(shape):
        b = buffers.get(name)
        if b is None or b.dtype != dtype or tuple(b.shape) != bshape:
            raise WasteError(f"interleaved mxfp4 matrix {shape}: buffer {name!r} must be {dtype} {bshape}")
    return QMatrix("mxfp4", shape, buffers)


def quantization_snr_db(w: np.ndarray, fmt: str, x: np.ndarray) -> float:
    """Signal-to-noise ratio (dB) of quantize(w, fmt) times x against the float64 product.

    w [N, K], x [K] or [T, K]; the noise includes the int8 rounding of the activations.
    """
    X = np.atleast_2d(np.asarray(x, np.float64))
    exact = X @ np.asarray(w, np.float64).T
    noise = quantize(w, fmt).matmul(X.astype(np.float32)).astype(np.float64) - exact
    return float(10.0 * np.log10(np.sum(exact**2) / max(np.sum(noise**2), 1e-300)))


# -- float32 and bfloat16 ----------------------------------------------------------------------


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits [..] uint16 -> float32: the upper half of a float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _qproduct(m: QMatrix, X: np.ndarray) -> np.ndarray:
    """Y [T, N] = X W^T for a q-format matrix; X [T, K] float32 contiguous."""
    qs, scales, tscale, padded, no_qs, no_scales = m._qargs
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


# Row block b of Y for all tokens, in the host's tiles (int8_rows.make_rows). Numba's own
# cache would key the kernels that call it (_q_product, _q_products, _q_spans below) on this
# file alone, though they inline the blocks' generated code; waste.jit's cache directory, keyed
# on every source of the package, is what recompiles them when int8_blocks changes.
_rows = make_rows(ISA)
# The same without AMX tiles, for the drivers of one-token products (a decode step's), which
# never reach AMX_MIN_TOKENS: with the tiles' code compiled beside their loops, a `mini` q4
# decode ran 7% slower though it used no tile (226-234 against 243-252 tok/s, alternating
# processes, this Xeon, 2026-12-04). On hosts without AMX the two are the same kernel.
_rows_one = make_rows(vector_isa(ISA)) if ISA != vector_isa(ISA) else _rows


@kernel
def _rows_for(qs, scales, xq, xsum, xs, Y, tscale, b):
    """Row block b of Y: the AMX tiles' rows for chunks that reach them, else _rows_one."""
    if Y.shape[0] >= AMX_MIN_TOKENS:
        _rows(qs, scales, xq, xsum, xs, Y, tscale, b)
    else:
        _rows_one(qs, scales, xq, xsum, xs, Y, tscale, b)


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
                _rows_for(qa, sa, xq, xsum, xs, Ya, ta[0], i)
            else:
                _rows_for(qb, sb, xq, xsum, xs, Yb, tb[0], i - NA)
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
                        _rows_for(qa, sa, xq, xsum, xs, Ya, ta[0], b)
                else:
                    for b in range((i - items_a) * per, min(qb.shape[0], (i - items_a) * per + per)):
                        _rows_for(qb, sb, xq, xsum, xs, Yb, tb[0], b)
                i = next_item(words, t, cursor)

