"""AMX-INT8 tiles for the chunks of the q-format products (the "amx" lowering of
`waste.kernels.int8_blocks`): the same integers as the vector blocks, then the same float32
steps per token and group, hence the same bits (tests/kernels/test_quant.py).

One tdpbssd multiplies a tile of up to 16 tokens' activation codes of one group (16 x 32
signed bytes, each token's row of xq) by the group's codes of one row block (8 x 64 bytes:
row i holds inputs 4i .. 4i + 3 of each of the 16 rows, the very chunks of int8_blocks' layout)
into 16 x 16 int32 dots. The codes enter signed (q8g as stored; q4g and mxfp4 looked up as
code - offset by vpermb), so no offset is taken back out. The tiles live in fixed registers
set up per call of the rows kernel (`_amx_configure`, `_amx_release`).
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from waste.jit import kernel
from waste.kernels import mxfp4
from waste.kernels.int8_blocks import (
    _FMA,
    _I8,
    _I16,
    _I32,
    _IEEE,
    _VB,
    _VF,
    _VI,
    CHUNK,
    PREFETCH_BYTES,
    _e8m0_exponents,
    _format_of,
    _scale_by_exponents,
    _splat,
    _x86,
)
from waste.qformat import BLOCK_BYTES, CODE_OFFSET, GROUP, ROWS

AMX_TOKENS = 16  # tokens (tile rows) of one AMX tile
# Two sets of (activation, weight, result) tiles: while one group's result tile is stored, the
# next group's product runs in the other set.
_AMX_TILE_SETS = ((0, 1, 2), (3, 4, 5))
# Weight tiles and dots buffers in flight: a power of two above the groups between a stage's
# write and the next stage's read (three).
_AMX_RING = 4
_P8, _I64 = _I8.as_pointer(), ir.IntType(64)
_TILE_CONFIG_BYTES = 64
# Signed codes looked up by vpermb (index byte's low 6 bits: the 16 codes four times).
_SIGNED_LUT = {"q4g": [n - CODE_OFFSET["q4g"] for n in range(16)],
               "mxfp4": [int(v) for v in mxfp4.E2M1_TWICE]}


def _amx(builder: ir.IRBuilder, name: str, *args: ir.Value) -> None:
    _x86(builder, "llvm.x86." + name, ir.VoidType(), *args)


def _aligned_alloca(builder: ir.IRBuilder, ty: ir.Type) -> ir.Value:
    """A stack slot of type ty in the function's entry block, on a 64-byte boundary (a cache line:
    what tile loads and stores read and write best)."""
    slot = cgutils.alloca_once(builder, ty)
    slot.align = 64
    return slot


def _tile(n: int) -> ir.Constant:
    return ir.Constant(_I8, n)


@intrinsic
def _amx_configure(typingctx, m):
    """Load the tile configuration for tiles of m tokens (1 <= m <= AMX_TOKENS): palette 1, in
    each tile set A m rows of 32 bytes, B 8 rows of 64, C m rows of 64."""
    if not isinstance(m, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        cfg = _aligned_alloca(builder, ir.ArrayType(_I8, _TILE_CONFIG_BYTES))
        builder.store(ir.Constant(cfg.type.pointee, [0] * _TILE_CONFIG_BYTES), cfg)
        base = builder.bitcast(cfg, _P8)
        builder.store(ir.Constant(_I8, 1), base)  # palette 1
        rows = builder.trunc(args[0], _I8)
        shapes = [(GROUP, rows), (CHUNK, ir.Constant(_I8, GROUP // 4)), (4 * ROWS, rows)]  # A, B, C
        for tile, (colsb, nrows) in ((n, shape) for tiles in _AMX_TILE_SETS
                                     for n, shape in zip(tiles, shapes, strict=True)):
            builder.store(ir.Constant(_I16, colsb),
                          builder.bitcast(builder.gep(base, [ir.Constant(_I32, 16 + 2 * tile)]), _I16.as_pointer()))
            builder.store(nrows, builder.gep(base, [ir.Constant(_I32, 48 + tile)]))
        _amx(builder, "ldtilecfg", base)
        return context.get_dummy_value()

    return types.void(m), codegen


@intrinsic
def _amx_release(typingctx):
    """Return the tiles to their initial state (and the thread to cheaper context switches)."""

    def codegen(context, builder, signature, args):
        _amx(builder, "tilerelease")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _amx_block(typingctx, qs, scales, xq, xs, Y, tscale, b, t0, m):
    """Y[t0:t0+m, 16b:16b+16] for row block b through AMX tiles configured for m tokens
    (`_amx_configure(m)`); arrays as in _make_block's block, whose float32 steps per token and
    group these are.

    The groups go through three stages, each a few groups ahead of the next, so that no stage
    waits for the one before (a tile load of bytes just stored, or vector loads of a tile just
    stored, stall): q4g's and mxfp4's codes are looked up as signed bytes into a ring of weight
    tiles (q8g's load as stored), three groups ahead; the tiles multiply two groups ahead, in
    two tile sets, into a ring of dots buffers; the float32 steps scale group g."""
    fmt = _format_of(qs, scales)
    if fmt is None or not all(isinstance(a, types.Array) and a.layout == "C" for a in (qs, scales, xq, xs, Y)):
        return None
    sig = types.void(qs, scales, xq, xs, Y, types.float32, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        qs_, sc_, xq_, xs_, y_ = (context.make_array(ty)(context, builder, a)
                                  for ty, a in zip(signature.args[:5], args[:5], strict=True))
        tscale_, b_, t0_, m_ = args[5:]
        intp = b_.type

        def c(v: int) -> ir.Constant:
            return ir.Constant(intp, v)

        def at(arr, index, vt):
            return builder.bitcast(builder.gep(arr.data, [index]), vt.as_pointer())

        def ring(slots, g):
            """Slot g % RING of a ring of buffers [RING x ...]."""
            which = builder.and_(g, c(_AMX_RING - 1))
            return builder.gep(slots, [ir.Constant(_I32, 0), builder.trunc(which, _I32)])

        G = cgutils.unpack_tuple(builder, qs_.shape)[1]
        Kp = cgutils.unpack_tuple(builder, xq_.shape)[1]
        T, Np = cgutils.unpack_tuple(builder, y_.shape)
        last = builder.sub(T, c(1))
        # Tokens past m read the last token's scales (their results are not stored).
        rows = [builder.select(builder.icmp_signed("<", builder.add(t0_, c(t)), T), builder.add(t0_, c(t)), last)
                for t in range(AMX_TOKENS)]
        dots_ring = _aligned_alloca(builder, ir.ArrayType(ir.ArrayType(_VI, AMX_TOKENS), _AMX_RING))
        codes_ring = _aligned_alloca(builder, ir.ArrayType(ir.ArrayType(_VB, GROUP // 4), _AMX_RING))
        faccs = [cgutils.alloca_once_value(builder, ir.Constant(_VF, None)) for _ in range(AMX_TOKENS)]
        pf_type = ir.FunctionType(ir.VoidType(), [_P8, _I32, _I32, _I32])
        prefetch = cgutils.get_or_insert_function(builder.module, pf_type, "llvm.prefetch.p0")
        pf_args = [ir.Constant(_I32, v) for v in (0, 3, 1)]
        words = ir.VectorType(_I16, CHUNK // 2)
        unpacked = fmt in _SIGNED_LUT

        def stored_codes(g):
            """Where group g of the row block's stored codes starts, prefetching a few groups ahead."""
            base = builder.mul(builder.add(builder.mul(b_, G), g), c(BLOCK_BYTES[fmt]))
            for ch in range(BLOCK_BYTES[fmt] // CHUNK):
                ahead = builder.gep(qs_.data, [builder.add(base, c(CHUNK * ch + PREFETCH_BYTES))])
                builder.call(prefetch, [builder.bitcast(ahead, _P8), *pf_args])
            return base

        def lookup_stage(g):
            """Group g's signed codes (q4g, mxfp4) into its slot of the weight tile ring."""
            base = stored_codes(g)
            table = ir.Constant(_VB, _SIGNED_LUT[fmt] * 4)
            slot = ring(codes_ring, g)
            for ch in range(BLOCK_BYTES[fmt] // CHUNK):
                wv = builder.load(at(qs_, builder.add(base, c(CHUNK * ch)), _VB), align=1)
                high = builder.bitcast(builder.lshr(builder.bitcast(wv, words), ir.Constant(words, [4] * (CHUNK // 2))),
                                       _VB)
                # Chunk ch's low nibbles are inputs 4ch .. 4ch + 3 (tile row ch), its high
                # nibbles 16 + 4ch .. (tile row 4 + ch).
                for row, idx in ((ch, wv), (GROUP // 8 + ch, high)):
                    looked = _x86(builder, "llvm.x86.avx512.permvar.qi.512", _VB, table, idx)
                    builder.store(looked, builder.gep(slot, [ir.Constant(_I32, 0), ir.Constant(_I32, row)]), align=64)

        def tile_stage(g, tiles):
            """Group g's 16 x 16 dots, through tile set `tiles` (A, B, C), into its dots buffer."""
            a, w, d = (_tile(n) for n in tiles)
            if unpacked:
                codes = builder.bitcast(ring(codes_ring, g), _P8)
            else:
                codes = builder.bitcast(builder.gep(qs_.data, [stored_codes(g)]), _P8)
            _amx(builder, "tileloadd64", w, codes, ir.Constant(_I64, CHUNK))
            acts = builder.gep(xq_.data, [builder.add(builder.mul(t0_, Kp), builder.mul(g, c(GROUP)))])
            _amx(builder, "tileloadd64", a, builder.bitcast(acts, _P8), Kp)
            _amx(builder, "tilezero", d)
            _amx(builder, "tdpbssd", d, a, w)
            _amx(builder, "tilestored64", d, builder.bitcast(ring(dots_ring, g), _P8), ir.Constant(_I64, 4 * ROWS))

        def float_stage(g):
            """Group g's dots, scaled, into each token's float32 sums (the vector blocks' steps)."""
            bg = builder.add(builder.mul(b_, G), g)
            exponents = None
            if fmt == "mxfp4":
                exponents = _e8m0_exponents(builder, builder.load(at(sc_, builder.mul(bg, c(ROWS)),
                                                                     ir.VectorType(_I8, ROWS)), align=1))
            else:
                half = ir.VectorType(ir.HalfType(), ROWS)
                s16 = builder.load(at(sc_, builder.mul(bg, c(ROWS)), ir.VectorType(_I16, ROWS)), align=2)
                scale = builder.fpext(builder.bitcast(s16, half), _VF)
            buf = ring(dots_ring, g)
            for t in range(AMX_TOKENS):
                tg = builder.add(builder.mul(rows[t], G), g)
                dots = builder.load(builder.gep(buf, [ir.Constant(_I32, 0), ir.Constant(_I32, t)]), align=64)
                dots = builder.sitofp(dots, _VF)
                xsc = _splat(builder, builder.load(builder.gep(xs_.data, [tg])), _VF)
                if exponents is not None:
                    both = _scale_by_exponents(builder, xsc, exponents)
                else:
                    both = builder.fmul(scale, xsc, flags=_IEEE)
                builder.store(_x86(builder, _FMA, _VF, dots, both, builder.load(faccs[t])), faccs[t])

        def if_group(g):
            return builder.if_then(builder.icmp_signed("<", g, G), likely=True)

        sets = len(_AMX_TILE_SETS)
        if unpacked:
            for g in range(sets + 1):
                with if_group(c(g)):
                    lookup_stage(c(g))
        for g, tiles in enumerate(_AMX_TILE_SETS):
            with if_group(c(g)):
                tile_stage(c(g), tiles)
        # The loop runs in steps of one group per tile set, so that a group's tile set is a
        # constant (tile numbers are immediates).
        with cgutils.for_range(builder, builder.sdiv(builder.add(G, c(sets - 1)), c(sets))) as loop:
            for half, tiles in enumerate(_AMX_TILE_SETS):
                g = builder.add(builder.mul(loop.index, c(sets)), c(half))
                with if_group(g):
                    float_stage(g)
                    if unpacked:
                        with if_group(builder.add(g, c(sets + 1))):
                            lookup_stage(builder.add(g, c(sets + 1)))
                    with if_group(builder.add(g, c(sets))):
                        tile_stage(builder.add(g, c(sets)), tiles)
        tsv = _splat(builder, tscale_, _VF)
        for t in range(AMX_TOKENS):
            with builder.if_then(builder.icmp_signed("<", c(t), m_), likely=True):
                out = at(y_, builder.add(builder.mul(builder.add(t0_, c(t)), Np), builder.mul(b_, c(ROWS))), _VF)
                builder.store(builder.fmul(builder.load(faccs[t]), tsv, flags=_IEEE), out, align=4)
        return context.get_dummy_value()

    return sig, codegen


# Chunks of fewer tokens than this, and what is left after the full AMX tiles when it is fewer,
# run through the vector blocks.
AMX_MIN_TOKENS = 12


@kernel
def _amx_tiles(qs, scales, xq, xs, Y, tscale, b):
    """Row block b of Y for the first tokens of the chunk through AMX tiles: every full tile of
    AMX_TOKENS, then the rest if it is at least AMX_MIN_TOKENS. Returns the tokens done."""
    T = Y.shape[0]
    if T < AMX_MIN_TOKENS:
        return 0
    t = 0
    _amx_configure(AMX_TOKENS)
    while t + AMX_TOKENS <= T:
        _amx_block(qs, scales, xq, xs, Y, tscale, b, t, AMX_TOKENS)
        t += AMX_TOKENS
    if T - t >= AMX_MIN_TOKENS:
        _amx_configure(T - t)
        _amx_block(qs, scales, xq, xs, Y, tscale, b, t, T - t)
        t = T
    _amx_release()
    return t


@kernel
def _no_amx_tiles(qs, scales, xq, xs, Y, tscale, b):
    """The lowerings without AMX: no token goes through tiles (and no tile instruction is compiled)."""
    return 0
