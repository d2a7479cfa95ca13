"""Weight formats and quantised products against the float64 oracle in waste.reference.quant.

Tolerances:
- Quantised products against reference arithmetic on the same integers: 1e-6 of the output
  scale (max |reference|). The integer dot per group is exact; what remains is float32
  scaling and a float32 sum over K/32 groups, a few ulps of the largest partial sum.
- Dequantised weights are code * scale * tscale with a float16 scale and a power-of-two
  tscale: one float32 rounding, so they equal the float64 oracle rounded to float32.
- Unquantised f32/bf16 products: 1e-5 of the output scale (float32 accumulation over <= 320;
  bf16 against the product of the bf16-rounded activations, which is what it computes).
- Signal-to-noise bounds for Gaussian weights and activations (K = 1024), derived from the
  step sizes: a uniform rounding error of step d has power d^2/12, and d = amax/127 (q8g)
  or amax/8 (q4g) with amax ~ 2.1 sigma for 32 Gaussians, so q8g weights give ~46 dB and
  int8 activations another ~46 dB (together ~43), q4g ~22 dB, bf16 (8-bit mantissa) ~56 dB
  for the weights and, since its products round the activations to bf16 too (as vdpbf16ps),
  another ~56 dB (together ~53). Measured: f32 129-134, bf16 52.9 (55.7 before the
  activations were rounded), q8g 42.5, q4g 21.2 dB; the bounds leave 1-3 dB.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import max_rel_err

from waste.errors import WasteError
from waste.jit import kernel
from waste.kernels import activations, int8_blocks, int8_rows, mxfp4, qbatch
from waste.kernels import quant as qk
from waste.kernels.quant import QMatrix, from_buffers, quantize
from waste.qformat import FORMATS, QMAX, bits_per_weight, buffer_layout
from waste.reference import quant as ref

QFORMATS = ("q8g", "q4g")
# mxfp4 needs K % 32 == 0; the shapes below that pad K test the others (mxfp4: test_mxfp4.py).
ANY_K_FORMATS = tuple(f for f in FORMATS if f != "mxfp4")
# mxfp4 measured 19.0 dB: for Gaussian weights its grid is coarser than q4g's where most lie.
SNR_BOUND_DB = {"f32": 120.0, "bf16": 51.0, "q8g": 40.0, "q4g": 20.0, "mxfp4": 18.0}



def test_buffer_layout_padding_and_bits_per_weight() -> None:
    assert bits_per_weight("f32", (4096, 2304)) == 32.0
    assert bits_per_weight("bf16", (4096, 2304)) == 16.0
    assert abs(bits_per_weight("q8g", (4096, 2304)) - 8.5) < 1e-4
    assert abs(bits_per_weight("q4g", (4096, 2304)) - 4.5) < 1e-4
    # N pads to 16 rows and K to 32 inputs inside the format; the logical shape stays.
    layout = {name: (dt, s) for name, dt, s in buffer_layout("q4g", (4, 16))}
    assert layout == {"qs": (np.dtype(np.uint8), (1, 1, 256)), "scales": (np.dtype(np.float16), (1, 1, 16)),
                      "tscale": (np.dtype(np.float32), (1,))}
    assert buffer_layout("q8g", (4096, 128))[0][2] == (256, 4, 512)
    for fmt in ANY_K_FORMATS:
        m = quantize(np.ones((37, 70), np.float32), fmt)
        assert m.shape == (37, 70)
        assert [(k, b.dtype, b.shape) for k, b in m.buffers.items()] == buffer_layout(fmt, (37, 70))


@pytest.mark.parametrize("fmt", ANY_K_FORMATS)
def test_from_buffers_checks_every_buffer(fmt: str) -> None:
    m = quantize(np.random.default_rng(0).standard_normal((20, 40)), fmt)
    again = from_buffers(fmt, (20, 40), dict(m.buffers))
    np.testing.assert_array_equal(again.dequantize(), m.dequantize())
    name = next(iter(m.buffers))
    with pytest.raises(WasteError, match=name):
        from_buffers(fmt, (20, 40), {**m.buffers, name: m.buffers[name].astype(np.float64)})
    with pytest.raises(WasteError, match=name):
        from_buffers(fmt, (21, 40) if fmt in ("f32", "bf16") else (33, 40), m.buffers)
    with pytest.raises(WasteError, match=name):
        from_buffers(fmt, (20, 40), {})


def test_bad_input_is_refused() -> None:
    with pytest.raises(WasteError, match="unknown weight format"):
        quantize(np.ones((2, 2)), "q5")
    with pytest.raises(WasteError, match="2-D"):
        quantize(np.ones(4), "q8g")
    with pytest.raises(WasteError, match="NaN or infinite"):
        quantize(np.array([[1.0, np.nan]]), "q4g")
    m = quantize(np.ones((3, 40)), "q8g")
    with pytest.raises(WasteError, match=r"shape \(40,\)"):
        m.matvec(np.ones(41, np.float32))
    with pytest.raises(WasteError, match=r"\[T, 40\]"):
        m.matmul(np.ones((2, 39), np.float32))
    with pytest.raises(WasteError, match="out of range"):
        m.take_rows(np.array([0, 3]))


def test_activation_codes_match_reference() -> None:
    rng = np.random.default_rng(1)
    T, K = 6, 70
    X = (rng.standard_normal((T, K)) * rng.uniform(1e-3, 1e3, (T, 1))).astype(np.float32)
    X[1, 32:64] = 0.0  # an all-zero group
    X[2, 5] = np.nan
    X[3, 40] = -np.inf
    X[4, :] = 0.25  # all equal: every code 127
    G = 3
    xq = np.full((T, G * 32), 99, np.int8)
    xsum = np.full((T, G), -7, np.int32)
    xs = np.full((T, G), np.nan, np.float32)
    activations.quantize_activations(X, xq, xsum, xs)
    codes, scales = ref.reference_quantize_activation(X)
    np.testing.assert_array_equal(xq.reshape(T, G, 32), codes)
    np.testing.assert_array_equal(xsum, codes.sum(axis=-1))
    np.testing.assert_array_equal(xs, scales.astype(np.float32))
    assert np.isnan(xs[2, 0]) and np.isnan(xs[3, 1]) and xs[1, 1] == 0 and np.all(xq[4, :70] == 127)
    assert np.all(xq[:, 70:] == 0)


def test_activation_codes_round_half_to_even() -> None:
    """Codes exactly halfway between two integers round to the even one (NumPy's rint, the
    reference's rule): random inputs never land on a tie, so this group is built to (amax 127
    makes every code the input itself)."""
    X = np.zeros((1, 32), np.float32)
    X[0, :8] = [127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, -3.5]
    xq = np.zeros((1, 32), np.int8)
    xsum = np.zeros((1, 1), np.int32)
    xs = np.zeros((1, 1), np.float32)
    activations.quantize_activations(X, xq, xsum, xs)
    codes, _ = ref.reference_quantize_activation(X)
    np.testing.assert_array_equal(xq[0, :8], [127, 2, 4, -2, 0, 0, 2, -4])
    np.testing.assert_array_equal(xq.reshape(codes.shape), codes)


SHAPES = [(37, 70, 9), (16, 32, 1), (4, 16, 5), (1, 33, 4), (96, 320, 13), (64, 288, 29)]  # 29 = 16 + 8 + 4 + 1


@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize(("N", "K", "T"), SHAPES)
def test_quantised_product_matches_reference(fmt: str, N: int, K: int, T: int) -> None:
    rng = np.random.default_rng(N * 1000 + K + T)
    w = (rng.standard_normal((N, K)) * rng.uniform(0.01, 3.0, (N, 1))).astype(np.float32)
    X = (rng.standard_normal((T, K)) * rng.uniform(0.1, 10.0, (T, 1))).astype(np.float32)
    m = quantize(w, fmt)
    Y = m.matmul(X)
    exact = ref.reference_matmul(m, X)
    assert Y.shape == (T, N) and Y.dtype == np.float32 and Y.flags.c_contiguous
    assert max_rel_err(Y, exact) <= 1e-6
    for t in range(T):
        y = m.matvec(X[t])
        # One token and a chunk run the same per-token arithmetic: bit-identical.
        np.testing.assert_array_equal(y, Y[t])
        assert max_rel_err(y, ref.reference_matvec(m, X[t])) <= 1e-6


@pytest.mark.parametrize("fmt", ("f32", "bf16"))
def test_unquantised_product_matches_reference(fmt: str) -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((37, 320)).astype(np.float32)
    X = rng.standard_normal((5, 320)).astype(np.float32)
    m = quantize(w, fmt)
    assert max_rel_err(m.matmul(X), ref.reference_matmul(m, X)) <= 1e-5
    assert max_rel_err(m.matvec(X[2]), ref.reference_matvec(m, X[2])) <= 1e-5
    assert max_rel_err(m.matmul(X[:1]), ref.reference_matmul(m, X[:1])) <= 1e-5


def _driver(isa: str):
    """A serial driver over the blocks as lowered for one instruction set, in the tiles the engine
    uses with that lowering (`int8_rows.make_rows`)."""
    rows = int8_rows.make_rows(isa)

    @kernel
    def drive(qs, scales, tscale, xq, xsum, xs, Y):
        for b in range(qs.shape[0]):
            rows(qs, scales, xq, xsum, xs, Y, tscale[0], b)

    return drive


# The lowerings this host can run: the generic one always, AVX2, VNNI and AMX where the CPU has them.
HOST_ISAS = int8_blocks.ISAS[int8_blocks.ISAS.index(int8_blocks.ISA):]


@pytest.mark.parametrize("isa", HOST_ISAS)
@pytest.mark.parametrize("fmt", (*QFORMATS, "mxfp4"))
def test_every_lowering_gives_the_same_bits(fmt: str, isa: str) -> None:
    rng = np.random.default_rng(4)
    # 31 tokens: on AVX-512 a tile of 16, one of 8 (q4g: 4 + 4 + 4), one of 4 and 3 single tokens
    N, K, T = 40, 96 if fmt == "mxfp4" else 100, 31
    m = quantize(rng.standard_normal((N, K)), fmt)
    X = rng.standard_normal((T, K)).astype(np.float32)
    G = -(-K // 32)
    xq, xsum, xs = np.empty((T, G * 32), np.int8), np.empty((T, G), np.int32), np.empty((T, G), np.float32)
    activations.quantize_activations(X, xq, xsum, xs)
    Y = np.full((T, 48), np.nan, np.float32)
    qs, scales, tscale = m._qargs[:3]  # the kernels' arguments (for mxfp4, its repacked copy)
    _driver(isa)(qs, scales, tscale, xq, xsum, xs, Y)
    np.testing.assert_array_equal(Y[:, :N], m.matmul(X))


@pytest.mark.skipif("amx" not in HOST_ISAS, reason="the host has no AMX (or Linux does not grant it)")
@pytest.mark.parametrize("fmt", (*QFORMATS, "mxfp4"))
@pytest.mark.parametrize(("T", "K"), [(12, 32), (16, 64), (16, 352), (27, 96), (40, 320), (47, 128), (64, 2304)])
def test_amx_tiles_give_the_vector_blocks_bits(fmt: str, T: int, K: int) -> None:
    """The AMX lowering against the vector one ("vbmi", whose bits every other lowering gives):
    one group and many, odd and even group counts (the tile sets alternate), full tiles of 16
    tokens, a last tile of fewer (27 = 16 + 11 through the vector blocks, 47 = 16 + 16 + 15 in
    tiles), fewer tokens than a tile (12)."""
    rng = np.random.default_rng(T * K)
    N = 40
    m = quantize(rng.standard_normal((N, K)) * rng.uniform(0.01, 10.0, (N, 1)), fmt)
    X = (rng.standard_normal((T, K)) * rng.uniform(0.01, 10.0, (T, 1))).astype(np.float32)
    G = K // 32
    xq, xsum, xs = np.empty((T, G * 32), np.int8), np.empty((T, G), np.int32), np.empty((T, G), np.float32)
    activations.quantize_activations(X, xq, xsum, xs)
    qs, scales, tscale = m._qargs[:3]
    Y = {isa: np.full((T, 48), np.nan, np.float32) for isa in ("amx", "vbmi")}
    for isa, out in Y.items():
        _driver(isa)(qs, scales, tscale, xq, xsum, xs, out)
    np.testing.assert_array_equal(Y["amx"], Y["vbmi"])
    assert max_rel_err(Y["amx"][:, :N], ref.reference_matmul(m, X)) <= 1e-6


@pytest.mark.parametrize("isa", HOST_ISAS)
@pytest.mark.parametrize("fmt", int8_blocks.SMALL_CODES)
@pytest.mark.parametrize("T", [7, 16])
def test_small_code_dots_are_exact_at_the_extreme_codes(fmt: str, isa: str, T: int) -> None:
    """The largest unsigned codes (q4g 15, mxfp4 24: nibble 7, +6) and the smallest (0) against
    activation codes +-127 at every position (all of one sign, then mixed): the AVX2 lowering
    sums up to PAIR_SUMS_PER_INT16 vpmaddubsw results in int16, so the all-+127 and all--127
    tokens reach that bound in every lane and one more would wrap. mxfp4 also takes scale bytes
    0 (2^-127), 127 (1) and 255 (NaN). Expected: the integer dots times the scales, exact."""
    rng = np.random.default_rng(11)
    NB, G = 2, 3
    top, bottom = (0x77, 0xFF) if fmt == "mxfp4" else (0xFF, 0x00)  # both nibbles largest / smallest
    qs = rng.choice(np.array([top, bottom, top & 0x0F | bottom & 0xF0, 0x00, 0x3C], np.uint8), size=(NB, G, 256))
    qs[0, 0], qs[1, 0] = top, bottom
    xq = rng.choice(np.array([-127, 127], np.int8), size=(T, G * 32))
    xq[0], xq[1] = 127, -127
    xsum = xq.reshape(T, G, 32).sum(axis=-1, dtype=np.int32)
    # qs [b, g, chunk, row, i]: the low nibble is input 32g + 4 chunk + i of row 16b + row, the
    # high nibble input 32g + 16 + 4 chunk + i.
    nib = qs.reshape(NB, G, 4, 16, 4)
    nibbles = np.concatenate([nib & 15, nib >> 4], axis=2).transpose(0, 3, 1, 2, 4).reshape(NB * 16, G * 32)
    if fmt == "mxfp4":
        w = mxfp4.E2M1_TWICE[nibbles].astype(np.int64)  # twice the E2M1 values
        row_scale = rng.choice(np.array([0, 127, 255], np.uint8), size=NB * 16)
        row_scale[:3] = (0, 127, 255)
        scales = np.repeat(row_scale.reshape(NB, 1, 16), G, axis=1)
        tscale = qk.MXFP4_TSCALE
        factor = np.where(row_scale == 255, np.nan, np.ldexp(0.5, row_scale.astype(np.int32) - 127))
    else:
        w = nibbles.astype(np.int64) - 8
        scales = np.full((NB, G, 16), np.float16(1.0).view(np.uint16), np.uint16)
        tscale, factor = np.ones(1, np.float32), np.ones(NB * 16)
    Y = np.full((T, NB * 16), np.nan, np.float32)
    _driver(isa)(qs, scales, tscale, xq, xsum, np.ones((T, G), np.float32), Y)
    # |dot| < 2^24 and one power of two per row: the float32 result is exact.
    expected = (xq.astype(np.int64) @ w.T) * factor
    assert (np.abs(xq.astype(np.int64) @ w.T) < 2**24).all()
    np.testing.assert_array_equal(Y, expected.astype(np.float32))


@pytest.mark.parametrize("T", [1, 7, 16])
def test_mxfp4_scales_round_alike_in_every_lowering_down_to_subnormals(T: int) -> None:
    """The AVX-512 blocks scale an activation's scale by 2^(s - 127) with vscalefps, the others
    multiply it by the decoded scale: one rounding of the same exact product either way, also
    where it falls among the subnormals (scale bytes 0-3 times activation scales that are not
    powers of two) and where the NaN byte 255 sits. Every lowering of this host, the same bits."""
    rng = np.random.default_rng(21)
    NB, G = 2, 4
    qs = rng.integers(0, 256, size=(NB, G, 256), dtype=np.uint8)
    scales = rng.choice(np.array([0, 1, 2, 3, 100, 127, 200, 254, 255], np.uint8), size=(NB, G, 16))
    xq = rng.integers(-127, 128, size=(T, G * 32), dtype=np.int8)
    xsum = xq.reshape(T, G, 32).sum(axis=-1, dtype=np.int32)
    xs = (rng.uniform(0.1, 3.0, size=(T, G)) * np.array([1, 1e-3, 1e3, 1])[None, :G]).astype(np.float32)
    results = {}
    for isa in HOST_ISAS:
        Y = np.full((T, NB * 16), -1.0, np.float32)
        _driver(isa)(qs, scales, qk.MXFP4_TSCALE, xq, xsum, xs, Y)
        results[isa] = Y
    for isa, Y in results.items():
        np.testing.assert_array_equal(Y, results["generic"], err_msg=isa)
    finite = results["generic"][np.isfinite(results["generic"])]
    assert np.isnan(results["generic"]).any() and (np.abs(finite[finite != 0]) < 1e-30).any()


@pytest.mark.parametrize("isa", HOST_ISAS)
@pytest.mark.parametrize("T", [6, 16])
def test_q8g_dots_are_exact_at_the_extreme_codes(isa: str, T: int) -> None:
    """Weight codes -128, -127, 127 against activation codes +-127 (all of one sign, then mixed):
    where a lowering that sums two products in int16 would saturate. With unit scales each output
    is the integer dot itself (|dot| < 2^24, exact in float32)."""
    rng = np.random.default_rng(6)
    NB, G = 2, 3
    qs = rng.choice(np.array([-128, -127, 127, 0, 1], np.int8), size=(NB, G, 512))
    qs[0, 0] = 127
    qs[1, 0] = -128
    scales = np.full((NB, G, 16), np.float16(1.0).view(np.uint16), np.uint16)
    xq = rng.choice(np.array([-127, 127], np.int8), size=(T, G * 32))
    xq[0], xq[1] = 127, -127
    xsum = xq.reshape(T, G, 32).sum(axis=-1, dtype=np.int32)
    Y = np.full((T, NB * 16), np.nan, np.float32)
    _driver(isa)(qs, scales, np.ones(1, np.float32), xq, xsum, np.ones((T, G), np.float32), Y)
    # qs [b, g, chunk, row, i] holds the code of row 16b + row at input 32g + 4 chunk + i
    w = qs.reshape(NB, G, 8, 16, 4).transpose(0, 3, 1, 2, 4).reshape(NB * 16, G * 32)
    np.testing.assert_array_equal(Y, (xq.astype(np.int64) @ w.astype(np.int64).T).astype(np.float32))


@pytest.mark.parametrize("fmt", ANY_K_FORMATS)
@pytest.mark.parametrize(("N", "K", "T"), [(40, 72, 1), (33, 64, 7), (16, 32, 33)])
def test_matmul_pair_equals_two_products(fmt: str, N: int, K: int, T: int) -> None:
    rng = np.random.default_rng(31)
    a, b = (quantize(rng.standard_normal((N, K)).astype(np.float32), fmt) for _ in range(2))
    X = rng.standard_normal((T, K)).astype(np.float32)
    ya, yb = qk.matmul_pair(X, a, b)
    np.testing.assert_array_equal(ya, a.matmul(X))
    np.testing.assert_array_equal(yb, b.matmul(X))
    assert ya.shape == yb.shape == (T, N)
    with pytest.raises(WasteError):
        qk.matmul_pair(X[:, :-1], a, b)


@pytest.mark.parametrize("fmt", ANY_K_FORMATS)
def test_dequantize_and_take_rows(fmt: str) -> None:
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((37, 70)) * rng.uniform(1e-3, 1e2, (37, 1))).astype(np.float32)
    m = quantize(w, fmt)
    dq = m.dequantize()
    assert dq.shape == (37, 70) and dq.dtype == np.float32
    np.testing.assert_array_equal(dq, ref.reference_dequantize(m).astype(np.float32))
    ids = np.array([36, 0, 17, 17, 5])
    np.testing.assert_array_equal(m.take_rows(ids), dq[ids])
    assert m.take_rows(np.array([], np.int64)).shape == (0, 70)


@pytest.mark.parametrize("fmt", QFORMATS)
def test_rounding_error_within_half_a_step(fmt: str) -> None:
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((48, 96)) * rng.uniform(1e-4, 1e4, (48, 1))).astype(np.float32)
    err = np.abs(quantize(w, fmt).dequantize().astype(np.float64) - w).reshape(48, 3, 32)
    amax = np.abs(w.astype(np.float64)).reshape(48, 3, 32).max(axis=-1, keepdims=True)
    # The float16 scale is within 2^-11 of amax/127; q4g's opposite-sign extreme clips to +7,
    # a full step away, every other weight is within half a step.
    step = amax / QMAX[fmt] * (1 + 2.0**-10)
    assert np.all(err <= (0.5 if fmt == "q8g" else 1.0) * step)
    if fmt == "q4g":
        assert np.mean(err <= 0.5 * step) > 0.99


@pytest.mark.parametrize("fmt", QFORMATS)
def test_exact_round_trips(fmt: str) -> None:
    rng = np.random.default_rng(7)
    N, K = 20, 64
    # Weights on the grid: codes times a float16 scale, each group holding its extreme code.
    codes = rng.integers(-127, 128, (N, K // 32, 32)) if fmt == "q8g" else rng.integers(-7, 8, (N, K // 32, 32))
    codes[:, :, 5] = 127 if fmt == "q8g" else -8
    scales = rng.uniform(0.5, 1.0, (N, K // 32, 1)).astype(np.float16).astype(np.float64) * 2.0**-9
    w = (codes * scales).reshape(N, K).astype(np.float32)
    np.testing.assert_array_equal(quantize(w, fmt).dequantize(), w)
    # Any weights: quantising the dequantised weights again changes nothing.
    v = (rng.standard_normal((N, 50)) * rng.uniform(1e-3, 1e3, (N, 1))).astype(np.float32)
    once = quantize(v, fmt).dequantize()
    np.testing.assert_array_equal(quantize(once, fmt).dequantize(), once)
    # A power-of-two rescale of the weights rescales the stored matrix exactly, tiny or huge.
    for e in (-100, 60):
        np.testing.assert_array_equal(quantize(np.ldexp(v, e), fmt).dequantize(), np.ldexp(once, e))


@pytest.mark.parametrize("fmt", QFORMATS)
def test_extreme_values(fmt: str) -> None:
    rng = np.random.default_rng(8)
    x = rng.standard_normal(70).astype(np.float32)
    # All equal: every weight of a group sits on the grid's extreme.
    m = quantize(np.full((5, 70), -0.37, np.float32), fmt)
    np.testing.assert_allclose(m.dequantize(), -0.37, rtol=2.0**-10)
    assert max_rel_err(m.matvec(x), ref.reference_matvec(m, x)) <= 1e-6
    # One outlier: its group's other weights round on the outlier's step; others are unaffected.
    w = (0.01 * rng.standard_normal((5, 70))).astype(np.float32)
    w[2, 40] = 1000.0
    m = quantize(w, fmt)
    dq = m.dequantize()
    assert dq[2, 40] == pytest.approx(1000.0, rel=2.0**-10)
    np.testing.assert_allclose(dq[[0, 1, 3, 4]], w[[0, 1, 3, 4]], atol=0.01 * (0.03 if fmt == "q8g" else 0.4))
    assert max_rel_err(m.matvec(x), ref.reference_matvec(m, x)) <= 1e-6
    # All zero: exact zeros.
    z = quantize(np.zeros((3, 40), np.float32), fmt)
    assert not z.matvec(x[:40]).any() and not z.dequantize().any()
    # Zero rows and zero tokens.
    e = quantize(np.zeros((0, 40), np.float32), fmt)
    assert e.matvec(x[:40]).shape == (0,) and e.matmul(np.ones((3, 40))).shape == (3, 0)
    assert e.dequantize().shape == (0, 40) and ref.reference_matmul(e, np.ones((3, 40))).shape == (3, 0)
    assert quantize(w, fmt).matmul(np.zeros((0, 70), np.float32)).shape == (0, 5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_activation_reaches_the_output(fmt: str) -> None:
    rng = np.random.default_rng(9)
    m = quantize(rng.standard_normal((20, 64)), fmt)
    x = rng.standard_normal(64).astype(np.float32)
    x[3] = np.nan
    assert np.isnan(m.matvec(x)).all()


def test_snr_within_format_bounds() -> None:
    rng = np.random.default_rng(10)
    w = (0.02 * rng.standard_normal((256, 1024))).astype(np.float32)
    x = rng.standard_normal((8, 1024)).astype(np.float32)
    snr = {fmt: qk.quantization_snr_db(w, fmt, x) for fmt in FORMATS}
    print("SNR dB:", {k: round(v, 2) for k, v in snr.items()})
    for fmt in FORMATS:
        assert snr[fmt] >= SNR_BOUND_DB[fmt], (fmt, snr[fmt])
    assert snr["f32"] > snr["bf16"] > snr["q8g"] > snr["q4g"] > snr["mxfp4"]


def test_qmatrix_is_frozen() -> None:
    m = quantize(np.ones((2, 32)), "q8g")
    assert isinstance(m, QMatrix)
    with pytest.raises(AttributeError):
        m.fmt = "q4g"  # type: ignore[misc]


@pytest.mark.parametrize("fmts", [("q8g",), ("q4g",), ("mxfp4",), ("q4g", "q8g"), ("q8g", "mxfp4")])
@pytest.mark.parametrize(("M", "N", "K"), [(1, 16, 32), (5, 40, 64), (9, 33, 96)])
def test_q_products_equal_one_product_each(fmts: tuple[str, ...], M: int, N: int, K: int) -> None:
    """Every matrix of one call against its own matvec, bit for bit, into a NaN-filled output
    (each output element written); inputs shared by several matrices or one each; matrices of
    one or two formats in any order, with row counts of their own."""
    rng = np.random.default_rng(M * 100 + N + len(fmts))
    shapes = [(N if m % 2 == 0 else int(rng.integers(1, 3 * N)), K) for m in range(M)]
    ms = [quantize((rng.standard_normal(shape) * rng.uniform(0.01, 2, (shape[0], 1))).astype(np.float32),
                   fmts[int(rng.integers(len(fmts)))]) for shape in shapes]
    X = (rng.standard_normal((3, K)) * [[0.1], [1.0], [30.0]]).astype(np.float32)
    rows = rng.integers(0, 3, M)
    Y = qbatch.q_products(X, ms, rows)
    assert Y.shape == (M, max(n for n, _ in shapes)) and Y.dtype == np.float32
    for m, w in enumerate(ms):
        np.testing.assert_array_equal(Y[m, :w.shape[0]], w.matvec(X[rows[m]]))
        np.testing.assert_array_equal(Y[m, :w.shape[0]], qbatch.QBatch([w])(X, rows[m:m + 1])[0, :w.shape[0]])
    # Both drivers, the decode one and the spans one (one row per matrix), into NaN-filled outputs.
    batch = qbatch.QBatch(ms)
    Y_nan = np.full((M, 1, batch.width), np.nan, np.float32)
    qbatch._q_products(X, rows.astype(np.int64), batch.table, batch.tscales, batch.first_format, *batch.likes, Y_nan,
                   2)
    Y_spans = np.full((M, batch.width), np.nan, np.float32)
    quantized = activations.quantized_activations(X, batch.likes[0].shape[1])
    qbatch._q_spans(*quantized, rows.astype(np.int64), np.ones(M, np.int64), np.arange(M), batch.table, batch.tscales,
                batch.first_format, *batch.likes, Y_spans, 2)
    for m, w in enumerate(ms):
        for out in (Y_nan[m, 0], Y_spans[m]):
            np.testing.assert_array_equal(out[:w.shape[0]], Y[m, :w.shape[0]])
            assert np.isfinite(out[:batch.table[m, 2] * 16]).all()


@pytest.mark.parametrize("fmts", [("q4g", "q8g"), ("mxfp4",)])
def test_q_products_in_parallel_equal_one_product_each_whatever_the_threads(fmts: tuple[str, ...]) -> None:
    """Products large enough for the parallel region (past SERIAL_BYTES), one or two formats,
    row counts that leave partial items: on 1, 2, 3 or 5 threads (more than the cores: the
    ranges of threads that never run are taken by the others, `waste.kernels.steal`) every
    output element is written and equals the matrix's own matvec, bit for bit; so does the
    pair driver `_q_product` on any number of threads."""
    rng = np.random.default_rng(17)
    K = 256
    shapes = [(int(n), K) for n in rng.integers(40, 300, 9)]
    ms = [quantize(rng.standard_normal(shape).astype(np.float32), fmts[m % len(fmts)])
          for m, shape in enumerate(shapes)]
    X = rng.standard_normal((2, K)).astype(np.float32)
    rows = rng.integers(0, 2, len(ms)).astype(np.int64)
    batch = qbatch.QBatch(ms)
    assert sum(m.nbytes for m in ms) > 2 * qk.SERIAL_BYTES  # codes past SERIAL_BYTES: the parallel region
    expected = [w.matvec(X[rows[m]]) for m, w in enumerate(ms)]
    a = ms[0]
    b = quantize(rng.standard_normal(a.shape).astype(np.float32), a.fmt)
    for threads in (1, 2, 3, 5):
        Y = np.full((len(ms), 1, batch.width), np.nan, np.float32)
        qbatch._q_products(X, rows, batch.table, batch.tscales, batch.first_format, *batch.likes, Y, threads)
        for m, w in enumerate(ms):
            np.testing.assert_array_equal(Y[m, 0, :w.shape[0]], expected[m])
            assert np.isfinite(Y[m, 0, :batch.table[m, 2] * 16]).all()
        qa, sa, ta, padded, _, _ = a._qargs
        qb, sb, tb, _, _, _ = b._qargs
        Ya, Yb = (np.full((1, padded), np.nan, np.float32) for _ in range(2))
        qk._q_product(X[:1], qa, sa, ta, qb, sb, tb, Ya, Yb, threads)
        np.testing.assert_array_equal(Ya[0, :a.shape[0]], a.matvec(X[0]))
        np.testing.assert_array_equal(Yb[0, :b.shape[0]], b.matvec(X[0]))


@pytest.mark.parametrize("fmts", [("q8g",), ("q4g",), ("mxfp4",), ("q4g", "q8g")])
@pytest.mark.parametrize("threads", [1, 2])
def test_q_spans_equal_each_matrix_on_its_rows(fmts: tuple[str, ...], threads: int) -> None:
    """Matrices each on a run of rows of their own (a prefill's experts on their tokens: empty
    runs, single rows, runs longer than a tile, runs that overlap or share rows), written to
    rows of their own in a NaN-filled output: each run equals the matrix's own matmul, bit for
    bit, and nothing else is written; the same in one part or split in two."""
    rng = np.random.default_rng(len(fmts) * 10 + threads)
    K, R = 96, 70
    counts = [0, 1, 3, 17, 33, 5, 0, 16, 40, 2, 9]
    ms = [quantize((rng.standard_normal((int(rng.integers(1, 80)), K)) * rng.uniform(0.01, 2)).astype(np.float32),
                   fmts[m % len(fmts)]) for m in range(len(counts))]
    X = (rng.standard_normal((R, K)) * rng.uniform(0.05, 30, (R, 1))).astype(np.float32)
    x_start = [int(rng.integers(0, R - n + 1)) for n in counts]
    y_start = np.concatenate([[0], np.cumsum(counts)[:-1]]) + 2  # rows 0-1 and the last two: no span's
    out_rows = sum(counts) + 4
    batch = qbatch.QBatch(ms)
    Y = np.full((out_rows, batch.width), np.nan, np.float32)
    quantized = activations.quantized_activations(X, batch.likes[0].shape[1])
    qbatch._q_spans(*quantized, np.array(x_start), np.array(counts), y_start, batch.table, batch.tscales,
                batch.first_format, *batch.likes, Y, threads)
    written = np.zeros(Y.shape, bool)
    for m, w in enumerate(ms):
        a, n, b = x_start[m], counts[m], y_start[m]
        if n:
            np.testing.assert_array_equal(Y[b:b + n, :w.shape[0]], w.matmul(X[a:a + n]))
        written[b:b + n, :batch.table[m, 2] * 16] = True
    assert np.isfinite(Y[written]).all() and np.isnan(Y[~written]).all()
    Z = qbatch.q_spans(X, ms, x_start, counts, y_start, out_rows)
    np.testing.assert_array_equal(Z[written[:, :Z.shape[1]]], Y[:, :Z.shape[1]][written[:, :Z.shape[1]]])


def test_q_spans_refuse_spans_outside_their_arrays() -> None:
    a = quantize(np.ones((16, 32)), "q8g")
    X = np.ones((4, 32), np.float32)
    assert qbatch.q_spans(X, [a], [1], [3], [0], 3).shape == (3, 16)
    for x_start, count, y_start, out_rows in (([2], [3], [0], 3), ([0], [3], [1], 3), ([-1], [1], [0], 1),
                                              ([0], [-1], [0], 1), ([0, 0], [1], [0], 1)):
        with pytest.raises(WasteError, match="spans of rows"):
            qbatch.q_spans(X, [a], x_start, count, y_start, out_rows)


def test_q_products_refuse_other_matrices_and_bad_inputs() -> None:
    rng = np.random.default_rng(5)
    a, b, c = (quantize(rng.standard_normal((16, 32)).astype(np.float32), f) for f in ("q8g", "q4g", "mxfp4"))
    wide = quantize(rng.standard_normal((16, 64)).astype(np.float32), "q8g")
    X = np.ones((1, 32), np.float32)
    assert qbatch.batchable([a, b]) and qbatch.batchable([a, quantize(np.ones((48, 32)), "q8g")])
    for other in ([a, b, c], [a, wide], [quantize(np.ones((16, 32)), "f32")], [a, quantize(np.ones((16, 32)), "bf16")]):
        assert not qbatch.batchable(other)
        with pytest.raises(WasteError, match="at most two formats and one input width"):
            qbatch.q_products(X, other, [0] * len(other))
    with pytest.raises(WasteError, match="row ids"):
        qbatch.q_products(X, [a, a], [0, 1])
    with pytest.raises(WasteError, match="row ids"):
        qbatch.q_products(np.ones((1, 31), np.float32), [a], [0])
    with pytest.raises(WasteError, match="row ids"):
        qbatch.q_products(X, [a, a], [0, -1])
