"""K3's latent MoE: route on the full width, run the routed experts in a narrower latent width.

    ids, w = route(x)                                  # on the full hidden x, as MoELayer
    z = routed_expert_down_proj x                      # [T, R], R = routed_expert_hidden_size
    y = sum_i w_i expert_i(z)                          # experts: gate/up [I, R], down [R, I]
    y = RMSNorm(y; routed_expert_norm)                 # only with latent_moe_use_norm
    y = routed_expert_up_proj y + shared(x)            # [T, hidden]; shared experts on the full x

Everything else (routing, the expert store, dedup per chunk, the MLP activation) is MoELayer's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from waste.config import ModelConfig
from waste.engine.moe_layer import ExpertSource, GetMatrix, GetTensor, MoELayer, RoutingInfo, router_and_shared
from waste.errors import WasteError
from waste.kernels.norm import rms_norm
from waste.kernels.quant import QMatrix


class LatentMoELayer(MoELayer):
    """A MoELayer whose routed experts read and write the latent width R."""

    def __init__(self, cfg: ModelConfig, layer_index: int, router_weight: np.ndarray, score_bias: np.ndarray,
                 shared: tuple[QMatrix, QMatrix, QMatrix] | None, down_proj: QMatrix, up_proj: QMatrix,
                 norm: np.ndarray | None, router_weights: str = "unbiased"):
        super().__init__(cfg, layer_index, router_weight, score_bias, shared, router_weights)
        self.down_proj = down_proj  # [R, hidden]
        self.up_proj = up_proj  # [hidden, R]
        self.norm = norm  # [R] float32 or None
        self.eps = cfg.rms_norm_eps

    @classmethod
    def from_weights(cls, cfg: ModelConfig, get_matrix: GetMatrix, get_tensor: GetTensor, prefix: str,
                     layer_index: int, router_weights: str = "unbiased") -> LatentMoELayer:
        """Build from a container; prefix like 'model.layers.3.block_sparse_moe.'."""
        R, D = cfg.routed_expert_hidden_size, cfg.hidden_size
        if R is None:
            raise WasteError("a LatentMoELayer needs routed_expert_hidden_size in the config")
        projections = []
        for name, shape in (("routed_expert_down_proj", (R, D)), ("routed_expert_up_proj", (D, R))):
            m = get_matrix(f"{prefix}{name}.weight")
            if tuple(m.shape) != shape:
                raise WasteError(f"{prefix}{name}.weight: expected shape {list(shape)}, got {list(m.shape)}")
            projections.append(m)
        norm = None
        if cfg.latent_moe_use_norm:
            norm = np.asarray(get_tensor(prefix + "routed_expert_norm.weight"), np.float32)
            if norm.shape != (R,):
                raise WasteError(f"{prefix}routed_expert_norm.weight: expected shape [{R}], got {list(norm.shape)}")
        return cls(cfg, layer_index, *router_and_shared(cfg, get_matrix, get_tensor, prefix), *projections, norm,
                   router_weights)

    def forward(self, x: np.ndarray, store: ExpertSource,
                then: Callable[[], None] | None = None) -> tuple[np.ndarray, RoutingInfo]:
        """x [T, hidden] -> (y [T, hidden], RoutingInfo); `then` as in `MoELayer.routed`."""
        x = self._check_input(x)
        y, info = self.routed(x, self.down_proj.matmul(x), store, then=then)
        if self.norm is not None:
            y = rms_norm(y, self.norm, self.eps)
        y = self.up_proj.matmul(y)
        if self.shared is not None:
            y += self.mlp(x, *self.shared)
        return y, info
