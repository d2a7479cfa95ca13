"""K3's AttnRes mixing: softmax attention over depth, per token (FACTS.md, "Kimi K3").

The candidates of a token are the stored block summaries b_0 .. b_{n-1} and the running
partial sum p. Each scores

    logit_c = (c . w_eff) / sqrt(mean(c^2) + eps),   w_eff = norm_weight * proj_weight[0]

(an RMSNorm of c followed by a [1, D] projection), and the mix is sum_c softmax(logit)_c * c.

Dot products, squares, the softmax and the weighted sum run in float64 per token: block norms
span many orders of magnitude (the embedding against deep residual sums), and c^2 of a float32
above ~1e19 would overflow a float32 sum. The result is rounded to float32 once. Each token is
computed by the same code whatever T is, so prefill and decode give the same bits.

Shapes: blocks [n, T, D] (or a list of n arrays [T, D]), partial [T, D], w_eff [D];
mixed [T, D] float32, weights [T, n + 1] float32 (the blocks in order, then the partial sum).
"""

from __future__ import annotations

import math

import numpy as np

from waste.errors import WasteError
from waste.jit import kernel, parallel_kernel, prange

# Entering Numba's thread pool costs microseconds, more than mixing a few tokens.
SERIAL_TOKENS = 4


@kernel
def _mix_token(blocks, partial, w, eps, t, out, weights):
    """Mix token t: out[t] and weights[t] from blocks [n, T, D], partial [T, D], w [D]."""
    n = blocks.shape[0]
    D = partial.shape[1]
    logits = np.empty(n + 1, np.float64)
    for c in range(n + 1):
        dot = 0.0
        sq = 0.0
        for d in range(D):
            v = np.float64(blocks[c, t, d]) if c < n else np.float64(partial[t, d])
            dot += v * np.float64(w[d])
            sq += v * v
        logits[c] = dot / math.sqrt(sq / D + eps)
    top = logits.max()
    total = 0.0
    for c in range(n + 1):
        logits[c] = math.exp(logits[c] - top)
        total += logits[c]
    for c in range(n + 1):
        logits[c] /= total
        weights[t, c] = logits[c]
    for d in range(D):
        s = logits[n] * np.float64(partial[t, d])
        for c in range(n):
            s += logits[c] * np.float64(blocks[c, t, d])
        out[t, d] = s


@kernel
def _mix_serial(blocks, partial, w, eps, out, weights):
    for t in range(partial.shape[0]):
        _mix_token(blocks, partial, w, eps, t, out, weights)


@parallel_kernel
def _mix_parallel(blocks, partial, w, eps, out, weights):
    for t in prange(partial.shape[0]):
        _mix_token(blocks, partial, w, eps, t, out, weights)


def attn_res_mix_weights(blocks: np.ndarray | list[np.ndarray], partial: np.ndarray, w_eff: np.ndarray,
                         eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(mixed [T, D], weights [T, n + 1]) float32: the mix and the softmax weights of its candidates.

    Passing blocks as one C-contiguous [n, T, D] array (e.g. the first n of a preallocated
    stack) avoids the copy a list needs.
    """
    partial = np.ascontiguousarray(partial, np.float32)
    if partial.ndim != 2:
        raise WasteError(f"AttnRes partial sum must be [T, D], got shape {partial.shape}")
    T, D = partial.shape
    if isinstance(blocks, list | tuple):
        blocks = np.stack(blocks) if len(blocks) else np.empty((0, T, D), np.float32)
    blocks = np.ascontiguousarray(blocks, np.float32)
    if blocks.ndim != 3 or blocks.shape[1:] != (T, D):
        raise WasteError(f"AttnRes blocks must be [n, {T}, {D}], got shape {blocks.shape}")
    w_eff = np.ascontiguousarray(w_eff, np.float32)
    if w_eff.shape != (D,):
        raise WasteError(f"AttnRes w_eff must have shape ({D},), got {w_eff.shape}")
    if not eps >= 0:
        raise WasteError(f"AttnRes eps must be >= 0, got {eps}")
    out = np.empty((T, D), np.float32)
    weights = np.empty((T, blocks.shape[0] + 1), np.float32)
    mix = _mix_serial if T <= SERIAL_TOKENS else _mix_parallel
    mix(blocks, partial, w_eff, float(eps), out, weights)
    return out, weights


def attn_res_mix(blocks: np.ndarray | list[np.ndarray], partial: np.ndarray, w_eff: np.ndarray,
                 eps: float) -> np.ndarray:
    """The AttnRes mix [T, D] float32 of blocks [n, T, D] (or a list) and the partial sum [T, D]."""
    return attn_res_mix_weights(blocks, partial, w_eff, eps)[0]
