"""Float64 oracle pieces that K3 adds to Kimi-Linear (FACTS.md "Kimi K3"), written from the text.

- SiTU: act(g, u) = b tanh(g / b) sigmoid(g) * (bl tanh(u / bl), or u when bl is None), then
  down_proj; b = situ_beta (1 when null), bl = situ_linear_beta. Dense, shared and routed experts.
- AttnRes depth attention: Mix(candidates) = sum_c w_c c with w = softmax over the candidates c
  of (c . (norm_w * proj_w[0])) / sqrt(mean(c^2) + eps). The block bookkeeping (which
  candidates exist at each site) is in `waste.reference.model.ReferenceModel.forward`.
- LatentMoE: route on the full x; z = down x; y = sum_i w_i expert_i(z); RMSNorm(y) if the
  latent norm exists; up y; plus the shared experts on the full x.

Plain NumPy in float64, token by token where that is clearer; nothing from waste.kernels or
waste.engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from waste.reference.mla import rms_norm, sigmoid, softmax
from waste.reference.moe import ExpertWeights, route, swiglu

MLP = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]  # (x, gate, up, down) -> y


def situ(g: np.ndarray, u: np.ndarray, beta: float | None, linear_beta: float | None) -> np.ndarray:
    """The SiTU activation of gate g and up u (equal shapes) in float64."""
    g, u = np.asarray(g, np.float64), np.asarray(u, np.float64)
    b = 1.0 if beta is None else float(beta)
    gate = b * np.tanh(g / b) * sigmoid(g)
    if linear_beta is None:
        return gate * u
    return gate * (linear_beta * np.tanh(u / linear_beta))


def situ_mlp(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray, beta: float | None,
             linear_beta: float | None) -> np.ndarray:
    """down(SiTU(gate x, up x)) in float64: x [T, in] -> [T, out]."""
    x = np.asarray(x, np.float64)
    return situ(x @ w_gate.T, x @ w_up.T, beta, linear_beta) @ w_down.T


def mlp_for(cfg) -> MLP:  # noqa: ANN001 - a ModelConfig
    """The gated MLP of the config's hidden_act: SwiGLU ("silu") or SiTU ("situ")."""
    if cfg.hidden_act == "silu":
        return swiglu
    return lambda x, gate, up, down: situ_mlp(x, gate, up, down, cfg.situ_beta, cfg.situ_linear_beta)


def depth_attention(candidates: Sequence[np.ndarray], norm_w: np.ndarray, proj_w: np.ndarray, eps: float
                    ) -> tuple[np.ndarray, np.ndarray]:
    """AttnRes mix of candidates (each [T, D]: the stored blocks, then the partial sum) ->
    (mixed [T, D], weights [T, n]) in float64, one softmax per token over the candidates."""
    c = np.stack([np.asarray(a, np.float64) for a in candidates])  # [n, T, D]
    w_eff = np.asarray(norm_w, np.float64) * np.asarray(proj_w, np.float64).reshape(-1)
    weights = softmax(((c @ w_eff) / np.sqrt(np.mean(c * c, axis=-1) + eps)).T)  # [T, n]
    return np.einsum("tn,ntd->td", weights, c), weights


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
    route_options: dict,
    forced_ids: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Latent MoE on x [T, hidden] -> (y [T, hidden], this router's own ids [T, k]).

    down_proj [R, hidden], up_proj [hidden, R], norm [R] or None; expert(e) gives float64
    (gate [I, R], up [I, R], down [R, I]); `forced_ids` [T, k] sets the experts applied.
    """
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(router_weight, np.float64).T
    own_ids, weights = route(logits, bias, **route_options)
    ids = own_ids
    if forced_ids is not None:
        ids, weights = route(logits, bias, forced_ids=forced_ids, **route_options)
    z = x @ down_proj.T  # [T, R]
    y = np.zeros_like(z)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t], weights[t], strict=True):
            y[t] += w * mlp(z[t : t + 1], *expert(int(e)))[0]
    if norm is not None:
        y = rms_norm(y, norm, eps)
    y = y @ up_proj.T
    if shared is not None:
        y += mlp(x, *shared)
    return y, own_ids
