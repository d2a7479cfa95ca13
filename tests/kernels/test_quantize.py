"""The q8g/q4g weight quantiser (waste.kernels.quantize) against reference_quantize: byte for
byte (codes, float16 scale bits including the sign of zero, tscale), no tolerance."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from waste.errors import WasteError
from waste.jit import kernel
from waste.kernels import quantize as qz
from waste.kernels.quant import QMatrix, quantize
from waste.qformat import QMAX
from waste.reference import quant as ref

QFORMATS = ("q8g", "q4g")


def _assert_same_bytes(m: QMatrix, w: np.ndarray) -> None:
    """The fast quantiser's buffers are the oracle's, byte for byte (-0.0 != +0.0)."""
    with np.errstate(over="ignore"):  # float64 weights beyond the float16 range give inf scales
        want = ref.reference_quantize(w, m.fmt)
    assert list(m.buffers) == list(want)
    for name, b in want.items():
        got = m.buffers[name]
        assert got.dtype == b.dtype and got.shape == b.shape, name
        np.testing.assert_array_equal(got.view(np.uint8), b.view(np.uint8), err_msg=name)


def _scale_kinds(m: QMatrix) -> set[str]:
    bits = m.buffers["scales"].view(np.uint16) & 0x7FFF
    kinds = {"zero": bits == 0, "subnormal": (bits > 0) & (bits < 0x400), "inf": bits == 0x7C00,
             "normal": (bits >= 0x400) & (bits < 0x7C00)}
    return {k for k, v in kinds.items() if v.any()}


@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize(("N", "K"), [(37, 70), (16, 32), (50, 33), (3, 200), (1, 1)])
def test_quantiser_matches_reference(fmt: str, N: int, K: int) -> None:
    rng = np.random.default_rng(N * 1000 + K)
    G = -(-K // 32)
    # Group magnitudes over 2^-40 .. 2^2: groups more than 2^28 below the largest get subnormal
    # float16 scales, the smallest underflow to zero.
    scale = np.repeat(2.0 ** rng.integers(-40, 3, (N, G)), 32, axis=1)[:, :K]
    w = (rng.standard_normal((N, K)) * scale).astype(np.float32)
    w[N // 2, : min(K, 32)] = 0.0  # an all-zero group
    w[N // 3, 32:64] = -0.0  # q4g: its scale is -(-0.0) / 8 = +0.0, other zero groups' -0.0
    m = quantize(w, fmt)
    _assert_same_bytes(m, w)
    _assert_same_bytes(quantize(w.astype(np.float64), fmt), w.astype(np.float64))
    if N * K > 1000:
        assert {"zero", "subnormal", "normal"} <= _scale_kinds(m)


@pytest.mark.parametrize("fmt", QFORMATS)
def test_quantiser_ties_and_half_steps(fmt: str) -> None:
    rng = np.random.default_rng(11)
    N, K = 35, 96
    qmax = QMAX[fmt]
    # Each group: a step d (a float16 value times 2^-7) and its extreme weight on the grid, so the
    # stored scale is exactly d and weights (c + 1/2) d divide to exact halves.
    d = rng.uniform(0.5, 1.0, (N, 3, 1)).astype(np.float16).astype(np.float64) * 2.0**-7
    # Halves within the grid, so none clips (q4g also when its scale is negative).
    lo, hi = (-127, 126) if fmt == "q8g" else (-7, 6)
    w = (rng.integers(lo, hi, (N, 3, 32)) + 0.5) * d
    sign = rng.choice([-1.0, 1.0], (N, 3))
    first = rng.integers(0, 32, (N, 3))
    np.put_along_axis(w, first[..., None], (sign * qmax)[..., None] * d, axis=-1)
    if fmt == "q4g":
        # An exact tie in |w| with the opposite sign, after the first extreme: the first one wins.
        later = np.minimum(first + 1 + rng.integers(0, 8, (N, 3)), 31)
        tie = later > first
        vals = np.where(tie, -sign * qmax, np.take_along_axis(w, later[..., None], axis=-1)[..., 0] / d[..., 0])
        np.put_along_axis(w, later[..., None], (vals * d[..., 0])[..., None], axis=-1)
    w = w.reshape(N, K).astype(np.float32)
    assert np.array_equal(w, w.astype(np.float64).astype(np.float32))
    m = quantize(w, fmt)
    _assert_same_bytes(m, w)
    # The ties are real: the dequantised halves went to the even neighbour, both ways.
    codes = np.rint(m.dequantize().astype(np.float64).reshape(N, 3, 32) / d).astype(np.int64)
    halves = (w.astype(np.float64).reshape(N, 3, 32) / d) % 1 == 0.5
    assert halves.sum() > 1000 and np.all(codes[halves] % 2 == 0)
    if fmt == "q4g":
        assert np.sum(np.abs(w.reshape(N, 3, 32)) == (qmax * d)) > N * 3


@pytest.mark.parametrize("fmt", QFORMATS)
def test_quantiser_extreme_ranges_and_dtypes(fmt: str) -> None:
    rng = np.random.default_rng(12)
    # float64 beyond float32: tscale clamps at 2^127, so the largest groups' scales overflow to
    # inf (codes 0) while tiny groups underflow to zero.
    exponent = rng.choice([300, 40, 38, 34, 0, -300], (20, 3))  # scales inf, normal, subnormal, zero
    w = rng.standard_normal((20, 96)) * np.repeat(10.0**exponent, 32, axis=1)
    m = quantize(w, fmt)
    _assert_same_bytes(m, w)
    assert _scale_kinds(m) == {"inf", "normal", "subnormal", "zero"}
    # Subnormal float32 weights: tscale clamps at 2^-126.
    tiny = (rng.standard_normal((20, 40)) * 2.0**-140).astype(np.float32)
    _assert_same_bytes(quantize(tiny, fmt), tiny)
    _assert_same_bytes(quantize(np.zeros((17, 40), np.float32), fmt), np.zeros((17, 40), np.float32))
    _assert_same_bytes(quantize(np.zeros((0, 40), np.float32), fmt), np.zeros((0, 40), np.float32))
    # Other dtypes widen to float64; strided views are read as they are.
    v = (rng.standard_normal((33, 130)) * rng.uniform(0.01, 10, (33, 1))).astype(np.float32)
    for x in (v.astype(np.float16), v.astype(ml_dtypes.bfloat16), (v * 1000).astype(np.int16), v[:, ::2], v.T):
        _assert_same_bytes(quantize(x, fmt), x)


@pytest.mark.parametrize("fmt", QFORMATS)
def test_quantiser_streams_in_chunks(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(13)
    monkeypatch.setattr(qz, "QUANTIZE_BLOCKS", 2)  # 100 rows: 7 row blocks in chunks of 2
    w = rng.standard_normal((100, 70)).astype(np.float32)
    w[97, 5] = -40.0  # the largest |w|, setting tscale, in the last chunk
    _assert_same_bytes(quantize(w, fmt), w)
    w[99, 69] = np.inf
    with pytest.raises(WasteError, match="NaN or infinite"):
        quantize(w, fmt)


@kernel(fastmath=False)
def _f16_round_trip(x, bits, back):
    for i in range(x.size):
        bits[i] = qz._f16_bits(x[i])
        back[i] = qz._f16_value(bits[i])


def test_float16_conversion_matches_numpy() -> None:
    rng = np.random.default_rng(14)
    # Every finite half, the midpoints between neighbours (ties), one float64 ulp either side of
    # them, the overflow threshold (65520 rounds to inf), huge values and random doubles.
    halves = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    mids = (halves[:-1] + halves[1:]) / 2
    x = np.concatenate([halves, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf),
                        [65504.0, 65519.99, 65520.0, 65536.0, 1e300, np.inf, 2.0**-25, 2.0**-26, 3 * 2.0**-25],
                        rng.standard_normal(20000) * 2.0 ** rng.integers(-30, 20, 20000)])
    x = np.concatenate([x, -x])
    bits = np.full(x.size, 0x7E00, np.int64)  # a NaN half: never a result
    back = np.full(x.size, np.nan)
    _f16_round_trip(x, bits, back)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    np.testing.assert_array_equal(bits, want.view(np.uint16).astype(np.int64))
    np.testing.assert_array_equal(back.view(np.int64), want.astype(np.float64).view(np.int64))
