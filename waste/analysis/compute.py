"""What a decode step computes, timed on the container's own model: the term `waste plan`'s decode
estimate puts beside the disk's time (`waste.analysis.budget.RunPrediction`).

The bandwidth bound (`decode_speed_bound`) leaves compute out and reads RAM at the speed of one
large matvec. A real step reaches less: many small products, the parallel regions between them,
routing, norms and the Python between the kernels. On the 48B q4 model on a 2-core VM the bound
said 9.8 tok/s where the streaming store decoded at 4.6 (docs/MEASURED.md, 2026-12-04). So the step is
measured instead: a few decode steps of the model after a short prompt, with its experts served
by `PooledExpertStore` (expert e of a layer by expert e mod pool), so that every expert a step
asks for is in RAM and the step reads about as many expert bytes from RAM as a real one, without
the disk and on a machine that cannot hold every expert.

The disk's part is timed as a step reads it too: random expert blobs of a layer at a time, read
by a `StreamingExpertStore` (its default readers and io, CRCs checked) into reused buffers. On the
48B's virtual disk such reads ran at 1.14-1.65 GB/s where one long sequential read (what `waste
plan`'s disk bandwidth measures) ran at 1.26-2.30 (docs/MEASURED.md, 2026-12-05). The measured
steps guess the next MoE layers' experts as a streaming decode does (routing them costs the step
its time), and the pool counts the guesses their layer did not ask for: a streaming store reads
those that are not cached for nothing (the 48B's decode from disk, 2026-12-05: 30 MB of its 208 MB
read a token).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from waste.engine.expert_store import PooledExpertStore
from waste.engine.experts import StreamingExpertStore

# Decode steps timed (their median is the step), after WARM_STEPS untimed ones that fault the
# pool's blobs in and settle the caches.
DECODE_COMPUTE_STEPS = 8
WARM_STEPS = 2
# The prompt before the steps (token ids; what a step computes does not depend on them).
PROMPT = (0, 1, 2, 3)
# Layers of top-k random expert blobs read to time the disk, after one untimed layer whose reads
# fault their buffers in (later ones reuse them, as a decode's reads reuse evicted buffers).
BLOB_LAYERS = 8


@dataclass(frozen=True)
class DecodeCompute:
    """A decode step's compute, timed with every expert it asks for in RAM, and the speed of the
    store's reads of random expert blobs (what the step's misses would read at)."""

    step_seconds: float  # the median of the timed steps
    steps: int
    pool: int  # experts each MoE layer serves from
    pool_bytes: int  # their blobs, over every MoE layer
    blob_gbps: float | None = None  # random expert blobs read as the store reads them (None: no MoE layer)
    blob_bytes: int = 0  # what that read
    # Experts a step guessed (the next MoE layers' reads ahead) that their layer did not ask for,
    # per step: a streaming store reads each that is not cached for nothing.
    unused_guesses: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"step_seconds": self.step_seconds, "steps": self.steps, "pool": self.pool,
                "pool_bytes": self.pool_bytes, "blob_gbps": self.blob_gbps, "blob_bytes": self.blob_bytes,
                "unused_guesses": self.unused_guesses}


def measure_blob_reads(container: Any, layers: int = BLOB_LAYERS, seed: int = 0) -> tuple[float, int]:
    """(GB/s, bytes) of `layers` requests of top-k random expert blobs each, read by a streaming
    store that caches nothing (a decode step's misses), after one untimed request."""
    cfg = container.config
    rng = np.random.default_rng(seed)
    seconds, nbytes = 0.0, 0
    with StreamingExpertStore(container, 0) as store:
        for i in range(layers + 1):
            layer = cfg.moe_layers[i % len(cfg.moe_layers)]
            ids = np.sort(rng.choice(cfg.num_experts, cfg.num_experts_per_token, replace=False))
            t0 = time.perf_counter()
            experts = store.get(layer, ids)
            if i:
                seconds += time.perf_counter() - t0
                nbytes += sum(container.expert_span(layer, int(e))[1] for e in ids)
            del experts  # their buffers go back to the store for the next request
    return nbytes / seconds / 1e9, nbytes


def measure_decode_compute(model: Any, steps: int = DECODE_COMPUTE_STEPS) -> DecodeCompute:
    """Time `steps` decode steps of `model` (a `waste.engine.model.Model`) with its experts pooled
    (top-k + 1 of them a layer: a step's top-k are distinct, and the pool's slots are then not all
    the same ones from step to step), then the store's reads of random blobs
    (`measure_blob_reads`). The model gets its own store back afterwards, and its layer times
    start afresh."""
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
        unused_before = 0  # the unused guesses of the untimed steps
        for i in range(WARM_STEPS + steps):
            if i == WARM_STEPS:
                unused_before = store.unused_guesses
            t0 = time.perf_counter()
            model.decode(session, PROMPT[i % len(PROMPT)])
            seconds.append(time.perf_counter() - t0)
        unused = (store.unused_guesses - unused_before) / max(1, steps)
    finally:
        model.store = own
        store.close()
        model.times = LayerTimes()
    pool_bytes = sum(model.container.expert_span(layer, e)[1] for layer in cfg.moe_layers
                     for e in range(store.pool))
    blob_gbps, blob_bytes = measure_blob_reads(model.container) if cfg.moe_layers else (None, 0)
    return DecodeCompute(float(np.median(seconds[WARM_STEPS:])), steps, store.pool, int(pool_bytes), blob_gbps,
                         blob_bytes, unused)
