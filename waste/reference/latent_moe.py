"""Float64 oracle of K3's latent MoE (FACTS.md "Kimi K3"), written from the text:

    route on the full x (as waste.reference.moe.route); z = routed_expert_down_proj x
    y = sum_i w_i expert_i(z)               experts: gate/up [I, R], down [R, I]
    y = RMSNorm(y; routed_expert_norm)      only with latent_moe_use_norm
    y = routed_expert_up_proj y + shared(x) shared experts on the full-width x

Token by token, nothing from waste.kernels or waste.engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from waste.reference.mla import rms_norm
from waste.reference.moe import ExpertWeights, route
from waste.reference.quant import product_weights

MLP = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]  # (x, gate, up, down) -> y


def latent_moe_ffn(
    x: np.ndarray,
    router_weight: np.ndarray,
    bias: np.ndarray,
    expert: Callable[[int], ExpertWeights],
    shared: ExpertWeights | None,
    down_proj: np.ndarray,
    up_proj: np.ndarray,
    norm: np.ndarray | None,
    *,
    mlp: MLP,
    eps: float,
    route_options: dict[str, Any],
    forced_ids: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Latent MoE on x [T, hidden] -> (y [T, hidden], this router's own ids [T, k]).

    down_proj [R, hidden], up_proj [hidden, R], norm [R] or None; expert(e) gives float64
    (gate [I, R], up [I, R], down [R, I]); mlp(x, gate, up, down) is the experts' gated MLP;
    `forced_ids` [T, k] sets the experts applied (the weights still come from this router).
    """
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(router_weight, np.float64).T
    own_ids, weights = route(logits, bias, **route_options)
    ids = own_ids
    if forced_ids is not None:
        ids, weights = route(logits, bias, forced_ids=forced_ids, **route_options)
    z = x @ product_weights(down_proj).T  # [T, R]
    y = np.zeros_like(z)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t], weights[t], strict=True):
            y[t] += w * mlp(z[t : t + 1], *expert(int(e)))[0]
    if norm is not None:
        y = rms_norm(y, norm, eps)
    y = y @ product_weights(up_proj).T
    if shared is not None:
        y += mlp(x, *shared)
    return y, own_ids
