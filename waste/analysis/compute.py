"""What a decode step computes, timed on the container's own model: the term `waste plan`'s decode
estimate puts beside the disk's time (`waste.analysis.budget.RunPrediction`).

The bandwidth bound (`decode_speed_bound`) leaves compute out and reads RAM at the speed of one
large matvec. A real step reaches less: many small products, the parallel regions between them,
routing, norms and the Python between the kernels. On the 48B q4 model on a 2-core VM the bound
said 9.8 tok/s where the streaming store decoded at 4.6 (README, 2026-12-04). So the step is
measured instead: a few decode steps of the model after a short prompt, with its experts served
by `PooledExpertStore` (expert e of a layer by expert e mod pool), so that every expert a step
asks for is in RAM and the step reads about as many expert bytes from RAM as a real one, without the
disk and on a machine that cannot hold every expert.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from waste.engine.expert_store import PooledExpertStore

# Decode steps timed (their median is the step), after WARM_STEPS untimed ones that fault the
# pool's blobs in and settle the caches.
DECODE_COMPUTE_STEPS = 8
WARM_STEPS = 2
# The prompt before the steps (token ids; what a step computes does not depend on them).
PROMPT = (0, 1, 2, 3)


@dataclass(frozen=True)
class DecodeCompute:
    """A decode step's compute, timed with every expert it asks for in RAM."""

    step_seconds: float  # the median of the timed steps
    steps: int
    pool: int  # experts each MoE layer serves from
    pool_bytes: int  # their blobs, over every MoE layer

    def as_dict(self) -> dict[str, Any]:
        return {"step_seconds": self.step_seconds, "steps": self.steps, "pool": self.pool,
                "pool_bytes": self.pool_bytes}


def measure_decode_compute(model: Any, steps: int = DECODE_COMPUTE_STEPS) -> DecodeCompute:
    """Time `steps` decode steps of `model` (a `waste.engine.model.Model`) with its experts pooled
    (top-k + 1 of them a layer: a step's top-k are distinct, and the pool's slots are then not all
    the same ones from step to step). The model gets its own store back afterwards, and its layer
    times start afresh."""
    from waste.engine.model import LayerTimes

    cfg = model.config
    pool = cfg.num_experts_per_token + 1 if cfg.moe_layers else 1
    store = PooledExpertStore(model.container, pool)
    own = model.store
    model.store = store
    try:
        session = model.new_session(len(PROMPT) + WARM_STEPS + steps)
        model.prefill(session, list(PROMPT), all_logits=False)
        seconds = []
        for i in range(WARM_STEPS + steps):
            t0 = time.perf_counter()
            model.decode(session, PROMPT[i % len(PROMPT)])
            seconds.append(time.perf_counter() - t0)
    finally:
        model.store = own
        store.close()
        model.times = LayerTimes()
    pool_bytes = sum(model.container.expert_span(layer, e)[1] for layer in cfg.moe_layers
                     for e in range(store.pool))
    return DecodeCompute(float(np.median(seconds[WARM_STEPS:])), steps, store.pool, int(pool_bytes))
