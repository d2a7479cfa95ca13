"""The FFN half of a block: routed MoE with shared experts, or the dense SwiGLU of the first layers.

A MoE forward over a chunk of T tokens routes all of them, fetches each unique routed expert
of the chunk once (one `store.get` call, ids sorted) and applies it to every token that chose
it with one matmul per projection over those rows. The dedup ratio T*k / unique says how much
expert traffic the chunk saved against token-by-token execution.

The expert store interface (`waste.engine.experts` implements it):
`store.get(layer_index, expert_ids: list[int]) -> list[(w1 gate, w3 up, w2 down)]` of QMatrix.

Input x is the residual stream after post_attention_layernorm; shapes x, y [T, hidden].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from waste.config import ModelConfig
from waste.errors import WasteError
from waste.kernels.moe import ROUTER_WEIGHTS, route, router_logits, swiglu
from waste.kernels.quant import QMatrix

GetMatrix = Callable[[str], QMatrix]
GetTensor = Callable[[str], np.ndarray]
Expert = tuple[QMatrix, QMatrix, QMatrix]


class ExpertSource(Protocol):
    def get(self, layer_index: int, expert_ids: list[int]) -> Sequence[Expert]: ...


@dataclass
class RoutingInfo:
    """What the router chose for one chunk of one layer."""

    ids: np.ndarray  # [T, k] int64, rank order
    weights: np.ndarray  # [T, k] float32
    unique: np.ndarray  # [U] int64, sorted unique expert ids of the chunk
    dedup_ratio: float  # T*k / U


def _check_act(cfg: ModelConfig) -> None:
    if cfg.hidden_act != "silu":
        raise WasteError(f"hidden_act {cfg.hidden_act!r} is not supported (only 'silu' SwiGLU experts)")


def _mlp(get_matrix: GetMatrix, prefix: str, hidden: int, inner: int) -> Expert:
    """(gate, up, down) of a SwiGLU MLP named `{prefix}{gate,up,down}_proj.weight`, shapes checked."""
    out = []
    for name, shape in (("gate_proj", (inner, hidden)), ("up_proj", (inner, hidden)), ("down_proj", (hidden, inner))):
        m = get_matrix(f"{prefix}{name}.weight")
        if tuple(m.shape) != shape:
            raise WasteError(f"{prefix}{name}.weight: expected shape {list(shape)}, got {list(m.shape)}")
        out.append(m)
    return out[0], out[1], out[2]


class DenseFFN:
    """The dense SwiGLU MLP of layers < first_k_dense_replace: forward(x [T, hidden]) -> y [T, hidden]."""

    def __init__(self, gate: QMatrix, up: QMatrix, down: QMatrix):
        self.gate, self.up, self.down = gate, up, down

    @classmethod
    def from_weights(cls, cfg: ModelConfig, get_matrix: GetMatrix, get_tensor: GetTensor, prefix: str) -> DenseFFN:
        """Build from a container; prefix like 'model.layers.0.mlp.'."""
        _check_act(cfg)
        return cls(*_mlp(get_matrix, prefix, cfg.hidden_size, cfg.intermediate_size))

    def forward(self, x: np.ndarray) -> np.ndarray:
        return swiglu(x, self.gate, self.up, self.down)


class MoELayer:
    """Sigmoid-routed MoE with shared experts; routed experts come from an expert store."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_index: int,
        router_weight: np.ndarray,
        score_bias: np.ndarray,
        shared: Expert | None,
        router_weights: str = "unbiased",
    ):
        if router_weights not in ROUTER_WEIGHTS:
            raise WasteError(f"router_weights must be one of {', '.join(ROUTER_WEIGHTS)}, got {router_weights!r}")
        self.layer_index = layer_index
        self.router_weight = np.ascontiguousarray(router_weight, np.float32)  # [E, hidden]
        self.score_bias = np.ascontiguousarray(score_bias, np.float32)  # [E]
        self.shared = shared
        self.router_weights = router_weights
        self.top_k = cfg.num_experts_per_token
        self.num_groups = cfg.num_expert_group
        self.topk_group = cfg.topk_group
        self.renormalize = cfg.moe_renormalize
        self.scaling = cfg.routed_scaling_factor
        self.hidden = cfg.hidden_size

    @classmethod
    def from_weights(
        cls,
        cfg: ModelConfig,
        get_matrix: GetMatrix,
        get_tensor: GetTensor,
        prefix: str,
        layer_index: int,
        router_weights: str = "unbiased",
    ) -> MoELayer:
        """Build from a container; prefix like 'model.layers.3.block_sparse_moe.'."""
        _check_act(cfg)
        if cfg.routed_expert_hidden_size is not None:
            raise WasteError("latent MoE (routed_expert_hidden_size) is not supported")
        E, hidden = cfg.num_experts, cfg.hidden_size
        w = np.asarray(get_tensor(prefix + "gate.weight"), np.float32)
        if w.shape != (E, hidden):
            raise WasteError(f"{prefix}gate.weight: expected shape {[E, hidden]}, got {list(w.shape)}")
        b = np.asarray(get_tensor(prefix + "gate.e_score_correction_bias"), np.float32).reshape(-1)
        if b.shape != (E,):
            raise WasteError(f"{prefix}gate.e_score_correction_bias: expected {E} values, got {list(b.shape)}")
        shared = None
        if cfg.num_shared_experts:
            inner = cfg.moe_intermediate_size * cfg.num_shared_experts
            shared = _mlp(get_matrix, prefix + "shared_experts.", hidden, inner)
        return cls(cfg, layer_index, w, b, shared, router_weights)

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x [T, hidden] -> (ids [T, k] int64 in rank order, weights [T, k] float32)."""
        return route(
            router_logits(x, self.router_weight), self.score_bias, top_k=self.top_k, num_groups=self.num_groups,
            topk_group=self.topk_group, renormalize=self.renormalize, scaling=self.scaling,
            router_weights=self.router_weights,
        )

    def forward(self, x: np.ndarray, store: ExpertSource) -> tuple[np.ndarray, RoutingInfo]:
        """x [T, hidden] -> (y [T, hidden], RoutingInfo); each unique expert fetched once."""
        x = np.ascontiguousarray(x, np.float32)
        if x.ndim != 2 or x.shape[1] != self.hidden:
            raise WasteError(f"MoE input must be [T, {self.hidden}], got shape {x.shape}")
        ids, weights = self.route(x)
        unique = np.unique(ids)
        experts = store.get(self.layer_index, [int(e) for e in unique])
        if len(experts) != len(unique):
            raise WasteError(f"expert store returned {len(experts)} experts for {len(unique)} requested ids")
        y = np.zeros_like(x)
        if x.shape[0] == 1:
            # Decode: the same sums in the same (sorted id) order without the row bookkeeping
            # below, which cost about 60 us per layer per token on `mini`.
            rank = {e: r for r, e in enumerate(ids[0].tolist())}
            for e, (w1, w3, w2) in zip(unique.tolist(), experts, strict=True):
                y += weights[0, rank[e]] * swiglu(x, w1, w3, w2)
        else:
            for e, (w1, w3, w2) in zip(unique, experts, strict=True):
                # Top-k ids are distinct per token, so each row appears at most once here.
                rows, ranks = np.nonzero(ids == e)
                y[rows] += weights[rows, ranks, None] * swiglu(x[rows], w1, w3, w2)
        if self.shared is not None:
            y += swiglu(x, *self.shared)
        info = RoutingInfo(ids, weights, unique, ids.size / max(len(unique), 1))
        return y, info
