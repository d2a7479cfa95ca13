"""MoE router: sigmoid, bias-corrected grouped top-k, and the router logits it starts from.

Routing per token (FACTS.md, float32 throughout like transformers' KimiLinearTopkRouter):

    s = sigmoid(x W_router^T)                 # [E]
    c = s + e_score_correction_bias           # used only to choose
    group score = sum of the top-2 c in the group (top-1 when groups hold one expert);
    keep the topk_group best groups; the experts of the others choose with c = 0
    ids = top-k of those choice scores, in rank order (best first)
    w = s[ids] ("unbiased": transformers, vLLM)  |  c[ids] ("biased": the official remote code)
    w = w / (sum(w) + 1e-20) if renormalize and k > 1;  w = w * routed_scaling_factor

Dropped groups are zeroed, not removed (FACTS.md, K3; the DeepSeek-style remote code and mlx-lm
do this, vLLM masks with -inf): they differ only when a kept expert's biased score is negative,
which a dropped expert at 0 then outranks. Ties: among equal values the lowest index ranks
first (groups and experts alike); the float64 reference in `waste.reference.moe` uses the
same rules.

Shapes: logits [T, E]; ids, weights [T, k]; x [T, hidden].
"""

from __future__ import annotations

import numpy as np

from waste.errors import WasteError
from waste.jit import kernel, parallel_kernel, prange

ROUTER_WEIGHTS = ("unbiased", "biased")


@kernel
def _route(logits, bias, top_k, n_group, topk_group, renormalize, scaling, biased, ids, weights):
    T, E = logits.shape
    group_size = E // n_group
    one = np.float32(1.0)
    s = np.empty(E, np.float32)
    c = np.empty(E, np.float32)
    choice = np.empty(E, np.float32)
    taken = np.empty(E, np.bool_)
    group_score = np.empty(n_group, np.float32)
    group_kept = np.empty(n_group, np.bool_)
    for t in range(T):
        for e in range(E):
            s[e] = one / (one + np.exp(-logits[t, e]))
            c[e] = s[e] + bias[e]
        if topk_group < n_group:
            for g in range(n_group):
                b1 = -np.inf
                b2 = -np.inf
                for e in range(g * group_size, (g + 1) * group_size):
                    if c[e] > b1:
                        b2 = b1
                        b1 = c[e]
                    elif c[e] > b2:
                        b2 = c[e]
                group_score[g] = b1 + b2 if group_size > 1 else b1
                group_kept[g] = False
            for _ in range(topk_group):
                best = -1
                for g in range(n_group):
                    if not group_kept[g] and (best < 0 or group_score[g] > group_score[best]):
                        best = g
                group_kept[best] = True
            for e in range(E):
                choice[e] = c[e] if group_kept[e // group_size] else np.float32(0.0)
        else:
            choice[:] = c
        taken[:] = False
        total = np.float32(0.0)
        for i in range(top_k):
            best = -1
            for e in range(E):
                # Strict '>' keeps the lowest index among equal values.
                if not taken[e] and (best < 0 or choice[e] > choice[best]):
                    best = e
            taken[best] = True
            ids[t, i] = best
            w = c[best] if biased else s[best]
            weights[t, i] = w
            total += w
        if renormalize and top_k > 1:  # one expert keeps its score (transformers' router, FACTS.md)
            denom = total + np.float32(1e-20)
            for i in range(top_k):
                weights[t, i] = weights[t, i] / denom
        for i in range(top_k):
            weights[t, i] = weights[t, i] * scaling


# Token-expert dot products from which router logits are computed on all cores (a prefill's).
PARALLEL_ROUTER_WORK = 1 << 20


@kernel
def _router_rows(x, weight, out, t, e0, e1):
    """out[t, e] = x[t] . weight[e] for experts e0 <= e < e1 (a decode step's router splits its
    experts between threads: `waste.kernels.moe_step._moe_one_token`)."""
    for e in range(e0, e1):
        acc = np.float32(0.0)
        for i in range(x.shape[1]):
            acc += x[t, i] * weight[e, i]
        out[t, e] = acc


@kernel
def _router_row(x, weight, out, t):
    _router_rows(x, weight, out, t, 0, weight.shape[0])


@parallel_kernel
def _router_logits(x, weight, out):
    """out [T, E] = x [T, hidden] weight [E, hidden]^T, each token's row by the same loop."""
    if x.shape[0] * weight.shape[0] * weight.shape[1] < PARALLEL_ROUTER_WORK:
        for t in range(x.shape[0]):
            _router_row(x, weight, out, t)
    else:
        for t in prange(x.shape[0]):
            _router_row(x, weight, out, t)


@kernel
def route_one_token(x, weight, bias, top_k, n_group, topk_group, renormalize, scaling, biased, ids, weights):
    """ids, weights [1, k] of one token x [1, hidden] inside a compiled caller: the logits and
    the choice of `router_logits` and `route_checked` (the same kernels, the same bits)."""
    logits = np.empty((1, weight.shape[0]), np.float32)
    _router_row(x, weight, logits, 0)
    _route(logits, bias, top_k, n_group, topk_group, renormalize, scaling, biased, ids, weights)


def router_logits(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x [T, hidden] @ weight [E, hidden]^T in float32 -> logits [T, E].

    float32 dot products in a Numba loop, not BLAS: between Numba's prange kernels an OpenBLAS
    call on 2 cores waits milliseconds for the spinning thread pools (prefill of `mini` q8 went
    from 116 to 398 tokens/s), and a token's logits do not depend on how many tokens share the
    call, so routing is the same at any prefill chunk size. (NumPy's einsum, before, took 20-30
    us for one token of `mini`, 64 x 1024, on the EPYC.)
    """
    x = np.ascontiguousarray(x, np.float32)
    weight = np.ascontiguousarray(weight, np.float32)
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise WasteError(f"router logits of x {x.shape} and weight {weight.shape}: expected [T, D] and [E, D]")
    out = np.empty((x.shape[0], weight.shape[0]), np.float32)
    _router_logits(x, weight, out)
    return out


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
) -> tuple[np.ndarray, np.ndarray]:
    """Choose experts from router logits [T, E] -> (ids [T, k] int64 in rank order, weights [T, k] float32)."""
    logits = np.ascontiguousarray(logits, np.float32)
    bias = np.ascontiguousarray(bias, np.float32)
    if logits.ndim != 2:
        raise WasteError(f"router logits must be [T, E], got shape {logits.shape}")
    check_routing(logits.shape[1], bias, top_k=top_k, num_groups=num_groups, topk_group=topk_group,
                  router_weights=router_weights)
    return route_checked(logits, bias, top_k, num_groups, topk_group, renormalize, scaling, router_weights)


def check_routing(E: int, bias: np.ndarray, *, top_k: int, num_groups: int, topk_group: int,
                  router_weights: str) -> None:
    """Raise WasteError unless `route` can choose top_k of E experts with these settings."""
    if bias.shape != (E,):
        raise WasteError(f"e_score_correction_bias must have {E} values, got shape {bias.shape}")
    if router_weights not in ROUTER_WEIGHTS:
        raise WasteError(f"router_weights must be one of {', '.join(ROUTER_WEIGHTS)}, got {router_weights!r}")
    if num_groups < 1 or E % num_groups or not 1 <= topk_group <= num_groups:
        raise WasteError(f"{E} experts cannot form {num_groups} groups keeping {topk_group}")
    if not 1 <= top_k <= E:
        raise WasteError(f"top_k {top_k} must lie in 1..{E}")


def route_checked(logits: np.ndarray, bias: np.ndarray, top_k: int, num_groups: int, topk_group: int,
                  renormalize: bool, scaling: float, router_weights: str) -> tuple[np.ndarray, np.ndarray]:
    """`route` for arguments `check_routing` accepted: contiguous float32 logits [T, E] and bias
    [E] (a MoE layer checks its settings once, not per decoded token)."""
    ids = np.empty((logits.shape[0], top_k), np.int64)
    weights = np.empty((logits.shape[0], top_k), np.float32)
    _route(logits, bias, top_k, num_groups, topk_group, renormalize, np.float32(scaling),
           router_weights == "biased", ids, weights)
    return ids, weights
