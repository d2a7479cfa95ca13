"""Float64 MLA oracle: the plain, non-absorbed form.

Keys and values are re-expanded from the cached latent for every head (k = [W_UK c | k_rope],
v = W_UV c) and attended ordinarily, one query at a time. This is the textbook definition
the absorbed kernels in `waste.kernels.mla` must reproduce.

Kimi MLA facts (FACTS.md): with `mla_use_nope` there is no rotary embedding; the last P =
qk_rope_head_dim values of the compressed KV projection are one key part shared by all heads;
each head's query is [nope | rope]; softmax scale (nope + rope)^-0.5; kv_a_layernorm (and
q_a_layernorm) use eps 1e-6 (`cfg.kv_layernorm_eps`). With `mla_use_output_gate` (K3) the
concatenated head outputs are multiplied by sigmoid(g_proj x) before o_proj.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from waste.config import ModelConfig


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w over the last axis, in float64."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Logistic function in float64 without overflow for large |x|."""
    x = np.asarray(x, np.float64)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def softmax(s: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in float64."""
    e = np.exp(s - np.max(s, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def mla_attention(
    q: np.ndarray,
    latent: np.ndarray,
    kv_b: np.ndarray,
    *,
    start: int,
    kv_rank: int,
    nope: int,
    v_dim: int,
    scale: float,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Causal attention of T queries at positions start.. over the cached latents, non-absorbed.

    q [T, H, nope + P]; latent [n, R + P] with n >= start + T (rows beyond are ignored);
    kv_b [H * (nope + V), R] (per head [k_nope | v]).
    Returns o [T, H, V] and, per query t, its probabilities [H, start + t + 1].
    """
    q = np.asarray(q, np.float64)
    latent = np.asarray(latent, np.float64)
    T, H, _ = q.shape
    n = start + T
    c = latent[:n, :kv_rank]
    k_rope = latent[:n, kv_rank:]
    w = np.asarray(kv_b, np.float64).reshape(H, nope + v_dim, kv_rank)
    keys = []
    values = []
    for h in range(H):
        k_nope = c @ w[h, :nope].T
        keys.append(np.concatenate([k_nope, k_rope], axis=1))
        values.append(c @ w[h, nope:].T)
    o = np.zeros((T, H, v_dim))
    probs = []
    for t in range(T):
        visible = start + t + 1
        p_t = np.zeros((H, visible))
        for h in range(H):
            scores = keys[h][:visible] @ q[t, h] * scale
            p = softmax(scores)
            p_t[h] = p
            o[t, h] = p @ values[h][:visible]
        probs.append(p_t)
    return o, probs


def naive_mla_layer(x: np.ndarray, weights: Mapping[str, np.ndarray], cfg: ModelConfig,
                    product: Callable[[str, np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """One MLA attention layer over a whole sequence from position 0, no cache.

    x [T, hidden] (already through input_layernorm). `weights` maps the tensor names below
    `self_attn.` without the `.weight` suffix (`q_proj` or `q_a_proj`/`q_a_layernorm`/`q_b_proj`,
    `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`, optional `g_proj`) to float64
    arrays. `product(name, a)` is a @ W.T for the projection `name` (all but kv_b_proj, which
    the attention expands): by default in float64 on `weights`; a caller may give the products
    of a storage format (`waste.reference.quant.reference_matmul`, which rounds activations as
    that format's products do). Returns y [T, hidden].
    """
    if product is None:
        def product(name: str, a: np.ndarray) -> np.ndarray:
            return a @ weights[name].T
    x = np.asarray(x, np.float64)
    T = x.shape[0]
    H, nope, rope, v_dim, R = (
        cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank,
    )
    eps = cfg.kv_layernorm_eps
    if cfg.q_lora_rank is None:
        q = product("q_proj", x)
    else:
        q = product("q_b_proj", rms_norm(product("q_a_proj", x), weights["q_a_layernorm"], eps))
    q = q.reshape(T, H, nope + rope)
    ckv = product("kv_a_proj_with_mqa", x)
    latent = np.concatenate([rms_norm(ckv[:, :R], weights["kv_a_layernorm"], eps), ckv[:, R:]], axis=1)
    o, _ = mla_attention(
        q, latent, weights["kv_b_proj"], start=0, kv_rank=R, nope=nope, v_dim=v_dim, scale=(nope + rope) ** -0.5
    )
    o = o.reshape(T, H * v_dim)
    if cfg.mla_output_gate:
        o = o * sigmoid(product("g_proj", x))
    return product("o_proj", o)
