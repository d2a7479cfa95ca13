"""The integer dot-product blocks under the q-format products of `waste.kernels.quant`.

Numba's loop vectoriser leaves a per-group int8 dot scalar and multiplies across rows with
vpmulld/vpmaddwd at about 17 GMAC/s per core (docs/QUANT.md). These intrinsics emit one
16-row block's whole group loop as LLVM vector IR, in one of the lowerings (ISAS) chosen
for the host at import (`waste.cpu.int8_isa`):
- "amx": "vbmi", and for chunks of AMX_MIN_TOKENS tokens or more AMX-INT8 tiles, 16 tokens at
  a time (`waste.kernels.amx_blocks`; `waste.kernels.int8_rows` puts the two together);
- "vbmi": "vnni" with AVX512_VBMI's vpermb for mxfp4's nibble lookup: vpermb reads only an
  index byte's low 6 bits, so a 64-entry table repeating the 16 codes looks up the low nibble
  without masking it off and the high nibble after a 16-bit shift (vpsrlw) without masking the
  bits the shift brings in: 3 operations per 64 code bytes, as q4g's masks and shift, where
  vpshufb needs 5;
- "vnni": vpdpbusd where the host has AVX-512 VNNI (and vpshufb on 512 bits);
- "avx2": vpmaddubsw + vpmaddwd (and vpshufb on 256 bits). vpmaddubsw multiplies unsigned by
  signed bytes and sums pairs in int16 with saturation: exact for the small unsigned codes of
  q4g and mxfp4 (SMALL_CODES), whose pair sums are small enough that several results add in
  int16 (vpaddw) before one vpmaddwd widens them (PAIR_SUMS_PER_INT16 states the bound).
  q8g's signed codes go in as |w| with w's sign moved onto the
  activation (vpsignb); activation codes lie in [-127, 127], so a pair sums to at most
  2 x 128 x 127 = 32512 < 32767 in magnitude (|w| = 128 for a code -128 still fits), exact too;
- "generic": widen, multiply, add lanes in fours (and a compare-select table lookup), which
  every LLVM target lowers.
All give the same integers, hence the same bits (tests/kernels/test_quant.py).

Layout: 16 rows are interleaved so that one group of one row block is a run of 64-byte
chunks, each holding 4 consecutive K codes of each of the 16 rows (the operand of vpdpbusd:
64 unsigned bytes times 4 broadcast signed bytes, summed into 16 int32 lanes).
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from waste.cpu import INT8_ISAS, int8_isa
from waste.kernels import mxfp4
from waste.qformat import BLOCK_BYTES, CODE_OFFSET, GROUP, ROWS

CHUNK = 64  # bytes per vpdpbusd operand: 16 rows x 4 codes
# Software prefetch distance in the code stream (a few groups ahead). Measured on the lm_head
# (codes in DRAM) it helped q4g by 10-40% and was neutral in L3 (docs/QUANT.md). 4 KiB rather
# than 2: a decode step's products in DRAM (random experts of 512, 2 threads, EPYC) 3-6% faster
# median for q4g gate/up and down, 1-3% for q8g; 8 KiB the same as 4; 32-token tiles unchanged.
PREFETCH_BYTES = 4096


_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_VB = ir.VectorType(_I8, CHUNK)  # 16 rows x 4 codes
_VI = ir.VectorType(_I32, ROWS)
_V16 = ir.VectorType(_I16, 16)  # one vpmaddubsw result: 8 rows x 2 pair sums
_VF = ir.VectorType(_F32, ROWS)


# Numba's fast-math pass flags every float instruction that has no flags, and with 'reassoc'
# LLVM may reorder the sum over groups differently for each lowering (unrolled into partial
# sums when the loop body is small). 'arcp' only concerns division: the scaling below keeps
# IEEE order, so every lowering gives the same float bits from the same integers.
_IEEE = ("arcp",)
# A group adds its dot times (weight scale x activation scale) to the sum in one fused
# multiply-add (llvm.fma: exact fused semantics on every target, so every lowering still gives
# the same bits). Against two multiplies and an add it took 32-token products 6-14% less time
# (bench/quant.py --k3-only, K3's expert shapes, 1 and 2 threads, Zen 5) and rounds twice
# instead of three times; for mxfp4 the scale product is exact (a power of two), so each
# group's term is rounded once, in the add.
_FMA = "llvm.fma.v16f32"
_CURRENT_ROUNDING = 4  # the rounding argument of AVX-512 intrinsics: MXCSR's mode (round to nearest)

ISAS = INT8_ISAS
AVX512_ISAS = ("amx", "vbmi", "vnni")  # the lowerings of hosts with AVX-512
# The unsigned code of each mxfp4 nibble: twice its E2M1 value plus the offset.
_MXFP4_LUT = [int(v) + CODE_OFFSET["mxfp4"] for v in mxfp4.E2M1_TWICE]
# Formats whose unsigned codes are small enough for vpmaddubsw, and their largest code.
CODE_MAX = {"q4g": 15, "mxfp4": max(_MXFP4_LUT)}
SMALL_CODES = tuple(CODE_MAX)
ACT_MAX = 127  # activation codes lie in [-127, 127] (activations._quantize_token clamps them)
INT16_MAX = 32767
# vpmaddubsw sums two products of a code and an activation into one int16 lane, at most
# 2 x CODE_MAX x 127 in magnitude (q4g 3810, mxfp4 6096), so it never saturates; vpaddw can
# add this many such results before a lane could pass 32767 (q4g 8, mxfp4 5), after which
# one vpmaddwd widens them to int32. Exact: the same integers as one vpmaddwd per result.
PAIR_SUMS_PER_INT16 = {fmt: INT16_MAX // (2 * top * ACT_MAX) for fmt, top in CODE_MAX.items()}


def _x86(builder: ir.IRBuilder, name: str, ret: ir.Type, *args: ir.Value) -> ir.Value:
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), list(args))


def _halves(builder: ir.IRBuilder, v: ir.Value) -> list[ir.Value]:
    """The two halves of a vector (a 64-byte chunk's two 32-byte halves: two AVX2 registers)."""
    n = v.type.count // 2
    return [builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                   ir.Constant(ir.VectorType(_I32, n), list(range(h, h + n)))) for h in (0, n)]


def _join(builder: ir.IRBuilder, lo: ir.Value, hi: ir.Value) -> ir.Value:
    n = lo.type.count
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n))))


def _lookup(builder: ir.IRBuilder, nibbles: ir.Value, table: list[int], isa: str) -> ir.Value:
    """table[n] for each byte n < 16 of a <64 x i8>: vpshufb, or compare-selects (generic)."""
    if isa == "vnni":
        return _x86(builder, "llvm.x86.avx512.pshuf.b.512", _VB, ir.Constant(_VB, table * 4), nibbles)
    if isa == "avx2":
        half = ir.VectorType(_I8, 32)
        lut = ir.Constant(half, table * 2)
        looked = [_x86(builder, "llvm.x86.avx2.pshuf.b", half, lut, h) for h in _halves(builder, nibbles)]
        return _join(builder, *looked)
    out = ir.Constant(_VB, [table[0]] * CHUNK)
    for n in range(1, 16):
        hit = builder.icmp_unsigned("==", nibbles, ir.Constant(_VB, [n] * CHUNK))
        out = builder.select(hit, ir.Constant(_VB, [table[n]] * CHUNK), out)
    return out


def _mxfp4_codes_vbmi(builder: ir.IRBuilder, w: ir.Value) -> list[ir.Value]:
    """The unsigned codes of the low and of the high nibbles of a <64 x i8> of packed mxfp4 (see
    the module doc): vpermb of each byte, and of each byte after a 16-bit right shift by 4."""
    table = ir.Constant(_VB, _MXFP4_LUT * 4)
    words = ir.VectorType(_I16, CHUNK // 2)
    shifted = builder.bitcast(builder.lshr(builder.bitcast(w, words), ir.Constant(words, [4] * (CHUNK // 2))), _VB)
    return [_x86(builder, "llvm.x86.avx512.permvar.qi.512", _VB, table, idx) for idx in (w, shifted)]


def _splat(builder: ir.IRBuilder, value: ir.Value, vt: ir.VectorType) -> ir.Value:
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(_I32, vt.count),
                                                                                 [0] * vt.count))


def _dot4(builder: ir.IRBuilder, acc: ir.Value, w: ir.Value, x4: ir.Value, isa: str) -> ir.Value:
    """acc[r] += sum_i u8(w[4r + i]) * s8(x4 byte i): acc <16 x i32>, w <64 x i8>, x4 i32
    (isa "vnni" or "generic"; "avx2" goes through _pairs_avx2 and _widen_pairs)."""
    xb = _splat(builder, x4, _VI)
    if isa == "vnni":
        return _x86(builder, "llvm.x86.avx512.vpdpbusd.512", _VI, acc, builder.bitcast(w, _VI), xb)
    wide = ir.VectorType(_I32, CHUNK)
    p = builder.mul(builder.zext(w, wide), builder.sext(builder.bitcast(xb, _VB), wide))
    for i in range(4):
        lanes = ir.Constant(ir.VectorType(_I32, ROWS), [4 * r + i for r in range(ROWS)])
        acc = builder.add(acc, builder.shuffle_vector(p, ir.Constant(wide, ir.Undefined), lanes))
    return acc


def _pairs_avx2(builder: ir.IRBuilder, w: ir.Value, x4: ir.Value) -> list[ir.Value]:
    """vpmaddubsw of each 32-byte half of w <64 x i8> (unsigned codes) with the 4 signed bytes of
    x4 i32 repeated: two <16 x i16>, lane 2r + j of half h holding row 8h + r's products of
    bytes 2j and 2j + 1 of x4, summed (exact for SMALL_CODES, see PAIR_SUMS_PER_INT16)."""
    x32 = _halves(builder, builder.bitcast(_splat(builder, x4, _VI), _VB))[0]
    return [_x86(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16, h, x32) for h in _halves(builder, w)]


def _widen_pairs(builder: ir.IRBuilder, acc: ir.Value, pairs: list[ir.Value]) -> ir.Value:
    """acc <16 x i32> plus, per row, the sum of its two int16 lanes in each half of pairs
    (vpmaddwd by ones): rows 0-7 from the first half, 8-15 from the second."""
    ones = ir.Constant(_V16, [1] * 16)
    sums = [_x86(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8), p, ones) for p in pairs]
    return builder.add(acc, _join(builder, *sums))


def _dot4_signed_avx2(builder: ir.IRBuilder, acc: ir.Value, w_abs: list[ir.Value], w: list[ir.Value],
                      x4: ir.Value) -> ir.Value:
    """acc[r] += sum_i s8(w[4r + i]) * s8(x4 byte i), given the two 32-byte halves of w and of
    |w| (computed once per chunk, shared by the tokens): vpsignb puts w's sign on the
    activation, vpmaddubsw multiplies by |w| (at most 128, so a pair sum fits an int16 for
    activations in [-127, 127]), vpmaddwd adds the pairs into int32."""
    half = ir.VectorType(_I8, 32)
    x32 = _halves(builder, builder.bitcast(_splat(builder, x4, _VI), _VB))[0]
    ones = ir.Constant(ir.VectorType(_I16, 16), [1] * 16)
    sums = []
    for wa, ws in zip(w_abs, w, strict=True):
        signed_x = _x86(builder, "llvm.x86.avx2.psign.b", half, x32, ws)
        pairs = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(_I16, 16), wa, signed_x)
        sums.append(_x86(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8), pairs, ones))
    return builder.add(acc, _join(builder, *sums))


def _abs_halves(builder: ir.IRBuilder, w: ir.Value) -> list[ir.Value]:
    """|w| of each 32-byte half of a <64 x i8> (vpabsb; -128 gives 0x80, read unsigned as 128)."""
    half = ir.VectorType(_I8, 32)
    return [_x86(builder, "llvm.abs.v32i8", half, h, ir.Constant(ir.IntType(1), 0)) for h in _halves(builder, w)]


def dot_lowering(isa: str, fmt: str) -> str:
    """How a block of format `fmt` computes its integer dots on a host of lowering `isa`."""
    if isa in ("amx", "vbmi"):
        return "vnni"
    if isa != "avx2":
        return isa
    return "avx2" if fmt in SMALL_CODES else "avx2_signed"


# (codes, scales) dtypes -> format: float16 scales as uint16 bits, mxfp4's E8M0 bytes as uint8
_FORMAT_OF_DTYPES = {(types.int8, types.uint16): "q8g", (types.uint8, types.uint16): "q4g",
                     (types.uint8, types.uint8): "mxfp4"}


def _e8m0_to_f32(builder: ir.IRBuilder, s8: ir.Value, isa: str) -> ir.Value:
    """E8M0 bytes <16 x i8> -> 2^(s - 127) <16 x float>: the byte is the float32 exponent field,
    except 0 (2^-127, a subnormal) and 255 (NaN). Two operations per 8 rows fix those: byte 0
    is the only one that places below 2^-127's bits (an unsigned max), and byte 255 the only
    one whose bits plus 2^23 carry into the sign (a select on the sign: vblendvps; LLVM would
    turn a plain select back into a byte compare and sign extensions)."""
    bits = builder.shl(builder.zext(s8, _VI), ir.Constant(_VI, [23] * ROWS))
    bits = _x86(builder, "llvm.umax.v16i32", _VI, bits, ir.Constant(_VI, [1 << 22] * ROWS))
    carried = builder.add(bits, ir.Constant(_VI, [1 << 23] * ROWS))
    nan = ir.Constant(_VI, [0x7FC00000] * ROWS)
    if isa == "avx2":
        f8 = ir.VectorType(_F32, 8)
        picked = [_x86(builder, "llvm.x86.avx.blendv.ps.256", f8, *(builder.bitcast(v, f8) for v in args))
                  for args in zip(*(_halves(builder, v) for v in (bits, nan, carried)), strict=True)]
        return _join(builder, *picked)
    is_nan = builder.icmp_signed("<", carried, ir.Constant(_VI, None))
    return builder.bitcast(builder.select(is_nan, nan, bits), _VF)


def _e8m0_exponents(builder: ir.IRBuilder, s8: ir.Value) -> ir.Value:
    """E8M0 bytes <16 x i8> -> s - 127 as <16 x float>, NaN for 255, for vscalefps (AVX-512):
    the byte in a float's exponent field with the mantissa's top bit set is 1.5 x 2^(s - 127),
    2^-127 (a subnormal) for byte 0 and a quiet NaN for 255, and vgetexpps reads its exponent,
    normalising the subnormal. vscalefps then rounds xs x 2^(s - 127) once, as the product
    with `_e8m0_to_f32`'s scale does: the same bits in 4 operations per group of 16 rows and 1
    per token, where the decode took 6 and the product 1."""
    bits = builder.or_(builder.shl(builder.zext(s8, _VI), ir.Constant(_VI, [23] * ROWS)),
                       ir.Constant(_VI, [1 << 22] * ROWS))
    return _x86(builder, "llvm.x86.avx512.mask.getexp.ps.512", _VF, builder.bitcast(bits, _VF),
                ir.Constant(_VF, None), ir.Constant(_I16, -1), ir.Constant(_I32, _CURRENT_ROUNDING))


def _scale_by_exponents(builder: ir.IRBuilder, x: ir.Value, exponents: ir.Value) -> ir.Value:
    """x x 2^exponents <16 x float>, rounded once (vscalefps)."""
    return _x86(builder, "llvm.x86.avx512.mask.scalef.ps.512", _VF, x, exponents, ir.Constant(_VF, None),
                ir.Constant(_I16, -1), ir.Constant(_I32, _CURRENT_ROUNDING))


def _format_of(qs: types.Type, scales: types.Type) -> str | None:
    return _FORMAT_OF_DTYPES.get((getattr(qs, "dtype", None), getattr(scales, "dtype", None)))


def _make_block(tile: int, isa: str, *, by_format: bool = False):
    """An intrinsic block(qs, scales, xq, xsum, xs, Y, tscale, b, t0) that writes
    Y[t0:t0+tokens, 16b:16b+16] for row block b, tokens = `tile`, or with `by_format` the
    format's `token_tiles(isa, format)[tile]`; arrays as in _q_product, C-contiguous. The codes'
    and scales' dtypes pick the format at compile time (_FORMAT_OF_DTYPES)."""

    @intrinsic
    def block(typingctx, qs, scales, xq, xsum, xs, Y, tscale, b, t0):
        fmt = _format_of(qs, scales)
        if fmt is None:
            return None
        tokens = token_tiles(isa, fmt)[tile] if by_format else tile
        dot_isa = dot_lowering(isa, fmt)
        # The signed dot sums the codes' own products: no offset to take back out.
        offset = 0 if dot_isa == "avx2_signed" else CODE_OFFSET[fmt]
        arrays = (qs, scales, xq, xsum, xs, Y)
        dtypes = (qs.dtype, scales.dtype, types.int8, types.int32, types.float32, types.float32)
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
                # avx2: each token's vpmaddubsw results summed in int16 since its last widening
                pending: list[list[ir.Value] | None] = [None] * tokens
                n_pending = [0] * tokens
                for ch in range(BLOCK_BYTES[fmt] // CHUNK):
                    # A prefetch never faults (it does not change program behaviour), so running
                    # past the end of qs is harmless.
                    ahead = builder.gep(qs_.data, [builder.add(wbase, c(CHUNK * ch + PREFETCH_BYTES))])
                    builder.call(prefetch, [builder.bitcast(ahead, _I8.as_pointer()), *pf_args])
                    wv = builder.load(at(qs_, builder.add(wbase, c(CHUNK * ch)), _VB), align=1)
                    if dot_isa == "avx2_signed":
                        w_halves = _halves(builder, wv)
                        w_abs = _abs_halves(builder, wv)
                        for t in range(tokens):
                            x4 = builder.load(at(xq_, builder.add(xbase[t], c(4 * ch)), _I32), align=1)
                            iacc[t] = _dot4_signed_avx2(builder, iacc[t], w_abs, w_halves, x4)
                        continue
                    if fmt == "q8g":
                        # Flipping the sign bit reads int8 code q as the unsigned byte q + 128.
                        parts = [(builder.xor(wv, ir.Constant(_VB, [0x80] * CHUNK)), 4 * ch)]
                    elif fmt == "mxfp4" and isa == "vbmi":
                        parts = list(zip(_mxfp4_codes_vbmi(builder, wv), (4 * ch, GROUP // 2 + 4 * ch), strict=True))
                    else:
                        parts = [(builder.and_(wv, ir.Constant(_VB, [15] * CHUNK)), 4 * ch),
                                 (builder.lshr(wv, ir.Constant(_VB, [4] * CHUNK)), GROUP // 2 + 4 * ch)]
                    if fmt == "mxfp4" and isa != "vbmi":
                        parts = [(_lookup(builder, wpart, _MXFP4_LUT, isa), k) for wpart, k in parts]
                    for t in range(tokens):
                        for wpart, k in parts:
                            x4 = builder.load(at(xq_, builder.add(xbase[t], c(k)), _I32), align=1)
                            if dot_isa != "avx2":
                                iacc[t] = _dot4(builder, iacc[t], wpart, x4, dot_isa)
                                continue
                            if n_pending[t] == PAIR_SUMS_PER_INT16[fmt]:
                                iacc[t] = _widen_pairs(builder, iacc[t], pending[t])
                                pending[t], n_pending[t] = None, 0
                            pairs = _pairs_avx2(builder, wpart, x4)
                            pending[t] = pairs if pending[t] is None else [
                                builder.add(a, p) for a, p in zip(pending[t], pairs, strict=True)]
                            n_pending[t] += 1
                for t in range(tokens):
                    if pending[t] is not None:
                        iacc[t] = _widen_pairs(builder, iacc[t], pending[t])
                exponents = None
                if fmt == "mxfp4":
                    s8 = builder.load(at(sc_, builder.mul(bg, c(ROWS)), ir.VectorType(_I8, ROWS)), align=1)
                    if isa in AVX512_ISAS:
                        exponents = _e8m0_exponents(builder, s8)
                    else:
                        scale = _e8m0_to_f32(builder, s8, isa)
                else:
                    half = ir.VectorType(ir.HalfType(), ROWS)
                    s16 = builder.load(at(sc_, builder.mul(bg, c(ROWS)), ir.VectorType(_I16, ROWS)), align=2)
                    scale = builder.fpext(builder.bitcast(s16, half), _VF)
                for t in range(tokens):
                    tg = builder.add(builder.mul(rows[t], G), g)
                    dots = iacc[t]
                    if offset:
                        corr = builder.mul(builder.load(builder.gep(xsum_.data, [tg])), ir.Constant(_I32, offset))
                        dots = builder.sub(dots, _splat(builder, corr, _VI))
                    dots = builder.sitofp(dots, _VF)
                    xsc = _splat(builder, builder.load(builder.gep(xs_.data, [tg])), _VF)
                    if exponents is not None:
                        both = _scale_by_exponents(builder, xsc, exponents)
                    else:
                        both = builder.fmul(scale, xsc, flags=_IEEE)
                    builder.store(_x86(builder, _FMA, _VF, dots, both, builder.load(faccs[t])), faccs[t])
            tsv = _splat(builder, tscale_, _VF)
            for t in range(tokens):
                out = at(y_, builder.add(builder.mul(rows[t], Np), builder.mul(b_, c(ROWS))), _VF)
                builder.store(builder.fmul(builder.load(faccs[t]), tsv, flags=_IEEE), out, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return block


SMALL_TILE = 4  # what is left after the tiles goes 4 tokens at a time, then 1
# (large, middle) tiles of a product on AVX-512 hosts (32 vector registers), by format: a
# chunk of T tokens runs in large tiles, then middle ones, then SMALL_TILE, then single tokens.
# One pass over a weight chunk (its load and its sign flip or nibble lookup) feeds every token
# of a tile. Measured on this Xeon (VNNI; 3072 x 3584; 8-64 tokens; ms per 32 tokens, 2
# threads), against 4-token tiles: 16 then 8 took 15-22% less time from 16 tokens up in q8g
# and mxfp4, 13-17% in q4g; at 8-13 tokens, 8-token tiles helped q8g (10-15%) and mxfp4 (0-4%)
# but cost q4g 3-4%, so q4g's middle tile is 4. 32-token tiles were slower than 16 (spills).
# AVX2 hosts (16 registers) keep 4 throughout, as before.
AVX512_TILES = {"q8g": (16, 8), "mxfp4": (16, 8), "q4g": (16, 4)}


def token_tiles(isa: str, fmt: str) -> tuple[int, int]:
    """(large, middle) tile of a product of format `fmt` through `isa`'s lowering. Each token's
    arithmetic is the same in any tile: the same bits."""
    return AVX512_TILES[fmt] if isa in AVX512_ISAS else (SMALL_TILE, SMALL_TILE)


def make_tile_size(isa: str, which: int):
    """An intrinsic tile_size(qs, scales) -> the constant `token_tiles(isa, format)[which]` of the
    codes' and scales' format: the step of a driver's loop over `_make_block(which, isa)`."""

    @intrinsic
    def tile_size(typingctx, qs, scales):
        fmt = _format_of(qs, scales)
        if fmt is None:
            return None
        n = token_tiles(isa, fmt)[which]

        def codegen(context, builder, signature, args):
            return context.get_constant(types.intp, n)

        return types.intp(qs, scales), codegen

    return tile_size


LARGE, MIDDLE = 0, 1  # which of token_tiles


ISA = int8_isa()
