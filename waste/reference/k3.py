"""Float64 oracles for Kimi K3's SiTU activation and AttnRes mixing (FACTS.md, "Kimi K3").

Written from the definitions, sharing nothing with `waste.kernels`:
- SiTU: act(g, u) = b * tanh(g / b) * sigmoid(g) * (bl * tanh(u / bl), or u when bl is None),
  b = beta (1 when None); g = gate_proj x, u = up_proj x; the expert is down_proj act.
- AttnRes: candidates c in {b_0, .., b_{n-1}, p}; logit_c = (c . w_eff) / sqrt(mean(c^2) + eps);
  mix = sum_c softmax(logits)_c * c, per token.
"""

from __future__ import annotations

import numpy as np

from waste.reference.mla import sigmoid
from waste.reference.quant import product_weights


def situ(g: np.ndarray, u: np.ndarray, beta: float | None, linear_beta: float | None) -> np.ndarray:
    """SiTU(g, u) in float64, elementwise."""
    g = np.asarray(g, np.float64)
    u = np.asarray(u, np.float64)
    b = 1.0 if beta is None else float(beta)
    second = u if linear_beta is None else linear_beta * np.tanh(u / linear_beta)
    return b * np.tanh(g / b) * sigmoid(g) * second


def situ_mlp(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray,
             beta: float | None, linear_beta: float | None) -> np.ndarray:
    """down(SiTU(gate x, up x)) in float64: x [T, in] -> [T, out]."""
    x = np.asarray(x, np.float64)
    h = situ(x @ product_weights(w_gate).T, x @ product_weights(w_up).T, beta, linear_beta)
    return h @ product_weights(w_down).T


def attn_res_weights(candidates: list[np.ndarray], w_eff: np.ndarray, eps: float) -> np.ndarray:
    """Softmax weights [T, n] over the candidates (each [T, D]) of every token, in float64."""
    w_eff = np.asarray(w_eff, np.float64)
    logits = []
    for c in candidates:
        c = np.asarray(c, np.float64)
        rms = np.sqrt(np.mean(c * c, axis=-1) + eps)  # [T]
        logits.append((c @ w_eff) / rms)
    logits = np.stack(logits, axis=-1)  # [T, n]
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attn_res_mix(blocks: list[np.ndarray], partial: np.ndarray, w_eff: np.ndarray,
                 eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(mix [T, D], weights [T, n + 1]) in float64 of the blocks (each [T, D]) and the partial sum."""
    candidates = [np.asarray(b, np.float64) for b in blocks] + [np.asarray(partial, np.float64)]
    weights = attn_res_weights(candidates, w_eff, eps)
    mix = sum(weights[:, i, None] * c for i, c in enumerate(candidates))
    return mix, weights
