"""Float64 MoE oracle: routing by sorting, SwiGLU by matrix products, token by token.

Same semantics as `waste.kernels.moe` (see its docstring and FACTS.md), written as plainly as
possible: each token's experts are ranked with Python's `sorted` on (-score, index), which
also fixes the tie rule (lowest index first among equal values).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from waste.reference.mla import sigmoid

ExpertWeights = tuple[np.ndarray, np.ndarray, np.ndarray]  # (gate [I, in], up [I, in], down [out, I])


def route(
    logits: np.ndarray,
    bias: np.ndarray,
    *,
    top_k: int,
    num_groups: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
    router_weights: str = "unbiased",
    forced_ids: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """logits [T, E] -> (ids [T, k] int64 in rank order, weights [T, k] float64).

    `forced_ids` [T, k] replaces the choice (the weights still come from these scores):
    it lets a check follow another engine's routing through a near-tie instead of
    jumping to a different set of experts.
    """
    logits = np.asarray(logits, np.float64)
    bias = np.asarray(bias, np.float64)
    T, E = logits.shape
    size = E // num_groups
    ids = np.zeros((T, top_k), np.int64)
    weights = np.zeros((T, top_k))
    for t in range(T):
        s = sigmoid(logits[t])
        c = s + bias
        groups = []
        for g in range(num_groups):
            members = sorted(c[g * size : (g + 1) * size], reverse=True)
            groups.append((-sum(members[:2]), g))
        kept = {g for _, g in sorted(groups)[:topk_group]}
        # Experts of dropped groups still compete, with a choice score of 0 (FACTS.md, K3).
        candidates = [(-c[e] if e // size in kept else 0.0, e) for e in range(E)]
        chosen = [e for _, e in sorted(candidates)[:top_k]] if forced_ids is None else list(forced_ids[t])
        w = np.array([c[e] if router_weights == "biased" else s[e] for e in chosen])
        if renormalize and top_k > 1:  # FACTS.md: renormalised when k > 1
            w = w / (w.sum() + 1e-20)
        ids[t] = chosen
        weights[t] = w * scaling
    return ids, weights


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) in float64."""
    return np.asarray(x, np.float64) * sigmoid(x)


def swiglu(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """down(SiLU(gate x) * up x) in float64: x [T, in] -> [T, out]."""
    x = np.asarray(x, np.float64)
    return (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def moe_ffn(
    x: np.ndarray,
    router_weight: np.ndarray,
    bias: np.ndarray,
    expert: Callable[[int], ExpertWeights],
    shared: ExpertWeights | None,
    *,
    top_k: int,
    num_groups: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
    router_weights: str = "unbiased",
    forced_ids: np.ndarray | None = None,
    mlp: Callable[..., np.ndarray] = swiglu,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Routed experts plus the (unscaled) shared expert, token by token.

    x [T, hidden]; router_weight [E, hidden]; expert(e) -> float64 (w1 gate, w3 up, w2 down);
    mlp(x, gate, up, down) is the experts' gated MLP (SwiGLU unless given).
    Returns (y [T, hidden], ids [T, k], weights [T, k]); `ids` is always this router's own
    choice, also when `forced_ids` [T, k] sets the experts actually applied.
    """
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(router_weight, np.float64).T
    options = dict(top_k=top_k, num_groups=num_groups, topk_group=topk_group, renormalize=renormalize,
                   scaling=scaling, router_weights=router_weights)
    own_ids, weights = route(logits, bias, **options)
    ids = own_ids
    if forced_ids is not None:
        ids, weights = route(logits, bias, forced_ids=forced_ids, **options)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t], weights[t], strict=True):
            y[t] += w * mlp(x[t : t + 1], *expert(int(e)))[0]
    if shared is not None:
        y += mlp(x, *shared)
    return y, own_ids, weights

