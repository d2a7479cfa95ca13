"""The residual stream between layers: a plain running sum (Kimi-Linear) or AttnRes (K3).

Both offer the same four steps, which the one forward driver in `waste.engine.model` calls:

    x = stream.attn_input(layer)     what input_layernorm reads
    stream.add(attn_out)
    x = stream.ffn_input(layer)      what post_attention_layernorm reads
    stream.add(ffn_out)              stream.hidden: the layer's output (observers, waste check)
    h = stream.output()              what the final norm reads

Plain: one h, h += every output; all three inputs are h. Its `add_normed` also normalises the
next input in the same kernel call (the model's driver uses it where no observer could tell).

AttnRes (depth attention over block summaries, FACTS.md "Kimi K3"): a list of stored blocks
b_0.. and a running partial sum p (the embedding at first). Each input is a mix of the
candidates {b_0, .., b_n, p}, weighted by a softmax over the candidates c of
(c . w_eff) / sqrt(mean(c^2) + eps) with w_eff = res_norm * res_proj of that site (just p
while no block exists). Before the attention of a layer l with l % block_size == 0, after
its mix, p is appended to the blocks and restarts from 0; so layer 0 stores the embedding
as b_0, and when block_size does not divide the layer count the last block stays partial.
`hidden` (what observers and `waste check` see after each layer) is the plain residual sum,
the stored blocks plus p: the embedding plus every output so far, as in Kimi-Linear, though
no layer reads it. No state crosses tokens: every token's blocks come from its own column, so a
prefill chunk or decode step starts a fresh stream and sessions hold nothing for it.

Observers with an `on_attn_res(layer, site, positions, weights, mixed)` method see every
mix: site "attn" or "ffn" for layer `layer`, "output" (layer = num_layers) after the last
layer; weights [T, n + 1] float32 are the softmax weights of b_0 .. b_{n-1} and then p (the
last column); mixed [T, hidden] is the mixed input the next norm reads.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from waste.config import ModelConfig
from waste.errors import WasteError
from waste.kernels.attn_res import attn_res_mix_weights
from waste.kernels.norm import add_check_norm


class PlainResidual:
    """h = embedding; h += every attention and FFN output."""

    def __init__(self, embedding: np.ndarray):
        self.hidden = embedding  # [T, hidden] float32

    def attn_input(self, layer: int, positions: np.ndarray, observer: Any) -> np.ndarray:
        return self.hidden

    def ffn_input(self, layer: int, positions: np.ndarray, observer: Any) -> np.ndarray:
        return self.hidden

    def add(self, delta: np.ndarray) -> None:
        self.hidden = self.hidden + delta

    def add_normed(self, delta: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray | None:
        """add(delta), then the next input's RMSNorm with `weight`, in one kernel call; None (and
        nothing added) when delta holds a NaN or an infinity."""
        done = add_check_norm(self.hidden, np.ascontiguousarray(delta, np.float32), weight, eps)
        if done is None:
            return None
        self.hidden, normed = done
        return normed

    def output(self, positions: np.ndarray, observer: Any) -> np.ndarray:
        return self.hidden


class AttnResWeights:
    """The effective mixing vectors w_eff = res_norm * res_proj[0] of every site of a model."""

    def __init__(self, cfg: ModelConfig, attn: list[np.ndarray], ffn: list[np.ndarray], output: np.ndarray):
        if cfg.attn_res_block_size is None:
            raise WasteError("AttnRes needs attn_res_block_size in the config")
        self.block_size = cfg.attn_res_block_size
        self.eps = cfg.rms_norm_eps
        self.num_layers = cfg.num_layers
        self.attn = attn  # [L] of [hidden] float32
        self.ffn = ffn  # [L] of [hidden] float32
        self.output = output  # [hidden] float32

    @classmethod
    def from_weights(cls, cfg: ModelConfig, get_tensor: Any) -> AttnResWeights:
        """Read every `*_res_norm.weight` [hidden] and `*_res_proj.weight` [1, hidden] of a container."""
        D = cfg.hidden_size

        def w_eff(prefix: str) -> np.ndarray:
            norm = np.asarray(get_tensor(f"{prefix}_norm.weight"), np.float32)
            proj = np.asarray(get_tensor(f"{prefix}_proj.weight"), np.float32)
            if norm.shape != (D,):
                raise WasteError(f"{prefix}_norm.weight: expected shape [{D}], got {list(norm.shape)}")
            if proj.shape != (1, D):
                raise WasteError(f"{prefix}_proj.weight: expected shape [1, {D}], got {list(proj.shape)}")
            return np.ascontiguousarray(norm * proj[0])

        layers = range(cfg.num_layers)
        return cls(cfg, [w_eff(f"model.layers.{i}.self_attention_res") for i in layers],
                   [w_eff(f"model.layers.{i}.mlp_res") for i in layers], w_eff("model.output_attn_res"))


class AttnResResidual:
    """Stored blocks plus a running partial sum; every layer input is a depth-attention mix."""

    def __init__(self, weights: AttnResWeights, embedding: np.ndarray):
        self.weights = weights
        # Blocks start at layers 0, S, 2S, ... < L: ceil(L / S) of them, stored in one stack so
        # the mixing kernel reads its first n rows without copying a list.
        count = -(-weights.num_layers // weights.block_size)
        self._stack = np.empty((count, *embedding.shape), np.float32)  # [ceil(L / S), T, hidden]
        self._stored = 0
        self.partial: np.ndarray | None = embedding  # [T, hidden] float32; None right after a block closes

    @property
    def blocks(self) -> np.ndarray:
        """The stored block summaries b_0 .. b_{n-1}: [n, T, hidden] float32."""
        return self._stack[: self._stored]

    def _partial(self) -> np.ndarray:
        if self.partial is None:
            raise WasteError("AttnRes: no partial sum between a block start and the layer's attention")
        return self.partial

    @property
    def hidden(self) -> np.ndarray:
        """The plain residual sum: the stored blocks plus p, i.e. the embedding plus every output so far."""
        return self.blocks.sum(axis=0) + self._partial()

    def _mix(self, w_eff: np.ndarray, layer: int, site: str, positions: np.ndarray, observer: Any) -> np.ndarray:
        p = self._partial()
        hook = getattr(observer, "on_attn_res", None)
        if not self._stored:
            # One candidate: its softmax weight is exactly 1, so the mix is p itself.
            if hook is not None:
                hook(layer, site, positions, np.ones((p.shape[0], 1), np.float32), p)
            return p
        mixed, weights = attn_res_mix_weights(self.blocks, p, w_eff, self.weights.eps)
        if hook is not None:
            hook(layer, site, positions, weights, mixed)
        return mixed

    def attn_input(self, layer: int, positions: np.ndarray, observer: Any) -> np.ndarray:
        x = self._mix(self.weights.attn[layer], layer, "attn", positions, observer)
        if layer % self.weights.block_size == 0:
            self._stack[self._stored] = self._partial()
            self._stored += 1
            self.partial = None
        return x

    def ffn_input(self, layer: int, positions: np.ndarray, observer: Any) -> np.ndarray:
        return self._mix(self.weights.ffn[layer], layer, "ffn", positions, observer)

    def add(self, delta: np.ndarray) -> None:
        # A block restarts p from 0, and 0 + delta is delta exactly.
        self.partial = delta if self.partial is None else self.partial + delta

    def output(self, positions: np.ndarray, observer: Any) -> np.ndarray:
        return self._mix(self.weights.output, self.weights.num_layers, "output", positions, observer)
