"""The sampler: greedy at temperature 0, top-p keeping the smallest prefix that reaches p."""

from __future__ import annotations

import numpy as np

from waste.engine.sampling import Sampler


def test_top_p_keeps_the_smallest_prefix_reaching_it() -> None:
    logits = np.array([3.0, 0.0, 0.0, 0.0], np.float32)  # probabilities 0.87, then 0.043 three times
    sampler = Sampler(1.0, top_p=0.5, seed=0)
    assert {sampler(logits) for _ in range(300)} == {0}
    sampler = Sampler(1.0, top_p=0.9, seed=0)
    assert {sampler(logits) for _ in range(300)} == {0, 1}  # 0.87 < 0.9: the next (in a stable order) joins
