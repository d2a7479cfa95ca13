"""Products with bfloat16 weights: the arithmetic of AVX512_BF16's `vdpbf16ps`, on any CPU;
and, through the same tiles, products with float32 weights (`f32_matmul`). Many of either in
one call (a decode step's, a prefill's experts): `waste.kernels.dense_batch`.

A bf16 matrix `[N, K]` (uint16 bits) multiplies activations that are first rounded to
bfloat16 (`round_to_bf16`: round to nearest even, subnormals to zero, as `vcvtneps2bf16`).
Each output is then one fixed sequence of float32 operations, the one `vdpbf16ps` performs on
a 512-bit register: 16 lanes, lane i taking the pairs (2i, 2i+1) of every 32 inputs; each pair
adds its odd product, then its even product, to the lane (a product of two bf16 numbers is
exact in float32, so fused and unfused multiply-adds agree); the rows's last partial 32 are
zero-padded; the 16 lanes are summed as a tree (i + 8, then + 4, + 2, + 1).

Two code paths emit that sequence, chosen at import from the host's features:
- `vdpbf16ps` itself (inline assembly) where the CPU has AVX512_BF16;
- a portable one that widens each bf16 pair with a mask and a shift and multiplies in float32,
  which LLVM lowers to whatever vectors the CPU has (two 256-bit halves on AVX2).
They agree bit for bit on all inputs: `vdpbf16ps` reads bf16 subnormals as zeros and flushes
sums below float32's smallest normal (2**-126) to zero, and the portable path runs its
multiply-adds with MXCSR's flush-to-zero and denormals-are-zero set for that (`_flush_subnormals`).

Activations rounded to bf16 are what llama.cpp's bf16 products also multiply; the relative
error this adds to a product is about 2**-9 / sqrt(3) of |W| |x| per term, averaged over K.

Shapes: w [N, K] uint16 (float32 for `f32_matmul`), X [T, K] float32, Y [T, N] float32.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from waste.cpu import host_features, host_vendor
from waste.jit import kernel, parallel_kernel, prange

DENSE_FORMATS = ("f32", "bf16")  # the QMatrix formats of these products (dense_products)
LANES = 16  # float32 lanes of one 512-bit accumulator
PAIR_BLOCK = 2 * LANES  # bf16 inputs one vdpbf16ps consumes per row
ROW_TILE = 4  # rows sharing one pass over activations (one-token products off AMD: ONE_TOKEN_ROW_TILE)
# Rows of one parallel work item of a one-token product: ROW_TILE tiles in a row. Items of one
# tile (16 KiB of f32 weights at width 1024) cost more to hand out than they stream: on the Zen 5
# EPYC (2026-12-03), 18 `mini` f32 gate/up matrices in one call streamed at 26.8-37.0 GB/s
# (median) in items of 4 rows and 34.3-46.5 in items of 16; bf16 25.1-25.8 against 30.7-34.3.
# A multiple of ROW_TILE, so every row falls in the same tile as before: the same bits.
ONE_TOKEN_ROWS = 4 * ROW_TILE
TOKEN_TILE = 4  # tokens sharing one pass over a row's weights (chunks)
# Weight bytes of one parallel block of rows in a chunk's product: they stay in L2 while the
# chunk's activations stream past them once per block.
CHUNK_BLOCK_BYTES = 131072
CACHE_LINE = 64  # bytes
# Below this many weight bytes x tokens a product runs on the calling thread: entering
# Numba's thread pool costs more than the work.
SERIAL_BYTES = 65536

# Numba's JIT assembles inline asm (vdpbf16ps, below) only once the native asm parser is
# initialised, and it must be whenever a kernel linking these tiles compiles, also when the
# tiles themselves come from Numba's cache (a caller in another module, recompiled, links their
# IR again). Initialising it here, at import, covers every such case.
llvm.initialize_native_asmparser()

_I1, _I16, _I32, _F32 = ir.IntType(1), ir.IntType(16), ir.IntType(32), ir.FloatType()
_VI = ir.VectorType(_I32, LANES)
_VF = ir.VectorType(_F32, LANES)
_VH = ir.VectorType(_I16, PAIR_BLOCK)


def host_has_bf16_dot() -> bool:
    """True when the host has AVX512_BF16 (vdpbf16ps) and Numba compiles for it."""
    return {"avx512f", "avx512bf16"} <= host_features()


def padded_inputs(k: int) -> int:
    """K rounded up to whole blocks of 32 bf16 inputs."""
    return -(-k // PAIR_BLOCK) * PAIR_BLOCK


@kernel(fastmath=False)
def _bf16_bits(b):
    """bfloat16 bits of the float32 with bits b: round to nearest even, subnormals to signed
    zero, NaN kept (quiet) - what vcvtneps2bf16 does."""
    if (b & np.uint32(0x7F800000)) == 0:
        return np.uint32((b >> np.uint32(16)) & np.uint32(0x8000))
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint32((b >> np.uint32(16)) | np.uint32(0x40))
    return np.uint32((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


# fastmath off: the rounding is integer arithmetic on the bits and must not be reassociated.
@kernel(fastmath=False)
def _round_rows(X, out):
    """out[T, Kp] uint16 = X [T, K] float32 rounded to bfloat16, zero past K (vdpbf16ps's operand)."""
    T, K = X.shape
    bits = X.view(np.uint32)
    for t in range(T):
        for k in range(K):
            out[t, k] = np.uint16(_bf16_bits(bits[t, k]))
        for k in range(K, out.shape[1]):
            out[t, k] = 0


@kernel(fastmath=False)
def _round_split(X, out):
    """out[T, Kp] float32: X rounded to bfloat16 as _round_rows, each block of 32 laid out as the
    16 odd elements of its pairs, then the 16 even ones (the portable path's operand)."""
    T, K = X.shape
    bits = X.view(np.uint32)
    obits = out.view(np.uint32)
    full = K // PAIR_BLOCK
    for t in range(T):
        for j in range(full):  # whole blocks: one loop over lanes, which LLVM vectorises
            k = j * PAIR_BLOCK
            for lane in range(LANES):
                obits[t, k + lane] = _bf16_bits(bits[t, k + 2 * lane + 1]) << np.uint32(16)
                obits[t, k + LANES + lane] = _bf16_bits(bits[t, k + 2 * lane]) << np.uint32(16)
        for j in range(full, out.shape[1] // PAIR_BLOCK):
            for i in range(2 * LANES):
                k = j * PAIR_BLOCK + i
                lane = i // 2 if i % 2 else LANES + i // 2
                v = _bf16_bits(bits[t, k]) if k < K else np.uint32(0)
                obits[t, j * PAIR_BLOCK + lane] = v << np.uint32(16)


def round_to_bf16(X: np.ndarray) -> np.ndarray:
    """X [T, K] float32 -> bfloat16 bits [T, Kp] uint16 (Kp = K padded to 32, zeros)."""
    out = np.empty((X.shape[0], padded_inputs(X.shape[1])), np.uint16)
    _round_rows(np.ascontiguousarray(X, np.float32), out)
    return out


def _dpbf16ps(builder: ir.IRBuilder, acc: ir.Value, w: ir.Value, x: ir.Value) -> ir.Value:
    """acc + the pair products of w and x (both <16 x i32> holding bf16 pairs), one vdpbf16ps."""
    # Inline assembly: LLVM's intrinsic for it takes <32 x bfloat>, a type llvmlite's IR builder
    # lacks (the asm parser that assembles it is initialised at import, below).
    asm_type = ir.FunctionType(_VF, [_VF, _VI, _VI])
    asm = ir.InlineAsm(asm_type, "vdpbf16ps $3, $2, $0", "=v,0,v,v")
    return builder.call(asm, [acc, w, x])


def _pair_halves(builder: ir.IRBuilder, words: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(odd, even) float32 <16 x float> of 16 words each holding a bf16 pair (even in the low half)."""
    odd = builder.and_(words, ir.Constant(_VI, [0xFFFF0000] * LANES))
    even = builder.shl(words, ir.Constant(_VI, [16] * LANES))
    return builder.bitcast(odd, _VF), builder.bitcast(even, _VF)


def _lane_sum(builder: ir.IRBuilder, acc: ir.Value) -> ir.Value:
    """The 16 lanes summed as a tree: lane i + lane i + 8, then + 4, + 2, + 1."""
    width = LANES
    while width > 1:
        width //= 2
        lo = builder.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(_I32, width), list(range(width))))
        hi = builder.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(_I32, width), list(range(width, 2 * width))))
        acc = builder.fadd(lo, hi)
    return builder.extract_element(acc, ir.Constant(_I32, 0))


def _lane_sums_16(builder: ir.IRBuilder, accs: list[ir.Value]) -> ir.Value:
    """<16 x float>: element j the lanes of accs[j] summed as `_lane_sum`'s tree (lane i + lane
    i + 8, then + 4, + 2, + 1), for 16 accumulators at once. Each level adds two shuffles of two
    vectors, which hold the partial sums of twice as many accumulators as before: the same
    additions of the same pairs, in 15 adds and 30 shuffles where one tree at a time takes 4
    adds, 8 shuffles and an extract per accumulator (a third of a 4 x 4 tile's work at K 256)."""
    level, half = list(accs), LANES // 2
    while len(level) > 1:
        width = 2 * half  # lanes per accumulator in each vector of this level
        low = [o * width + i for o in range(LANES // width) for i in range(half)]
        high = [o * width + half + i for o in range(LANES // width) for i in range(half)]
        pick = [ir.Constant(ir.VectorType(_I32, LANES), idx + [LANES + i for i in idx]) for idx in (low, high)]
        level = [builder.fadd(builder.shuffle_vector(a, b, pick[0]), builder.shuffle_vector(a, b, pick[1]))
                 for a, b in zip(level[0::2], level[1::2], strict=True)]
        half //= 2
    return level[0]


def make_tile(rows: int, tokens: int, prefetch_rows: int = 0):
    """An intrinsic tile(w, xs, Y, n0, t0) writing Y[t0:t0+tokens, n0:n0+rows]. The dtypes pick
    the code path when it compiles: bf16 weights w [N, K] uint16 with uint16 xs [T, Kp] (bf16
    bits, `round_to_bf16`) run vdpbf16ps, with float32 xs [T, Kp] (`split_pairs` of those bits)
    the portable path; float32 weights w [N, K] with float32 xs [T, K] (the activations as they
    are) run the float32 product (`f32_matmul`). With `prefetch_rows`, the portable path also
    prefetches each block's weights `prefetch_rows` rows further on (PORTABLE_PREFETCH_ROWS)."""

    @intrinsic
    def tile(typingctx, w, xs, Y, n0, t0):
        if not isinstance(w, types.Array) or not isinstance(xs, types.Array):
            return None
        mode = {(types.uint16, types.uint16): "native", (types.uint16, types.float32): "portable",
                (types.float32, types.float32): "f32"}.get((w.dtype, xs.dtype))
        if mode is None:
            return None
        arrays = (w, xs, Y)
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays) \
                or Y.dtype != types.float32:
            return None
        sig = types.void(*arrays, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            w_, xs_, y_ = (context.make_array(ty)(context, builder, a)
                           for ty, a in zip(signature.args[:3], args[:3], strict=True))
            n0_, t0_ = args[3:]
            intp = n0_.type

            def c(v: int) -> ir.Constant:
                return ir.Constant(intp, v)

            def load(arr, index, vt, align):
                return builder.load(builder.bitcast(builder.gep(arr.data, [index]), vt.as_pointer()), align=align)

            K = cgutils.unpack_tuple(builder, w_.shape)[1]
            Kp = cgutils.unpack_tuple(builder, xs_.shape)[1]
            N = cgutils.unpack_tuple(builder, y_.shape)[1]
            wrow = [builder.mul(builder.add(n0_, c(r)), K) for r in range(rows)]
            xrow = [builder.mul(builder.add(t0_, c(t)), Kp) for t in range(tokens)]
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(_VF, None)) for _ in range(tokens)]
                    for _ in range(rows)]

            def step(words: list, xload) -> None:
                """One block of 32 inputs: words[r] is row r's weights (an i32 vector of bf16 pairs,
                or f32's two halves); xload(t) token t's activations in the matching form."""
                halves = [_pair_halves(builder, wv) for wv in words] if mode == "portable" else words
                for t in range(tokens):
                    x = xload(t)
                    for r in range(rows):
                        acc = builder.load(accs[r][t])
                        if mode == "native":
                            acc = _dpbf16ps(builder, acc, words[r], x)
                        else:
                            # bf16 pairs: odd inputs, then even (split_pairs puts odds first);
                            # f32: inputs 0-15, then 16-31
                            acc = _fma(builder, halves[r][0], x[0], acc)
                            acc = _fma(builder, halves[r][1], x[1], acc)
                        builder.store(acc, accs[r][t])

            def xs_at(k: ir.Value, mask: ir.Value | None = None):
                def xload(t: int):
                    xk = builder.add(xrow[t], k)
                    if mode == "native":
                        return load(xs_, xk, _VI, 2)
                    if mask is not None:  # f32's last partial block: its activations are not padded
                        return _masked_halves(builder, xs_.data, xk, mask)
                    return load(xs_, xk, _VF, 4), load(xs_, builder.add(xk, c(LANES)), _VF, 4)
                return xload

            saved = _flush_subnormals(builder) if mode == "portable" else None
            full = builder.udiv(K, c(PAIR_BLOCK))
            prefetch = prefetch_rows and mode == "portable"
            ahead = builder.mul(K, c(prefetch_rows))
            with cgutils.for_range(builder, full) as loop:
                k = builder.mul(loop.index, c(PAIR_BLOCK))
                if prefetch:
                    for r in range(rows):  # one 64-byte line: 32 bf16 weights
                        _prefetch(builder, builder.gep(w_.data, [builder.add(builder.add(wrow[r], k), ahead)]))
                if mode == "f32":
                    words = [(load(w_, builder.add(wrow[r], k), _VF, 4),
                              load(w_, builder.add(builder.add(wrow[r], k), c(LANES)), _VF, 4)) for r in range(rows)]
                else:
                    words = [load(w_, builder.add(wrow[r], k), _VI, 2) for r in range(rows)]
                step(words, xs_at(k))
            # The row's last partial block: a masked load, zeros past K (x is zero there too:
            # padded for bf16, masked for f32).
            k = builder.mul(full, c(PAIR_BLOCK))
            rest = builder.sub(K, k)
            with builder.if_then(builder.icmp_signed(">", rest, c(0))):
                lanes = ir.Constant(ir.VectorType(intp, PAIR_BLOCK), list(range(PAIR_BLOCK)))
                mask = builder.icmp_signed("<", lanes, _splat(builder, rest, PAIR_BLOCK))
                if mode == "f32":
                    words = [_masked_halves(builder, w_.data, builder.add(wrow[r], k), mask) for r in range(rows)]
                    step(words, xs_at(k, mask))
                else:
                    load_type = ir.FunctionType(_VH, [_VH.as_pointer(), _I32, ir.VectorType(_I1, PAIR_BLOCK), _VH])
                    masked_load = cgutils.get_or_insert_function(builder.module, load_type,
                                                                 "llvm.masked.load.v32i16.p0")
                    words = []
                    for r in range(rows):
                        ptr = builder.bitcast(builder.gep(w_.data, [builder.add(wrow[r], k)]), _VH.as_pointer())
                        half = builder.call(masked_load, [ptr, ir.Constant(_I32, 2), mask, ir.Constant(_VH, None)])
                        words.append(builder.bitcast(half, _VI))
                    step(words, xs_at(k))
            if saved is not None:
                _restore_float_mode(builder, saved, [acc for row in accs for acc in row])
            def out_at(r: int, t: int) -> ir.Value:
                return builder.gep(y_.data, [builder.add(builder.mul(builder.add(t0_, c(t)), N),
                                                         builder.add(n0_, c(r)))])

            if rows * tokens == LANES:  # the chunk tile: 16 trees at once, each token's rows stored together
                sums = _lane_sums_16(builder, [builder.load(accs[r][t]) for t in range(tokens) for r in range(rows)])
                for t in range(tokens):
                    part = builder.shuffle_vector(sums, sums, ir.Constant(ir.VectorType(_I32, rows),
                                                                          [t * rows + r for r in range(rows)]))
                    builder.store(part, builder.bitcast(out_at(0, t), ir.VectorType(_F32, rows).as_pointer()), align=4)
            else:
                for r in range(rows):
                    for t in range(tokens):
                        builder.store(_lane_sum(builder, builder.load(accs[r][t])), out_at(r, t))
            return context.get_dummy_value()

        return sig, codegen

    return tile


def _masked_halves(builder: ir.IRBuilder, data: ir.Value, index: ir.Value, mask: ir.Value) -> tuple[ir.Value, ir.Value]:
    """float32 data[index : index + 32] as two 16-lane vectors, lanes where `mask` [32] is false
    read as zero (never touched)."""
    load_type = ir.FunctionType(_VF, [_VF.as_pointer(), _I32, ir.VectorType(_I1, LANES), _VF])
    masked_load = cgutils.get_or_insert_function(builder.module, load_type, "llvm.masked.load.v16f32.p0")
    out = []
    for half in range(2):
        part = builder.shuffle_vector(mask, mask, ir.Constant(ir.VectorType(_I32, LANES),
                                                                list(range(half * LANES, (half + 1) * LANES))))
        ptr = builder.bitcast(builder.gep(data, [builder.add(index, ir.Constant(index.type, half * LANES))]),
                              _VF.as_pointer())
        out.append(builder.call(masked_load, [ptr, ir.Constant(_I32, 4), part, ir.Constant(_VF, None)]))
    return out[0], out[1]


# MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6): vdpbf16ps's own rules, which it
# follows whatever MXCSR says. With both set, each float32 FMA of the portable path gave the bits
# of vdpbf16ps on all of 6.4 million outputs of a C probe built to underflow (tiny normals whose
# products and sums fall below 2^-126, bf16 subnormal operands; 2026-12-04, Xeon), and without
# them differed on 0.4% (tiny) and 6% (subnormal operands). Only the multiply-adds run so: the
# lanes' tree adds vdpbf16ps's outputs under the caller's MXCSR on both paths.
_FLUSH_BITS = 0x8040


def _mxcsr(builder: ir.IRBuilder, name: str, slot: ir.Value) -> None:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()]),
                                        f"llvm.x86.sse.{name}")
    builder.call(fn, [builder.bitcast(slot, ir.IntType(8).as_pointer())])


def _flush_subnormals(builder: ir.IRBuilder) -> ir.Value:
    """Set MXCSR's flush-to-zero and denormals-are-zero; returns the slot holding the MXCSR to
    restore (`_restore_float_mode`). The multiply-adds after it read loads made after it, which
    LLVM does not move above a call that writes memory, and the x86 backend orders them after
    ldmxcsr (its instructions use MXCSR)."""
    saved = cgutils.alloca_once(builder, _I32)
    _mxcsr(builder, "stmxcsr", saved)
    flushing = cgutils.alloca_once(builder, _I32)
    builder.store(builder.or_(builder.load(saved), ir.Constant(_I32, _FLUSH_BITS)), flushing)
    _mxcsr(builder, "ldmxcsr", flushing)
    return saved


def _restore_float_mode(builder: ir.IRBuilder, saved: ir.Value, accs: list[ir.Value]) -> None:
    """Restore the MXCSR `_flush_subnormals` saved, once every accumulator in accs (allocas of
    <16 x float>) is final: each passes through an empty asm statement first, which LLVM keeps
    before the restoring call (both have side effects), so no multiply-add can sink below it."""
    pin = ir.InlineAsm(ir.FunctionType(_VF, [_VF]), "", "=v,0", side_effect=True)
    for acc in accs:
        builder.store(builder.call(pin, [builder.load(acc)]), acc)
    _mxcsr(builder, "ldmxcsr", saved)


@intrinsic
def _prefetch_to_l2(typingctx, arr, byte_offset):
    """Prefetch (to L2: prefetcht1) the line `byte_offset` bytes into arr's data."""
    if not isinstance(arr, types.Array) or not isinstance(byte_offset, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        _prefetch(builder, builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [args[1]]), locality=2)
        return context.get_dummy_value()

    return types.void(arr, byte_offset), codegen


def _prefetch(builder: ir.IRBuilder, address: ir.Value, locality: int = 3) -> None:
    """llvm.prefetch of the line at `address` (read, data; locality 3 keeps it in all levels, 2
    in L2 and below). A prefetch never faults, so one past the end of an array is harmless."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                        "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(address, i8p), *(ir.Constant(_I32, v) for v in (0, locality, 1))])


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, acc: ir.Value) -> ir.Value:
    """acc + a * b. The product of two bf16 values is exact in float32, so a fused and an
    unfused multiply-add give the same bits; the fused one is a single instruction. float32
    products differ fused and unfused: a host uses one of them for every tile alike."""
    if not _HOST_FMA:
        return builder.fadd(acc, builder.fmul(a, b))
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF, _VF, _VF]), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, acc])


def _splat(builder: ir.IRBuilder, value: ir.Value, count: int) -> ir.Value:
    vt = ir.VectorType(value.type, count)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(_I32, 0))
    zeros = ir.Constant(ir.VectorType(_I32, count), [0] * count)
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), zeros)


NATIVE = host_has_bf16_dot()
# Chunks (more than one token) on Intel cores take the portable path even where vdpbf16ps is
# there: on the Xeon with AMX (2026-12-04) vdpbf16ps issues once per two cycles, 16 multiply-adds
# a cycle, where two float32 FMAs a cycle make 32; its bf16 products then ran no faster than
# float32 ones. The portable path's two FMAs per pair, each pair's bf16 words unpacked once per
# 4 tokens, made a 256-token mini prefill's expert products 1.2x (gate and up, K 1024) to 1.5x
# (down, K 256) as fast. Decode streams weights and keeps vdpbf16ps, its instruction count per
# byte being float32's. AMD's Zen cores run vdpbf16ps at the FMA rate or better: they keep it.
CHUNK_NATIVE = NATIVE and host_vendor() != "GenuineIntel"
_HOST_FMA = "fma" in host_features()
# Rows sharing a chunk's pass over TOKEN_TILE tokens: ROW_TILE x TOKEN_TILE accumulators of 16
# float32 lanes fit AVX-512's 32 registers (on AVX2 each takes two of 16: one row). On this Xeon
# (vdpbf16ps, 4096 x 2304, 256 tokens, 2 threads) 21.3 against 23.9 ms with one row; every
# output is the same sequence of operations either way.
CHUNK_ROW_TILE = ROW_TILE if "avx512f" in host_features() else 1
# The portable bf16 path spends about three times the instructions per weight byte that the
# float32 product does, and the hardware prefetchers alone then leave its one-token products
# short of the memory speed: prefetching 16 rows ahead made `mini` bf16 decode steps 14-16%
# shorter on an AVX2-only EPYC (Zen 3; alternating steps in one process, 4 to 32 rows measured,
# identical logits). The same prefetch made no difference to float32's (+1-3%), so it is not
# emitted there, nor for vdpbf16ps, whose instruction count per byte is float32's.
PORTABLE_PREFETCH_ROWS = 16
# Rows of one pass over a token's activations in a one-token product, on AMD one: on the Zen 4
# EPYC (2026-12-05; from memory, 2 threads; 256 to 32000 rows of 256 or 1024 inputs) one row at a
# time, a single stream through the rows, ran 1.3-2x as fast as four rows side by side in f32
# (32-46 against 18-33 GB/s), vdpbf16ps (31-58 against 20-28) and the portable bf16 path (29-48
# against 18-27, with or without its prefetch, which then only slowed it). AMD's other cores (Zen
# 3, Zen 5) take it unmeasured; Intel keeps four, as chosen before (not measured against one).
# Each output's operations are the same either way, so the bits are too.
ONE_TOKEN_ROW_TILE = 1 if host_vendor() == "AuthenticAMD" else ROW_TILE
_tokens_tile = make_tile(1, TOKEN_TILE)
_block_tile = make_tile(CHUNK_ROW_TILE, TOKEN_TILE)
# The 1-3 tokens a chunk leaves after its tiles of TOKEN_TILE, CHUNK_ROW_TILE rows at a time: one
# row and one token per pass (_one) waits on a single chain of multiply-adds, and an expert's
# tokens in a prefill nearly always leave some: mini's bf16 expert products per layer (64 experts,
# 22-44 tokens each) 13.5 -> 11.2-11.6 ms (gate and up), 5.0-6.4 -> 4.7-5.3 (down).
_rest_1, _rest_2, _rest_3 = (make_tile(CHUNK_ROW_TILE, tokens) for tokens in (1, 2, 3))
_one = make_tile(1, 1)
_rows_tile = _one if ONE_TOKEN_ROW_TILE == 1 else make_tile(ROW_TILE, 1, PORTABLE_PREFETCH_ROWS)


@kernel
def _row_block(w, xs, Y, n0, n1, ahead, ahead_n0, ahead_n1):
    """Rows n0 .. n1 - 1 of Y for every token: tiles of 4 tokens by CHUNK_ROW_TILE rows, the
    token tiles outside so that the block's rows stay in cache while the activations pass once,
    then the 1-3 tokens left in one tile per CHUNK_ROW_TILE rows. A chunk's block meanwhile
    prefetches rows ahead_n0 .. ahead_n1 - 1 of matrix `ahead` (the block this thread takes
    next) into L2, a few lines after each tile: from memory, the first of a block's passes
    waited on its weights, and it stalled the bf16 tiles most (mini's routed experts, 64 per
    layer, 2 threads: 70-84 -> 94-100 GMAC/s; float32's, bound by L2, did not change)."""
    T = Y.shape[0]
    if T == 1:
        n = n0
        while n + ONE_TOKEN_ROW_TILE <= n1:
            _rows_tile(w, xs, Y, n, 0)
            n += ONE_TOKEN_ROW_TILE
        for m in range(n, n1):
            _one(w, xs, Y, m, 0)
        return
    row_bytes = ahead.shape[1] * ahead.itemsize
    line, lines_end = ahead_n0 * row_bytes, ahead_n1 * row_bytes
    tiles = max(1, (T // TOKEN_TILE) * ((n1 - n0) // CHUNK_ROW_TILE))
    lines_per_tile = ((lines_end - line) // CACHE_LINE + tiles - 1) // tiles
    t = 0
    while t + TOKEN_TILE <= T:
        n = n0
        while n + CHUNK_ROW_TILE <= n1:
            _block_tile(w, xs, Y, n, t)
            n += CHUNK_ROW_TILE
            for _ in range(lines_per_tile):
                if line < lines_end:
                    _prefetch_to_l2(ahead, line)
                    line += CACHE_LINE
        for m in range(n, n1):
            _tokens_tile(w, xs, Y, m, t)
        t += TOKEN_TILE
    if t == T:
        return
    n = n0
    while n + CHUNK_ROW_TILE <= n1:
        if T - t == 1:
            _rest_1(w, xs, Y, n, t)
        elif T - t == 2:
            _rest_2(w, xs, Y, n, t)
        else:
            _rest_3(w, xs, Y, n, t)
        n += CHUNK_ROW_TILE
    for u in range(t, T):
        for m in range(n, n1):
            _one(w, xs, Y, m, u)


@parallel_kernel
def _run_blocks(w, xs, Y):
    """The row blocks of Y [T, N] in parallel (serially when the product is small)."""
    N = w.shape[0]
    row_bytes = w.shape[1] * w.itemsize
    rows = ONE_TOKEN_ROWS if Y.shape[0] == 1 else max(1, CHUNK_BLOCK_BYTES // row_bytes // ROW_TILE) * ROW_TILE
    blocks = (N + rows - 1) // rows
    if w.size * w.itemsize * Y.shape[0] <= SERIAL_BYTES:
        for i in range(blocks):
            _row_block(w, xs, Y, i * rows, min(N, i * rows + rows), w, 0, 0)
    else:
        for i in prange(blocks):
            # Numba's prange hands each thread a run of consecutive blocks: block i + 1 is next.
            n1 = min(N, i * rows + rows)
            _row_block(w, xs, Y, i * rows, n1, w, n1, min(N, n1 + rows))


# How `_operand_into` writes activations in the form a dense format's tiles read
# (`operand_mode`): as they are (f32), rounded to bf16 bits (vdpbf16ps), or rounded and in the
# portable path's pair layout.
AS_IS, BF16_BITS, BF16_SPLIT = 0, 1, 2


def operand_mode(fmt: str) -> int:
    """The form of `fmt`'s ("f32" or "bf16") operand on this host, for `_operand_into`."""
    return AS_IS if fmt == "f32" else BF16_BITS if NATIVE else BF16_SPLIT


def operand_buffer(fmt: str, T: int, K: int) -> np.ndarray:
    """An empty operand for T rows of K activations, as `fmt`'s tiles read it on this host."""
    if fmt == "f32":
        return np.empty((T, K), np.float32)
    return np.empty((T, padded_inputs(K)), np.uint16 if NATIVE else np.float32)


@kernel(fastmath=False)
def _operand_into(X, out, mode):
    """out = X [T, K] float32 in the form `mode` names (operand_mode), inside a compiled caller:
    the bits dense_products' own conversion gives."""
    if mode == AS_IS:
        out[:, :] = X
    elif mode == BF16_BITS:
        _round_rows(X, out)
    else:
        _round_split(X, out)


def dense_operand(X: np.ndarray, fmt: str) -> np.ndarray:
    """X [T, K] (C-contiguous float32) as `fmt`'s tiles read it: X itself for f32."""
    return X if fmt == "f32" else bf16_operand(X)


def bf16_operand(X: np.ndarray, *, native: bool = NATIVE) -> np.ndarray:
    """X [T, K] float32 (C-contiguous) as the bf16 tiles read it: rounded to bf16 bits [T, Kp]
    uint16 for vdpbf16ps (`native`), else float32 in the portable path's pair layout."""
    xs = np.empty((X.shape[0], padded_inputs(X.shape[1])), np.uint16 if native else np.float32)
    if X.shape[0] >= PARALLEL_ROUNDING_ROWS:
        (_round_rows_parallel if native else _round_split_parallel)(X, xs)
    else:
        (_round_rows if native else _round_split)(X, xs)
    return xs


# Rows from which a chunk's activations are rounded on all cores: a 256-token mini bf16 prefill
# rounded 126 operands (256 x 1024 trunk inputs, 2048 x 256 expert activations) in 17 ms on one.
PARALLEL_ROUNDING_ROWS = 16


@parallel_kernel(fastmath=False)
def _round_rows_parallel(X, out):
    """_round_rows, rows on all cores (the same bits: each element rounds on its own)."""
    for t in prange(X.shape[0]):
        _round_rows(X[t:t + 1], out[t:t + 1])


@parallel_kernel(fastmath=False)
def _round_split_parallel(X, out):
    """_round_split, rows on all cores (the same bits: each element rounds on its own)."""
    for t in prange(X.shape[0]):
        _round_split(X[t:t + 1], out[t:t + 1])


def bf16_matmul(w: np.ndarray, X: np.ndarray, *, native: bool | None = None) -> np.ndarray:
    """Y [T, N] float32 = X W^T for bf16 bits w [N, K] and X [T, K] float32 (C-contiguous).

    By default one token takes vdpbf16ps where the host has it (NATIVE), chunks as
    CHUNK_NATIVE says; `native=True` or `False` picks the path (the tests compare the two).
    """
    if native is None:
        native = NATIVE if X.shape[0] == 1 else CHUNK_NATIVE
    Y = np.empty((X.shape[0], w.shape[0]), np.float32)
    _run_blocks(w, bf16_operand(X, native=native), Y)
    return Y


def f32_matmul(w: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Y [T, N] float32 = X W^T for float32 w [N, K] and X [T, K] (C-contiguous), through the
    same tiles as the bf16 products: per output, 16 lanes each adding input k's product, then
    input k + 16's, over every block of 32 inputs (fused multiply-adds where the host has them),
    then summed as a tree. Every output is that sequence whatever the number of tokens, so a
    chunk equals its tokens one by one bit for bit (prefill is chunk-invariant and equals
    decode), which BLAS, picking its kernels by the row count, is not (issue 13)."""
    Y = np.empty((X.shape[0], w.shape[0]), np.float32)
    _run_blocks(w, X, Y)
    return Y
