"""Weight storage formats and the matrix products over them.

A weight matrix `[N, K]` (N output rows, K inputs, PyTorch's Linear layout) is held as a
`QMatrix`: a format name, the logical shape, and named NumPy buffers whose dtypes and
shapes follow from (format, shape) alone, so a container can store the buffers back to
back and hand out zero-copy views on read.

Formats (byte layouts, bits per weight and the measurements behind them: docs/QUANT.md):
- "f32": float32, exact; products through NumPy's BLAS.
- "bf16": bfloat16 bits as uint16; products round the activations to bf16 and follow
  AVX512_BF16's vdpbf16ps (waste/kernels/bf16.py).
- "q8g": int8 codes in [-127, 127], one float16 scale per group of 32 along K (8.5 bits).
- "q4g": 4-bit codes 0..15 standing for (code - 8), one float16 scale per group (4.5 bits).

The formats' constants and buffer layouts are in `waste.qformat` (no Numba, so the container
and the planner read them without compiling kernels); the q8g / q4g quantiser is in
`waste.kernels.quantize`.

The q formats pad K to a multiple of 32 and N to a multiple of 16, and interleave 16 rows so
that one group of one 16-row block is a run of 64-byte chunks, each holding 4 consecutive K
codes for each of the 16 rows: the layout of AVX-512 VNNI's `vpdpbusd` (64 unsigned bytes
times 4 broadcast signed bytes, summed into 16 int32 lanes). A per-matrix power of two
(`tscale`) keeps every float16 group scale in the normal range whatever the weights' size.

`quantize` converts in two streaming Numba passes (the largest |w|, then codes and scales) that
give byte for byte the buffers of the float64 NumPy oracle `reference_quantize`.

Products quantise the activations once per call to int8 per group of 32 with a float32
scale, sum integer products per group in int32 (exact), then scale in float32.

Shapes: x [K], X [T, K], y [N], Y [T, N].
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from waste.errors import WasteError
from waste.jit import kernel, parallel_kernel, prange
from waste.kernels.bf16 import bf16_matmul
from waste.kernels.quantize import quantize_grouped
from waste.qformat import BLOCK_BYTES, CODE_OFFSET, FORMATS, GROUP, ROWS, buffer_layout

TOKEN_TILE = 4  # tokens that share one pass over a weight block in qmatmul
CHUNK = 64  # bytes per vpdpbusd operand: 16 rows x 4 codes
# Software prefetch distance in the code stream (a few groups ahead). Measured on the lm_head
# (codes in DRAM) it helped q4g by 10-40% and was neutral in L3 (docs/QUANT.md).
PREFETCH_BYTES = 2048


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
            # qs[:0], scales[:0]: the empty second matrix of a single product
            object.__setattr__(self, "_qargs", (qs, scales, tscale, qs.shape[0] * ROWS, qs[:0], scales[:0]))

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.buffers.values())

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """y = W x for one token: x [K] float32 -> y [N] float32."""
        x = np.asarray(x)
        if x.shape != (self.shape[1],):
            raise WasteError(f"{self.fmt} matrix {self.shape}: matvec input must have shape ({self.shape[1]},), "
                             f"got {x.shape}")
        if self.fmt == "f32":
            y = np.empty(self.shape[0], np.float32)
            _f32_matvec(self.buffers["w"], np.ascontiguousarray(x, np.float32), y)
            return y
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
            return np.ascontiguousarray(X @ self.buffers["w"].T)
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
        b, r = ids // ROWS, ids % ROWS
        qs = self.buffers["qs"]
        nb, g = qs.shape[0], qs.shape[1]
        if self.fmt == "q8g":
            codes = qs.reshape(nb, g, GROUP // 4, ROWS, 4)[b, :, :, r, :].reshape(len(ids), g, GROUP)
            codes = codes.astype(np.float32)
        else:
            packed = qs.reshape(nb, g, GROUP // 8, ROWS, 4)[b, :, :, r, :].reshape(len(ids), g, GROUP // 2)
            codes = np.concatenate([packed & 15, packed >> 4], axis=-1).astype(np.float32) - CODE_OFFSET["q4g"]
        scale = self.buffers["scales"][b, :, r].astype(np.float32) * self.buffers["tscale"][0]  # [L, G], exact
        return np.ascontiguousarray((codes * scale[:, :, None]).reshape(len(ids), g * GROUP)[:, :k])


def matmul_pair(X: np.ndarray, a: QMatrix, b: QMatrix) -> tuple[np.ndarray, np.ndarray]:
    """(X a^T, X b^T) for X [T, K] float32: a SwiGLU's gate and up products.

    Equal to (a.matmul(X), b.matmul(X)) bit for bit; when both are q matrices of one format and
    shape it is one kernel call that quantises X once and runs both in one parallel region.
    """
    if a.fmt != b.fmt or a.fmt not in ("q8g", "q4g") or a.shape != b.shape:
        return a.matmul(X), b.matmul(X)
    X = np.asarray(X)
    if X.ndim != 2 or X.shape[1] != a.shape[1]:
        raise WasteError(f"{a.fmt} matrix {a.shape}: matmul input must have shape [T, {a.shape[1]}], got {X.shape}")
    X = np.ascontiguousarray(X, np.float32)
    qa, sa, ta, padded, _, _ = a._qargs  # type: ignore[attr-defined]
    qb, sb, tb, _, _, _ = b._qargs  # type: ignore[attr-defined]
    Ya = np.empty((X.shape[0], padded), np.float32)
    Yb = np.empty_like(Ya)
    _q_product(X, qa, sa, ta, qb, sb, tb, Ya, Yb)
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


# One token's product runs here rather than in BLAS: BLAS is held to one thread (waste.jit),
# and these loops on all cores ran 4096 x 2304 in half its time (0.62 against 1.25 ms).
@parallel_kernel
def _f32_matvec(w, x, y):
    """y[N] = W x with W float32 [N, K]."""
    N, K = w.shape
    for n in prange(N):
        s = np.float32(0.0)
        for k in range(K):
            s += w[n, k] * x[k]
        y[n] = s


# -- activations --------------------------------------------------------------------------------


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


def _qproduct(m: QMatrix, X: np.ndarray) -> np.ndarray:
    """Y [T, N] = X W^T for a q-format matrix; X [T, K] float32 contiguous."""
    qs, scales, tscale, padded, no_qs, no_scales = m._qargs  # type: ignore[attr-defined]
    Y = np.empty((X.shape[0], padded), np.float32)
    _q_product(X, qs, scales, tscale, no_qs, no_scales, tscale, Y, Y)
    return Y if padded == m.shape[0] else np.ascontiguousarray(Y[:, :m.shape[0]])


# -- integer dot-product blocks (LLVM IR) --------------------------------------------------------
# Numba's loop vectoriser leaves a per-group int8 dot scalar and multiplies across rows with
# vpmulld/vpmaddwd at about 17 GMAC/s per core (docs/QUANT.md). These intrinsics emit one
# 16-row block's whole group loop as vector IR: vpdpbusd where the host has AVX-512 VNNI,
# otherwise a generic widen-multiply-add that any LLVM target lowers.

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_VB = ir.VectorType(_I8, CHUNK)  # 16 rows x 4 codes
_VI = ir.VectorType(_I32, ROWS)
_VF = ir.VectorType(_F32, ROWS)


def _host_has_vnni() -> bool:
    """True when Numba compiles for this host and the host has AVX-512 VNNI."""
    import llvmlite.binding as llvm
    from numba.core import config

    if config.CPU_NAME or config.CPU_FEATURES:
        return False
    return "+avx512vnni" in llvm.get_host_cpu_features().flatten().split(",")


def _splat(builder: ir.IRBuilder, value: ir.Value, vt: ir.VectorType) -> ir.Value:
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(_I32, vt.count),
                                                                                 [0] * vt.count))


def _dot4(builder: ir.IRBuilder, acc: ir.Value, w: ir.Value, x4: ir.Value, vnni: bool) -> ir.Value:
    """acc[r] += sum_i u8(w[4r + i]) * s8(x4 byte i): acc <16 x i32>, w <64 x i8>, x4 i32."""
    xb = _splat(builder, x4, _VI)
    if vnni:
        fnty = ir.FunctionType(_VI, [_VI, _VI, _VI])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(fn, [acc, builder.bitcast(w, _VI), xb])
    wide = ir.VectorType(_I32, CHUNK)
    p = builder.mul(builder.zext(w, wide), builder.sext(builder.bitcast(xb, _VB), wide))
    for i in range(4):
        lanes = ir.Constant(ir.VectorType(_I32, ROWS), [4 * r + i for r in range(ROWS)])
        acc = builder.add(acc, builder.shuffle_vector(p, ir.Constant(wide, ir.Undefined), lanes))
    return acc


_FORMAT_OF_CODES = {types.int8: "q8g", types.uint8: "q4g"}


def _make_block(tokens: int, vnni: bool):
    """An intrinsic block(qs, scales, xq, xsum, xs, Y, tscale, b, t0) that writes
    Y[t0:t0+tokens, 16b:16b+16] for row block b; arrays as in _q_product, C-contiguous. The
    codes' dtype picks the format at compile time: int8 q8g, uint8 q4g."""

    @intrinsic
    def block(typingctx, qs, scales, xq, xsum, xs, Y, tscale, b, t0):
        fmt = _FORMAT_OF_CODES.get(getattr(qs, "dtype", None))
        if fmt is None:
            return None
        offset = CODE_OFFSET[fmt]
        arrays = (qs, scales, xq, xsum, xs, Y)
        dtypes = (qs.dtype, types.uint16, types.int8, types.int32, types.float32, types.float32)
        if not all(isinstance(a, types.Array) and a.layout == "C" and a.dtype == d
                   for a, d in zip(arrays, dtypes, strict=True)):
            return None
        sig = types.void(*arrays, types.float32, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            qs_, sc_, xq_, xsum_, xs_, y_ = (context.make_array(ty)(context, builder, a)
                                             for ty, a in zip(signature.args[:6], args[:6], strict=True))
            tscale_, b_, t0_ = args[6:]
            intp = b_.type

            def c(v: int) -> ir.Constant:
                return ir.Constant(intp, v)

            def at(arr, index, vt):
                return builder.bitcast(builder.gep(arr.data, [index]), vt.as_pointer())

            G = cgutils.unpack_tuple(builder, qs_.shape)[1]
            Kp = cgutils.unpack_tuple(builder, xq_.shape)[1]
            Np = cgutils.unpack_tuple(builder, y_.shape)[1]
            rows = [builder.add(t0_, c(t)) for t in range(tokens)]
            faccs = [cgutils.alloca_once_value(builder, ir.Constant(_VF, None)) for _ in range(tokens)]
            # llvm.prefetch(address, read, locality 3 = keep in all levels, data cache)
            pf_type = ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
            prefetch = cgutils.get_or_insert_function(builder.module, pf_type, "llvm.prefetch.p0")
            pf_args = [ir.Constant(_I32, v) for v in (0, 3, 1)]
            with cgutils.for_range(builder, G) as loop:
                g = loop.index
                bg = builder.add(builder.mul(b_, G), g)
                wbase = builder.mul(bg, c(BLOCK_BYTES[fmt]))
                xbase = [builder.add(builder.mul(r, Kp), builder.mul(g, c(GROUP))) for r in rows]
                iacc = [ir.Constant(_VI, None) for _ in range(tokens)]
                for ch in range(BLOCK_BYTES[fmt] // CHUNK):
                    # A prefetch never faults (it does not change program behaviour), so running
                    # past the end of qs is harmless.
                    ahead = builder.gep(qs_.data, [builder.add(wbase, c(CHUNK * ch + PREFETCH_BYTES))])
                    builder.call(prefetch, [builder.bitcast(ahead, _I8.as_pointer()), *pf_args])
                    wv = builder.load(at(qs_, builder.add(wbase, c(CHUNK * ch)), _VB), align=1)
                    if fmt == "q8g":
                        # Flipping the sign bit reads int8 code q as the unsigned byte q + 128.
                        parts = [(builder.xor(wv, ir.Constant(_VB, [0x80] * CHUNK)), 4 * ch)]
                    else:
                        parts = [(builder.and_(wv, ir.Constant(_VB, [15] * CHUNK)), 4 * ch),
                                 (builder.lshr(wv, ir.Constant(_VB, [4] * CHUNK)), GROUP // 2 + 4 * ch)]
                    for t in range(tokens):
                        for wpart, k in parts:
                            x4 = builder.load(at(xq_, builder.add(xbase[t], c(k)), _I32), align=1)
                            iacc[t] = _dot4(builder, iacc[t], wpart, x4, vnni)
                half = ir.VectorType(ir.HalfType(), ROWS)
                s16 = builder.load(at(sc_, builder.mul(bg, c(ROWS)), ir.VectorType(_I16, ROWS)), align=2)
                scale = builder.fpext(builder.bitcast(s16, half), _VF)
                for t in range(tokens):
                    tg = builder.add(builder.mul(rows[t], G), g)
                    corr = builder.mul(builder.load(builder.gep(xsum_.data, [tg])), ir.Constant(_I32, offset))
                    dots = builder.sitofp(builder.sub(iacc[t], _splat(builder, corr, _VI)), _VF)
                    xsc = _splat(builder, builder.load(builder.gep(xs_.data, [tg])), _VF)
                    term = builder.fmul(builder.fmul(dots, scale), xsc)
                    builder.store(builder.fadd(builder.load(faccs[t]), term), faccs[t])
            tsv = _splat(builder, tscale_, _VF)
            for t in range(tokens):
                out = at(y_, builder.add(builder.mul(rows[t], Np), builder.mul(b_, c(ROWS))), _VF)
                builder.store(builder.fmul(builder.load(faccs[t]), tsv), out, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return block


_VNNI = _host_has_vnni()
_block_tile = _make_block(TOKEN_TILE, _VNNI)
_block_one = _make_block(1, _VNNI)


# Entering Numba's thread pool costs microseconds, more than quantising a few tokens or
# multiplying a small matrix; below these sizes the work runs on the calling thread. Every
# output element is computed by the same code either way, so the bits do not change.
SERIAL_TOKENS = 4  # tokens quantised serially
SERIAL_BYTES = 32768  # code bytes x tokens of a product run serially


@kernel
def _rows(qs, scales, xq, xsum, xs, Y, ts, b):
    """Row block b of Y for all tokens: tiles of TOKEN_TILE tokens, then one at a time."""
    T = Y.shape[0]
    t = 0
    while t + TOKEN_TILE <= T:
        _block_tile(qs, scales, xq, xsum, xs, Y, ts, b, t)
        t += TOKEN_TILE
    while t < T:
        _block_one(qs, scales, xq, xsum, xs, Y, ts, b, t)
        t += 1


@parallel_kernel
def _q_product(X, qa, sa, ta, qb, sb, tb, Ya, Yb):
    """Ya [T, 16NA] = X A^T and Yb [T, 16NB] = X B^T for q8g (int8 codes q [NB, G, 512]) or q4g
    (uint8 codes q [NB, G, 256]) matrices A, B with the same G (B may have no row blocks);
    scales [NB, G, 16] (float16 bits), tscale [1]. The activations are quantised once, then
    the row blocks of both run in parallel."""
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
        for i in prange(NA + qb.shape[0]):
            if i < NA:
                _rows(qa, sa, xq, xsum, xs, Ya, ta[0], i)
            else:
                _rows(qb, sb, xq, xsum, xs, Yb, tb[0], i - NA)
