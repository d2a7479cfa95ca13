"""Test scaffolding shared across tests/: closeness checks and an in-memory fake container.

Test modules import these by name (`from conftest import FakeContainer`; pyproject's pytest
`pythonpath` puts tests/ on the path). Each tolerance stays with the test that uses it, next
to the reasoning behind it; these helpers only measure.
"""

from __future__ import annotations

import numpy as np

from waste.config import ModelConfig
from waste.container.format import a_log_shape, expected_expert_tensors, expected_tensors
from waste.kernels.quant import QMatrix, quantize


def max_abs_diff(fast: np.ndarray, exact: np.ndarray) -> float:
    """Largest |fast - exact| in float64; fails first if `fast` holds a NaN or an infinity
    (kernels write into NaN-filled buffers, so an unwritten element shows up here)."""
    assert np.all(np.isfinite(fast))
    return float(np.max(np.abs(np.asarray(fast, np.float64) - exact)))


def max_rel_err(fast: np.ndarray, exact: np.ndarray) -> float:
    """Largest |fast - exact| over the largest |exact| (the error relative to the array's scale)."""
    return float(np.max(np.abs(np.asarray(fast, np.float64) - exact)) / max(np.max(np.abs(exact)), 1e-300))


def assert_close(fast: np.ndarray, exact: np.ndarray, rtol: float, what: str = "") -> None:
    """max |fast - exact| <= rtol * max |exact|, with every element of `fast` finite."""
    assert np.all(np.isfinite(fast)), what
    err, scale = float(np.max(np.abs(fast - exact))), float(np.max(np.abs(exact)))
    assert err <= rtol * scale, f"{what}: max abs error {err:.3g} vs scale {scale:.3g}"


class FakeContainer:
    """The container interface (.config, .tensor, .matrix, .expert, .has) over random float32 weights."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, fmt: str = "f32"):
        rng = np.random.default_rng(seed)
        self.config = cfg
        self.fmt = fmt
        self.arrays: dict[str, np.ndarray] = {}
        for name, shape in expected_tensors(cfg).items():
            if name.endswith("A_log"):
                a = np.zeros(a_log_shape(cfg)).reshape(-1)
                a[: cfg.kda_num_heads] = np.log(rng.uniform(1, 16, cfg.kda_num_heads))
                value = a.reshape(a_log_shape(cfg))
            elif "norm" in name:
                value = 1 + 0.1 * rng.standard_normal(shape)
            elif len(shape) == 2:
                value = rng.standard_normal(shape) / np.sqrt(shape[1])
            else:
                value = 0.5 * rng.standard_normal(shape)
            self.arrays[name] = value.astype(np.float32)
        self.experts = {
            (layer, e): tuple(
                (rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32)
                for s in expected_expert_tensors(cfg).values()
            )
            for layer in cfg.moe_layers
            for e in range(cfg.num_experts)
        }

    def has(self, name: str) -> bool:
        return name in self.arrays

    def tensor(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def matrix(self, name: str) -> QMatrix:
        return quantize(self.arrays[name], self.fmt)

    def expert(self, layer: int, e: int) -> tuple[QMatrix, QMatrix, QMatrix]:
        w1, w3, w2 = self.experts[layer, e]
        return quantize(w1, self.fmt), quantize(w3, self.fmt), quantize(w2, self.fmt)
