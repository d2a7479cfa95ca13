"""Float64 NumPy oracles for Kimi Delta Attention (KDA), written to be obviously right.

Everything loops over time and works in float64, whatever dtype comes in. The fast Numba
kernels in `waste.kernels.kda` / `waste.kernels.kda_chunk` are tested against these.
Semantics are those of FACTS.md:

    S' = Diag(exp(g_t)) S;  S = S' + beta_t k_t (v_t - S'^T k_t)^T;  o_t = S^T q_t

with q, k L2-normalised per head (eps 1e-6 inside the root) and q scaled by K^-0.5 after
the norm. Shapes: q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; state [H, K, V].
"""

from __future__ import annotations

from typing import Any

import numpy as np

from waste.errors import WasteError
from waste.reference.quant import product_weights

L2_EPS = 1e-6
SOFTPLUS_LINEAR_ABOVE = 20.0


def naive_l2norm(x: np.ndarray, eps: float = L2_EPS) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis, float64."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp(-x) may overflow to inf for very negative x; 1 / (1 + inf) = 0 is the right answer.
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def naive_a_log_per_head(A_log: np.ndarray, num_heads: int) -> np.ndarray:
    """A_log as [H] float64 from [1, 1, H, 1], [H], or [K] zero-padded past H."""
    a = np.asarray(A_log, np.float64).reshape(-1)
    if a.size == num_heads:
        return a
    if a.size > num_heads and not np.any(a[num_heads:]):
        return a[:num_heads]
    raise WasteError(f"A_log of shape {np.shape(A_log)} does not hold one value per head for {num_heads} heads")


def _split_heads(z: np.ndarray, dt_bias: np.ndarray, A_log: np.ndarray, num_heads: int | None) -> np.ndarray:
    """z [T, H*K] or [T, H, K] plus dt_bias, reshaped to [T, H, K] float64."""
    z = np.asarray(z, np.float64)
    if z.ndim == 3:
        T, H, K = z.shape
    else:
        T, HK = z.shape
        H = num_heads if num_heads is not None else _infer_heads(A_log, HK)
        K = HK // H
    return z.reshape(T, H, K) + np.asarray(dt_bias, np.float64).reshape(H, K)


def _infer_heads(A_log: np.ndarray, hk: int) -> int:
    a = np.asarray(A_log).reshape(-1)
    n = a.size
    # A [K] vector whose tail is exactly zero is the zero-padded K3 form: H = H*K / K.
    h_padded = hk // n
    if hk % n == 0 and h_padded < n and not np.any(a[h_padded:]):
        return h_padded
    return n


def kda_gate_softplus(z: np.ndarray, A_log: np.ndarray, dt_bias: np.ndarray, *,
                      num_heads: int | None = None) -> np.ndarray:
    """Kimi-Linear decay: g = -exp(A_log[h]) * softplus(z + dt_bias) -> [T, H, K] float64."""
    x = _split_heads(z, dt_bias, A_log, num_heads)
    H = x.shape[1]
    a = np.exp(naive_a_log_per_head(A_log, H))[None, :, None]
    sp = np.where(x > SOFTPLUS_LINEAR_ABOVE, x, np.log1p(np.exp(np.minimum(x, SOFTPLUS_LINEAR_ABOVE))))
    return -a * sp


def kda_gate_lower_bound(z: np.ndarray, A_log: np.ndarray, dt_bias: np.ndarray, lower_bound: float, *,
                         num_heads: int | None = None) -> np.ndarray:
    """K3 decay: g = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias)) -> [T, H, K] float64."""
    x = _split_heads(z, dt_bias, A_log, num_heads)
    H = x.shape[1]
    a = np.exp(naive_a_log_per_head(A_log, H))[None, :, None]
    return float(lower_bound) * _sigmoid(a * x)


def naive_short_conv(x: np.ndarray, w: np.ndarray, history: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise conv then SiLU: x [T, C], w [C, 1, W] or [C, W], history [W-1, C] (oldest first).

    Returns (y [T, C], new history [W-1, C]): the last W-1 inputs, what token-by-token decode keeps.
    """
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    C = x.shape[1]
    w = w.reshape(C, -1)
    W = w.shape[1]
    hist = np.zeros((W - 1, C)) if history is None else np.asarray(history, np.float64)
    ext = np.concatenate([hist, x], axis=0)  # [W-1+T, C]
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(W):
            y[t] += w[:, j] * ext[t + j]
    y = y * _sigmoid(y)
    return y, ext[ext.shape[0] - (W - 1):].copy()


def naive_gated_rmsnorm(o: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Per-head RMSNorm of o [T, H, V] times weight [V] times sigmoid(gate [T, H, V])."""
    o = np.asarray(o, np.float64)
    gate = np.asarray(gate, np.float64).reshape(o.shape)
    normed = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + eps)
    return normed * np.asarray(weight, np.float64) * _sigmoid(gate)


def _prepare(q, k, v, g, beta, scale, initial_state, l2norm_qk):
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    T, H, K = q.shape
    V = v.shape[2]
    if scale is None:
        scale = K**-0.5
    if l2norm_qk:
        q, k = naive_l2norm(q), naive_l2norm(k)
    q = q * scale
    S = np.zeros((H, K, V)) if initial_state is None else np.array(initial_state, np.float64)
    return q, k, v, g, beta, S


def naive_recurrent_kda(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, *,
                        scale: float | None = None, initial_state: np.ndarray | None = None,
                        l2norm_qk: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Token-by-token KDA: (o [T, H, V], final state [H, K, V]), float64."""
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, scale, initial_state, l2norm_qk)
    T = q.shape[0]
    o = np.zeros(v.shape)
    for t in range(T):
        S = S * np.exp(g[t])[:, :, None]
        pred = np.einsum("hkv,hk->hv", S, k[t])
        S = S + np.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - pred))
        o[t] = np.einsum("hkv,hk->hv", S, q[t])
    return o, S


def naive_chunk_kda(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, *,
                    scale: float | None = None, initial_state: np.ndarray | None = None,
                    l2norm_qk: bool = True, chunk_size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """The chunked (WY) form of KDA written plainly, any T; same results as `naive_recurrent_kda`.

    Per chunk with cumulative decay G (inclusive, from the chunk start) and state S0:
    A[i, j] = beta_i sum_d k_id k_jd exp(G_id - G_jd) (j < i);  (I + A) [U | W] = diag(beta) [V | k exp(G)];
    D = U - W S0 (the delta-rule corrections);  M[i, j] = sum_d q_id k_jd exp(G_id - G_jd) (j <= i);
    O = (q exp(G)) S0 + M D;  S = Diag(exp(G_last)) S0 + (k exp(G_last - G))^T D.
    Pairwise decays are formed as exp of differences, never as products exp(G_i) exp(-G_j).
    """
    if chunk_size < 1:
        raise WasteError(f"chunk_size must be positive, got {chunk_size}")
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, scale, initial_state, l2norm_qk)
    T, H, K = q.shape
    o = np.zeros(v.shape)
    for h in range(H):
        Sh = S[h]
        for c0 in range(0, T, chunk_size):
            c1 = min(T, c0 + chunk_size)
            n = c1 - c0
            qc, kc, vc, bc = q[c0:c1, h], k[c0:c1, h], v[c0:c1, h], beta[c0:c1, h]
            G = np.cumsum(g[c0:c1, h], axis=0)  # [n, K]
            A = np.zeros((n, n))
            M = np.zeros((n, n))
            for i in range(n):
                for j in range(i + 1):
                    decay = np.exp(G[i] - G[j])
                    M[i, j] = np.sum(qc[i] * kc[j] * decay)
                    if j < i:
                        A[i, j] = bc[i] * np.sum(kc[i] * kc[j] * decay)
            U = np.zeros((n, vc.shape[1]))
            W = np.zeros((n, K))
            for i in range(n):
                U[i] = bc[i] * vc[i] - A[i, :i] @ U[:i]
                W[i] = bc[i] * kc[i] * np.exp(G[i]) - A[i, :i] @ W[:i]
            D = U - W @ Sh
            o[c0:c1, h] = (qc * np.exp(G)) @ Sh + M @ D
            Sh = np.exp(G[-1])[:, None] * Sh + (kc * np.exp(G[-1] - G)).T @ D
        S[h] = Sh
    return o, S


def naive_kda_layer(x: np.ndarray, weights: dict[str, np.ndarray], cfg: Any, *,
                    initial_state: np.ndarray | None = None,
                    conv_state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One KDA layer on x [T, hidden] with dense weights named as in the checkpoint (without prefix).

    Returns (y [T, hidden], recurrent state [H, K, V], conv rings [3, W-1, H*K]).
    `cfg` needs kda_num_heads, kda_head_dim, kda_gate, gate_lower_bound, kda_full_rank_gate,
    rms_norm_eps (a ModelConfig will do).
    """
    x = np.asarray(x, np.float64)
    T = x.shape[0]
    H, K = cfg.kda_num_heads, cfg.kda_head_dim

    def w(name: str) -> np.ndarray:
        return product_weights(weights[name])

    rings = []
    qkv = []
    for i, n in enumerate(("q", "k", "v")):
        hist = None if conv_state is None else np.asarray(conv_state[i], np.float64)
        y, ring = naive_short_conv(x @ w(f"{n}_proj.weight").T, w(f"{n}_conv1d.weight"), hist)
        qkv.append(y.reshape(T, H, K))
        rings.append(ring)
    z = (x @ w("f_a_proj.weight").T) @ w("f_b_proj.weight").T
    if cfg.kda_gate == "lower_bound":
        g = kda_gate_lower_bound(z, w("A_log"), w("dt_bias"), cfg.gate_lower_bound, num_heads=H)
    else:
        g = kda_gate_softplus(z, w("A_log"), w("dt_bias"), num_heads=H)
    beta = _sigmoid(x @ w("b_proj.weight").T)
    o, S = naive_recurrent_kda(*qkv, g, beta, initial_state=initial_state, l2norm_qk=True)
    if cfg.kda_full_rank_gate:
        gate = x @ w("g_proj.weight").T
    else:
        gate = (x @ w("g_a_proj.weight").T) @ w("g_b_proj.weight").T
    o = naive_gated_rmsnorm(o, gate.reshape(T, H, K), w("o_norm.weight"), cfg.rms_norm_eps)
    return o.reshape(T, H * K) @ w("o_proj.weight").T, S, np.stack(rings)
