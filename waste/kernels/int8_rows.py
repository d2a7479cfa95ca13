"""The row kernel of the q-format products: row block b of Y for every token of a chunk, through
the AMX tiles where the lowering is "amx" (`waste.kernels.amx_blocks`), then the vector blocks
of `waste.kernels.int8_blocks` in tiles of decreasing size."""

from __future__ import annotations

from waste.jit import kernel
from waste.kernels.amx_blocks import _amx_tiles, _no_amx_tiles
from waste.kernels.int8_blocks import LARGE, MIDDLE, SMALL_TILE, _make_block, make_tile_size


def vector_isa(isa: str) -> str:
    """The lowering of the vector blocks under `isa` (the one "amx" adds its tiles to)."""
    return "vbmi" if isa == "amx" else isa


def make_rows(isa: str):
    """A serial kernel rows(qs, scales, xq, xsum, xs, Y, tscale, b) writing row block b of Y for
    all tokens through `isa`'s blocks: large tiles, then middle ones (the format's
    `token_tiles`), then SMALL_TILE, then one at a time (a MoE expert's rows of a prefill chunk
    are rarely a multiple of the tile). The engine's products use the host's (`quant._rows`);
    tests and benchmarks build the other lowerings' to compare them in the same tiling."""
    amx_part = _amx_tiles if isa == "amx" else _no_amx_tiles
    isa = vector_isa(isa)
    large_tile, middle_tile = make_tile_size(isa, LARGE), make_tile_size(isa, MIDDLE)
    block_large, block_middle = _make_block(LARGE, isa, by_format=True), _make_block(MIDDLE, isa, by_format=True)
    block_small, block_one = _make_block(SMALL_TILE, isa), _make_block(1, isa)

    @kernel
    def rows(qs, scales, xq, xsum, xs, Y, tscale, b):
        T = Y.shape[0]
        large, middle = large_tile(qs, scales), middle_tile(qs, scales)
        t = amx_part(qs, scales, xq, xs, Y, tscale, b)
        while t + large <= T:
            block_large(qs, scales, xq, xsum, xs, Y, tscale, b, t)
            t += large
        while t + middle <= T:
            block_middle(qs, scales, xq, xsum, xs, Y, tscale, b, t)
            t += middle
        while t + SMALL_TILE <= T:
            block_small(qs, scales, xq, xsum, xs, Y, tscale, b, t)
            t += SMALL_TILE
        while t < T:
            block_one(qs, scales, xq, xsum, xs, Y, tscale, b, t)
            t += 1

    return rows
