"""Summaries of a routing trace for notebooks: expert popularity, concentration, hits.

Counts are over (token, rank) selections, not store lookups: a chunk of 32 tokens that all
pick expert 5 counts 32 times here and once in the cache statistics.
Shapes: L_moe MoE layers (in `trace.moe_layers` order), E experts.
"""

from __future__ import annotations

import numpy as np

from waste.engine.trace import PHASES, Trace
from waste.errors import WasteError


def popularity(trace: Trace, *, weighted: bool = False) -> np.ndarray:
    """[L_moe, E] how often each layer selected each expert (or the summed routing weight)."""
    out = np.zeros((len(trace.moe_layers), trace.num_experts), np.float64 if weighted else np.int64)
    for i, layer in enumerate(trace.moe_layers):
        sel = trace.layer == layer
        w = trace.weights[sel].ravel().astype(np.float64) if weighted else None
        out[i] = np.bincount(trace.ids[sel].ravel(), weights=w, minlength=trace.num_experts)
    return out


def top_experts(counts: np.ndarray, n: int) -> np.ndarray:
    """[L_moe, n] the n most selected experts of each layer, most popular first (ties to
    the lower id)."""
    counts = np.asarray(counts)
    if not 1 <= n <= counts.shape[-1]:
        raise WasteError(f"top_experts: n must be in 1..{counts.shape[-1]}, got {n}")
    return np.argsort(-counts, axis=-1, kind="stable")[..., :n]


def entropy(counts: np.ndarray, *, normalized: bool = False) -> np.ndarray:
    """[L_moe] entropy in bits of each layer's selection distribution; with `normalized`,
    divided by log2(E) so 1 means uniform. A layer with no selections gives NaN."""
    c = np.asarray(counts, np.float64)
    total = c.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = c / total
        h = -np.where(p > 0, p * np.log2(np.where(p > 0, p, 1.0)), 0.0).sum(axis=-1)
    h = np.where(total[..., 0] > 0, h, np.nan)
    return h / np.log2(c.shape[-1]) if normalized and c.shape[-1] > 1 else h


def coverage(counts: np.ndarray, fraction: float) -> np.ndarray:
    """[L_moe] the fewest experts of each layer that together account for `fraction` of its
    selections (how big a per-layer cache of the hottest experts would need to be)."""
    if not 0 < fraction <= 1:
        raise WasteError(f"coverage fraction must be in (0, 1], got {fraction}")
    c = -np.sort(-np.asarray(counts, np.float64), axis=-1)
    cum = np.cumsum(c, axis=-1)
    need = fraction * cum[..., -1:]
    # The small slack keeps fraction = 1 from missing the last expert to rounding.
    return (cum < need - 1e-9 * np.maximum(need, 1)).sum(axis=-1) + 1


def hit_rates(trace: Trace) -> dict[str, dict[int, float]]:
    """Recorded hit rate over (token, rank) selections: phase ("prefill", "decode", "all")
    -> layer -> rate. Layers without rows in a phase are left out."""
    out: dict[str, dict[int, float]] = {}
    for name in (*PHASES, "all"):
        rows = trace.phase == PHASES.index(name) if name != "all" else np.ones(len(trace), bool)
        out[name] = {
            layer: float(trace.hit[rows & (trace.layer == layer)].mean())
            for layer in trace.moe_layers
            if (rows & (trace.layer == layer)).any()
        }
    return out
