"""MXFP4 matrices: codec, QMatrix format and products against the float64 oracle.

Tolerances: products against the oracle 1e-6 of the output scale (max |reference|), as for
q8g/q4g: each group's integer dot is exact and the E8M0 scale a power of two, so what
remains is the float32 scaling and sum over K/32 groups. Dequantised weights are exact (an
E2M1 value times a power of two), so they are compared for equality.
"""

from __future__ import annotations

import numpy as np
import pytest

from waste.errors import WasteError
from waste.kernels import mxfp4 as mx
from waste.kernels.quant import from_buffers, matmul_pair, mxfp4_interleaved, quantize
from waste.qformat import bits_per_weight, buffer_layout
from waste.reference import mxfp4 as ref
from waste.reference.quant import reference_dequantize, reference_matmul


def _rel(fast: np.ndarray, exact: np.ndarray) -> float:
    return float(np.abs(fast - exact).max() / max(np.abs(exact).max(), 1e-300))


def _weights(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Gaussian rows of very different sizes, with some all-zero groups and exact grid points."""
    w = rng.standard_normal((n, k)) * np.exp2(rng.integers(-40, 40, (n, 1)))
    w[0, :32] = 0.0
    w[-1, :32] = 0.0
    w[-1, :8] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]  # halfway cases (scale byte 127)
    return w.astype(np.float32)


def test_facts_byte_example() -> None:
    # FACTS.md: [0.5, -1.5, 3, -6] at scale byte 127 pack to b1 f5. By hand: 0.5 is magnitude
    # index 1, -1.5 index 3 with the sign bit (0xb), 3 index 5, -6 index 7 with the sign (0xf);
    # the largest |w| = 6 = 1.5 * 2^2 gives exponent 2 - 2 = 0, byte 127.
    w = np.zeros((1, 32), np.float32)
    w[0, :4] = [0.5, -1.5, 3.0, -6.0]
    packed, scales = mx.quantize_mxfp4(w)
    assert packed[0, :2].tobytes() == bytes([0xB1, 0xF5]) and not packed[0, 2:].any()
    assert scales.tolist() == [[127]]
    m = from_buffers("mxfp4", (1, 32), {"packed": packed, "scales": scales})
    np.testing.assert_array_equal(m.dequantize()[0, :4], [0.5, -1.5, 3.0, -6.0])
    np.testing.assert_array_equal(ref.reference_dequantize_mxfp4(packed, scales), w)


def test_scale_rule_and_ties_by_hand() -> None:
    w = np.zeros((4, 32), np.float32)
    # Largest |w| 6.9 < 1.75 * 4: byte 127, and 6.9 clips to 6.
    w[0, :2] = [6.9, -0.2]
    # Largest 7 = 1.75 * 4: rounded up to 8, byte 128 (scale 2); 7 / 2 = 3.5 ties to 4 (even).
    w[1, :2] = [7.0, 0.5]
    # Scale 2^-3 (byte 124, largest 0.5 = 4 * 2^-3); ties at 0.25 * 2^-3 -> 0 and 0.75 * 2^-3 -> 1.
    w[2, :3] = [0.5, 0.25 / 8, -0.75 / 8]
    packed, scales = mx.quantize_mxfp4(w)
    assert scales[:, 0].tolist() == [127, 128, 124, 0]  # an all-zero group: byte 0
    dq = mx.dequantize_mxfp4(packed, scales)
    np.testing.assert_array_equal(dq[0, :2], [6.0, -0.0])
    np.testing.assert_array_equal(dq[1, :2], [8.0, 0.0])
    np.testing.assert_array_equal(dq[2, :3], [0.5, 0.0, -1.0 / 8])
    assert packed[0, 0] == 0x07  # -0.2 rounds to zero: nibble 0, no negative zero


def test_quantiser_matches_reference_byte_for_byte() -> None:
    rng = np.random.default_rng(0)
    w = _weights(rng, 40, 96)
    w[2, 40:50] = np.float32(1e-40)  # subnormal float32 weights: the byte clamps to 0
    w[3, 64:] = np.float32(1.5e38)  # near float32's largest (from 2^127 * 1.75 a value would round to 2^128)
    packed, scales = mx.quantize_mxfp4(w)
    rpacked, rscales = ref.reference_quantize_mxfp4(w)
    np.testing.assert_array_equal(scales, rscales)
    np.testing.assert_array_equal(packed, rpacked)
    # Quantising the dequantised weights again changes nothing.
    again = mx.quantize_mxfp4(mx.dequantize_mxfp4(packed, scales))
    np.testing.assert_array_equal(again[0], packed)
    np.testing.assert_array_equal(again[1], scales)


def test_every_nibble_and_scale_decodes_as_the_spec() -> None:
    # All 256 bytes in one row, every scale byte (255 is NaN).
    packed = np.tile(np.arange(256, dtype=np.uint8), (256, 1))  # [256, 256]: K = 512
    scales = np.tile(np.arange(256, dtype=np.uint8)[:, None], (1, 16))
    m = from_buffers("mxfp4", (256, 512), {"packed": packed, "scales": scales})
    exact = ref.reference_dequantize_mxfp4(packed, scales)
    with np.errstate(over="ignore"):
        exact = exact.astype(np.float32)  # 6 * 2^127 and more: inf
    np.testing.assert_array_equal(m.dequantize(), exact)
    assert np.isnan(m.dequantize()[255]).all() and not np.isnan(m.dequantize()[:255]).any()


def test_layout_bits_and_bad_shapes() -> None:
    assert bits_per_weight("mxfp4", (3072, 3584)) == 4.25
    assert buffer_layout("mxfp4", (5, 64)) == [("packed", np.dtype(np.uint8), (5, 32)),
                                               ("scales", np.dtype(np.uint8), (5, 2))]
    with pytest.raises(WasteError, match="multiple of 32"):
        buffer_layout("mxfp4", (5, 70))
    with pytest.raises(WasteError, match="multiple of 32"):
        quantize(np.ones((2, 40)), "mxfp4")
    with pytest.raises(WasteError, match="finite"):
        quantize(np.full((2, 32), np.inf), "mxfp4")
    m = quantize(np.ones((3, 64)), "mxfp4")
    with pytest.raises(WasteError, match="packed"):
        from_buffers("mxfp4", (3, 64), {**m.buffers, "packed": m.buffers["packed"][:, :-1]})
    with pytest.raises(WasteError, match="scales"):
        from_buffers("mxfp4", (3, 64), {"packed": m.buffers["packed"]})
    with pytest.raises(WasteError, match=r"\[T, 64\]"):
        m.matmul(np.ones((2, 63), np.float32))
    with pytest.raises(WasteError, match="out of range"):
        m.take_rows(np.array([3]))


@pytest.mark.parametrize(("N", "K", "T"), [(37, 64, 9), (16, 32, 1), (1, 96, 4), (96, 320, 13), (20, 64, 33)])
def test_product_matches_reference(N: int, K: int, T: int) -> None:
    rng = np.random.default_rng(N * 1000 + K + T)
    m = quantize(_weights(rng, N, K), "mxfp4")
    X = (rng.standard_normal((T, K)) * rng.uniform(0.1, 10.0, (T, 1))).astype(np.float32)
    Y = m.matmul(X)
    exact = reference_matmul(m, X)
    assert Y.shape == (T, N) and Y.dtype == np.float32 and Y.flags.c_contiguous
    for n in range(N):  # rows differ in size by up to 2^80: compare each on its own scale
        assert _rel(Y[:, n], exact[:, n]) <= 1e-6
    for t in range(T):
        y = m.matvec(X[t])
        np.testing.assert_array_equal(y, Y[t])  # one token and a chunk: the same arithmetic
        np.testing.assert_array_equal(y, m.matmul(X[t:t + 1])[0])


def test_matmul_pair_equals_two_products() -> None:
    rng = np.random.default_rng(31)
    a, b = (quantize(_weights(rng, 40, 96), "mxfp4") for _ in range(2))
    for T in (1, 7):
        X = rng.standard_normal((T, 96)).astype(np.float32)
        ya, yb = matmul_pair(X, a, b)
        np.testing.assert_array_equal(ya, a.matmul(X))
        np.testing.assert_array_equal(yb, b.matmul(X))


def test_repacked_at_the_first_product_or_when_prepared() -> None:
    """The kernels' repacked copy is made at the first product (or `prepare`), once: a matrix only
    stored (convert, synth) or dequantised never makes it."""
    rng = np.random.default_rng(33)
    w = _weights(rng, 40, 96)
    m = quantize(w, "mxfp4")
    assert "_qargs" not in vars(m)
    m.dequantize()
    m.take_rows(np.array([3]))
    assert "_qargs" not in vars(m)
    x = rng.standard_normal(96).astype(np.float32)
    y = m.matvec(x)
    copy = vars(m)["_qargs"][0]
    np.testing.assert_array_equal(m.matvec(x), y)
    assert vars(m)["_qargs"][0] is copy  # not repacked again
    prepared = from_buffers("mxfp4", m.shape, dict(m.buffers))
    assert prepared.prepare() is prepared and "_qrow" in vars(prepared)
    np.testing.assert_array_equal(prepared.matvec(x), y)


def test_dequantize_take_rows_and_edges() -> None:
    rng = np.random.default_rng(5)
    w = _weights(rng, 37, 96)
    m = quantize(w, "mxfp4")
    dq = m.dequantize()
    assert dq.shape == (37, 96) and dq.dtype == np.float32
    np.testing.assert_array_equal(dq, ref.reference_dequantize_mxfp4(m.buffers["packed"], m.buffers["scales"]))
    np.testing.assert_array_equal(reference_dequantize(m, np.array([3, 1])), dq[[3, 1]])
    ids = np.array([36, 0, 17, 17, 5])
    np.testing.assert_array_equal(m.take_rows(ids), dq[ids])
    assert m.take_rows(np.array([], np.int64)).shape == (0, 96)
    # Every weight within half a step of its group's grid, except clipping above 6 units.
    err = np.abs(dq.astype(np.float64) - w).reshape(37, 3, 32)
    unit = np.exp2(m.buffers["scales"].astype(np.float64) - 127)[..., None]
    assert np.all(err <= np.maximum(0.5, np.abs(w.reshape(37, 3, 32)) / unit - 6) * 2 * unit)
    # Zero rows and zero tokens.
    e = quantize(np.zeros((0, 64), np.float32), "mxfp4")
    assert e.matvec(np.ones(64, np.float32)).shape == (0,) and e.matmul(np.ones((3, 64))).shape == (3, 0)
    assert m.matmul(np.zeros((0, 96), np.float32)).shape == (0, 37)
    z = quantize(np.zeros((3, 64), np.float32), "mxfp4")
    assert not z.matvec(np.ones(64, np.float32)).any()


def test_nan_scale_and_nan_activation_reach_the_output() -> None:
    rng = np.random.default_rng(9)
    m = quantize(rng.standard_normal((20, 64)), "mxfp4")
    x = rng.standard_normal(64).astype(np.float32)
    scales = m.buffers["scales"].copy()
    scales[4, 1] = 255
    bad = from_buffers("mxfp4", (20, 64), {"packed": m.buffers["packed"], "scales": scales})
    y = bad.matvec(x)
    assert np.isnan(y[4]) and not np.isnan(np.delete(y, 4)).any()
    x[3] = np.nan
    assert np.isnan(m.matvec(x)).all()


@pytest.mark.parametrize(("N", "K"), [(48, 96), (40, 64)])
def test_the_interleave_held_as_the_matrix(N: int, K: int) -> None:
    """An MXFP4 matrix given in the kernels' interleave (as the streaming store holds it) multiplies,
    dequantises and takes rows as the stored one does; `stored_rows` undoes `repack_blocks` (rows
    past N padded with zeros), and the serial repack equals the parallel one."""
    rng = np.random.default_rng(35)
    stored = quantize(_weights(rng, N, K), "mxfp4")
    qs, scales = stored._qargs[:2]
    serial_qs, serial_scales = np.full_like(qs, 7), np.full_like(scales, 7)
    mx.repack_blocks(stored.buffers["packed"], stored.buffers["scales"], serial_qs, serial_scales, 0, qs.shape[0])
    np.testing.assert_array_equal(serial_qs, qs)
    np.testing.assert_array_equal(serial_scales, scales)
    ids = np.array([N - 1, 0, 17, 17])
    packed, row_scales = mx.stored_rows(qs, scales, ids)
    np.testing.assert_array_equal(packed, stored.buffers["packed"][ids])
    np.testing.assert_array_equal(row_scales, stored.buffers["scales"][ids])
    held = mxfp4_interleaved(stored.shape, {"qs": qs.copy(), "scales": scales.copy()})
    X = rng.standard_normal((5, K)).astype(np.float32)
    np.testing.assert_array_equal(held.matmul(X), stored.matmul(X))
    np.testing.assert_array_equal(held.matvec(X[0]), stored.matvec(X[0]))
    np.testing.assert_array_equal(held.dequantize(), stored.dequantize())
    np.testing.assert_array_equal(held.take_rows(ids), stored.take_rows(ids))
    with pytest.raises(WasteError, match="buffer 'qs' must be uint8"):
        mxfp4_interleaved(stored.shape, {"qs": qs[:-1], "scales": scales})
