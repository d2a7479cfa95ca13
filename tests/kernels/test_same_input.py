"""Several products of one input in one call: bit for bit one matmul each."""

from __future__ import annotations

import numpy as np
import pytest

from waste.errors import WasteError
from waste.kernels.dense_batch import DenseBatch
from waste.kernels.qbatch import QBatch
from waste.kernels.quant import quantize
from waste.kernels.same_input import SameInput

# (formats of the matrices, the batch they run through: None for one matmul each)
CASES = [
    (("q8g", "q8g", "q8g", "q8g"), QBatch),
    (("q4g", "q4g", "q8g", "q4g"), QBatch),
    (("mxfp4", "mxfp4", "q8g", "mxfp4"), QBatch),
    (("f32", "f32", "f32", "f32"), DenseBatch),
    (("bf16", "bf16", "bf16", "bf16"), DenseBatch),
    (("bf16", "f32", "q8g", "bf16"), None),
]


@pytest.mark.parametrize(("formats", "batch"), CASES)
@pytest.mark.parametrize("tokens", [1, 6, 37])
def test_same_input_products_equal_one_matmul_each(formats, batch, tokens) -> None:
    rng = np.random.default_rng(tokens)
    k = 96
    # KDA's mix of widths: wide projections, a narrow one (b: 8 rows), one not a multiple of 16
    matrices = [quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.1, fmt)
                for n, fmt in zip((64, 64, 8, 40), formats, strict=True)]
    products = SameInput(matrices)
    assert (products.batch is None) if batch is None else isinstance(products.batch, batch)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    x[0, :3] = [1e-30, -3e4, 0.0]  # a tiny input, a large one
    for y, m in zip(products(x), matrices, strict=True):
        assert y.flags.c_contiguous and y.shape == (tokens, m.shape[0])
        np.testing.assert_array_equal(y, m.matmul(x))


def test_same_input_refuses_the_wrong_width() -> None:
    m = quantize(np.ones((16, 64), np.float32), "bf16")
    with pytest.raises(WasteError, match=r"products of width 64 take \[T, 64\] inputs, got \(3, 32\)"):
        SameInput([m, m])(np.ones((3, 32), np.float32))
