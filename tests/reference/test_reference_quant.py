"""The quantisation oracle on hand-built buffers, so the byte layout it decodes is pinned
independently of the fast code that writes it (docs/QUANT.md, "Byte layout")."""

from __future__ import annotations

import numpy as np
import pytest

from waste.kernels.quant import from_buffers
from waste.reference.quant import reference_dequantize, reference_matvec, reference_quantize_activation


def _buffers(qs: np.ndarray, scale: float, tscale: float) -> dict[str, np.ndarray]:
    return {"qs": qs, "scales": np.full((1, 1, 16), scale, np.float16), "tscale": np.array([tscale], np.float32)}


def test_q8g_byte_positions() -> None:
    # Byte 64c + 4r + i holds the code of row r, input 4c + i.
    qs = np.zeros((1, 1, 512), np.int8)
    qs[0, 0, 64 * 2 + 4 * 5 + 3] = 7  # row 5, input 11
    qs[0, 0, 64 * 7 + 4 * 15 + 0] = -127  # row 15, input 28
    w = reference_dequantize(from_buffers("q8g", (16, 32), _buffers(qs, 0.5, 0.25)))
    expected = np.zeros((16, 32))
    expected[5, 11] = 7 * 0.125
    expected[15, 28] = -127 * 0.125
    np.testing.assert_array_equal(w, expected)


def test_q4g_nibbles() -> None:
    # Low nibble: input 4c + i; high nibble: input 16 + 4c + i; value (code - 8) * scale.
    qs = np.full((1, 1, 256), 0x88, np.uint8)  # code 8 everywhere: zero
    qs[0, 0, 64 * 1 + 4 * 2 + 1] = 0x0F | (0x0 << 4)  # row 2: input 5 -> +7, input 21 -> -8
    w = reference_dequantize(from_buffers("q4g", (3, 20), _buffers(qs, -2.0, 1.0)))
    expected = np.zeros((3, 20))
    expected[2, 5] = 7 * -2.0  # input 21 is padding beyond K = 20
    np.testing.assert_array_equal(w, expected)
    qs[0, 0, 64 * 1 + 4 * 2 + 1] = 0x0 | (0x0 << 4)
    w = reference_dequantize(from_buffers("q4g", (3, 32), _buffers(qs, -2.0, 1.0)))
    assert w[2, 5] == 16.0 and w[2, 21] == 16.0 and np.count_nonzero(w) == 2


def test_activation_codes_by_hand() -> None:
    x = np.array([[0.5, -1.0, 0.25, 0.0] + [0.0] * 28 + [3.0, np.nan]], np.float32)
    codes, scales = reference_quantize_activation(x)
    assert codes.shape == (1, 2, 32) and scales.shape == (1, 2)
    # 127 / 1.0 = 127: 0.5 -> 63.5 rounds half to even -> 64; 0.25 -> 31.75 -> 32.
    np.testing.assert_array_equal(codes[0, 0, :4], [64, -127, 32, 0])
    assert scales[0, 0] == np.float32(1.0) / np.float32(127.0)
    assert np.isnan(scales[0, 1]) and not codes[0, 1].any()


def test_matvec_from_integers() -> None:
    qs = np.zeros((1, 1, 512), np.int8)
    qs[0, 0, 4 * 0 + 0] = 2  # row 0, input 0
    qs[0, 0, 4 * 1 + 1] = -3  # row 1, input 1
    m = from_buffers("q8g", (2, 2), _buffers(qs, 1.0, 1.0))
    x = np.array([127.0, 254.0], np.float32)  # one group: scale 2, codes 64 (63.5 -> even) and 127
    np.testing.assert_array_equal(reference_matvec(m, x), [2 * 64 * 2.0, -3 * 127 * 2.0])


def test_bf16_bits_by_hand() -> None:
    # bfloat16 0x3FC0 is 1.5 and 0xC000 is -2: the top half of the float32 bit pattern.
    m = from_buffers("bf16", (1, 2), {"w": np.array([[0x3FC0, 0xC000]], np.uint16)})
    np.testing.assert_array_equal(reference_dequantize(m), [[1.5, -2.0]])


def test_rows_are_the_embedding_lookup() -> None:
    rng = np.random.default_rng(3)
    qs = rng.integers(-127, 128, (3, 2, 512)).astype(np.int8)
    scales = rng.uniform(0.5, 2.0, (3, 2, 16)).astype(np.float16)
    m = from_buffers("q8g", (40, 50), {"qs": qs, "scales": scales, "tscale": np.array([0.125], np.float32)})
    full = reference_dequantize(m)
    ids = np.array([39, 0, 17, 17, 5])
    np.testing.assert_array_equal(reference_dequantize(m, rows=ids), full[ids])
    with pytest.raises(ValueError, match="row ids"):
        reference_dequantize(m, rows=np.array([40]))


def test_reference_dequantize_reads_mxfp4_buffers():
    """FACTS.md's byte example: [0.5, -1.5, 3, -6] at scale byte 127 are bytes b1 f5; scale byte
    128 doubles a row. Rows can be taken alone, as for the other formats."""
    from types import SimpleNamespace

    packed = np.zeros((2, 16), np.uint8)
    packed[:, :2] = [0xB1, 0xF5]
    scales = np.array([[127], [128]], np.uint8)
    qm = SimpleNamespace(fmt="mxfp4", shape=(2, 32), buffers={"packed": packed, "scales": scales})
    w = reference_dequantize(qm)
    assert w.dtype == np.float64 and w.shape == (2, 32)
    np.testing.assert_array_equal(w[0, :4], [0.5, -1.5, 3.0, -6.0])
    np.testing.assert_array_equal(w[1, :4], [1.0, -3.0, 6.0, -12.0])
    assert not w[:, 4:].any()
    np.testing.assert_array_equal(reference_dequantize(qm, rows=np.array([1])), w[1:])


def test_round_activation_int8_is_the_codes_times_their_scales():
    """The rounding model's int8 rounding gives the values reference_quantize_activation's codes
    and scales stand for, NaN where a group is not finite, and leaves K unpadded."""
    from waste.reference.quant import RoundedInputWeights, reference_round_activation_int8

    rng = np.random.default_rng(3)
    X = (rng.standard_normal((4, 70)) * rng.uniform(0.01, 100, (4, 1))).astype(np.float32)
    X[1, 40] = np.nan
    codes, scales = reference_quantize_activation(X)
    want = (codes * scales[..., None]).reshape(4, -1)[:, :70]
    got = reference_round_activation_int8(X)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[1, 32:64]).all() and np.isfinite(got[1, :32]).all()
    assert 0 < np.abs(got[0] - X[0]).max() <= np.abs(X[0]).max() / 127 / 2 * 1.0001
    w = rng.standard_normal((5, 70))
    rounded = RoundedInputWeights(w, "q8g")
    np.testing.assert_array_equal(X[2:] @ rounded.T, got[2:] @ w.T)
    assert np.asarray(rounded) is w
