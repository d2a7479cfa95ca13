"""RMSNorm and the finiteness check against float64 NumPy (waste.reference.mla.rms_norm).

Tolerance: one float32 sum of D squares, a root and two products per value: 1e-6 relative
covers the sum's rounding (about sqrt(D) ulps) with room.
"""

from __future__ import annotations

import numpy as np
import pytest

from waste.errors import WasteError
from waste.kernels.norm import add_check_norm, all_finite, rms_norm
from waste.reference.mla import rms_norm as reference_rms_norm


@pytest.mark.parametrize("T, D", [(1, 1024), (3, 7), (200, 288)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
def test_rms_norm_matches_reference(T: int, D: int, scale: float) -> None:
    rng = np.random.default_rng(T * D)
    x = (rng.standard_normal((T, D)) * scale).astype(np.float32)
    x[0, 0] *= 100  # one outlier dominates its row's mean square
    w = rng.uniform(-2, 2, D).astype(np.float32)
    got = rms_norm(x, w, 1e-6)
    want = reference_rms_norm(x, w, 1e-6)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_rms_norm_row_does_not_depend_on_its_chunk() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((130, 256)).astype(np.float32)  # past SERIAL_ROWS: the parallel loop
    w = rng.standard_normal(256).astype(np.float32)
    whole = rms_norm(x, w, 1e-5)
    for t in (0, 64, 129):
        np.testing.assert_array_equal(rms_norm(x[t:t + 1], w, 1e-5), whole[t:t + 1])


def test_rms_norm_refuses_mismatched_weight() -> None:
    with pytest.raises(WasteError, match="RMSNorm"):
        rms_norm(np.ones((2, 8), np.float32), np.ones(7, np.float32), 1e-6)


def test_all_finite_finds_every_non_finite_value() -> None:
    x = np.full((4, 33), 3e38, np.float32)  # a sum of these would overflow; every value is finite
    assert all_finite(x)
    assert all_finite(np.zeros((0, 5), np.float32))
    for bad in (np.nan, np.inf, -np.inf):
        for where in ((0, 0), (3, 32), (2, 17)):
            y = x.copy()
            y[where] = bad
            assert not all_finite(y)
            assert all_finite(y[:, ::2]) == (where[1] % 2 == 1)  # a view holds the even columns only


@pytest.mark.parametrize("T, D", [(1, 1024), (3, 7), (130, 288)])  # 130: past SERIAL_ROWS
def test_add_check_norm_is_adding_checking_and_normalising(T: int, D: int) -> None:
    """The fused residual step gives the bits of h + delta and of rms_norm over that sum, and
    refuses a delta with a NaN or an infinity anywhere (a NaN already in h is not its concern,
    as check_finite looks at the layer's output only)."""
    rng = np.random.default_rng(T + D)
    h = (rng.standard_normal((T, D)) * 3).astype(np.float32)
    delta = (rng.standard_normal((T, D)) * rng.choice([1e-3, 1.0, 1e3], (T, 1))).astype(np.float32)
    w = rng.uniform(-2, 2, D).astype(np.float32)
    done = add_check_norm(h, delta, w, 1e-6)
    assert done is not None
    added, normed = done
    np.testing.assert_array_equal(added, h + delta)
    np.testing.assert_array_equal(normed, rms_norm(h + delta, w, 1e-6))
    for bad in (np.nan, np.inf, -np.inf):
        for where in ((0, 0), (T - 1, D - 1), (T // 2, D // 3)):
            d = delta.copy()
            d[where] = bad
            assert add_check_norm(h, d, w, 1e-6) is None
    h_nan = h.copy()
    h_nan[0, 0] = np.nan
    assert add_check_norm(h_nan, delta, w, 1e-6) is not None
