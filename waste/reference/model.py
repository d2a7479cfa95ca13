"""Float64 whole-model oracle: the forward pass over a whole sequence, no cache, plain loops.

It reads the same container as the engine and shares nothing with the engine or the kernels:
only the config, the container reader's interface (a matrix's format name, shape and raw
buffers) and the float64 helpers in `waste.reference`. Weights are dequantised to float64 by
`waste.reference.quant.reference_dequantize`, which decodes the raw buffers itself; the
embedding lookup decodes only the rows in use. tests/reference/test_independence.py checks
that nothing under waste/reference/ imports waste.kernels or waste.engine. Block structure (FACTS.md):

    h = embed(ids)
    per layer l: h += attn(RMSNorm(h)); h += ffn(RMSNorm(h))     -> hidden_states[l + 1]
    logits = lm_head(RMSNorm(h))

attn is KDA (`waste.reference.kda`) or MLA (`waste.reference.mla`); ffn is the dense SwiGLU
for l < first_k_dense_replace, else the routed MoE (`waste.reference.moe`) with the router
computed in float64 too (a float32 engine can only differ on near-ties of the top-k).

With `round_activations` the oracle becomes the engine's rounding model: every product over a
matrix stored as q8g, q4g or mxfp4 first rounds its input to int8 per group of 32 (scale amax / 127,
docs/QUANT.md "Activations"), and over bf16 to bfloat16, in float64 otherwise; f32 matrices, the
embedding lookup and MLA's kv_b_proj (applied in float32 by the engine) round nothing. `waste check`
derives its tolerance from how far this oracle moves from the exact one.

The container offers `.config`, `.tensor(name)` (float32 arrays), `.matrix(name)` and
`.expert(layer, e) -> (w1, w3, w2)` (objects with `.fmt`, `.shape` and `.buffers`), and `.has(name)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from waste.errors import WasteError
from waste.reference.k3 import attn_res_mix, situ_mlp
from waste.reference.kda import naive_kda_layer
from waste.reference.latent_moe import MLP, latent_moe_ffn
from waste.reference.mla import naive_mla_layer, rms_norm
from waste.reference.moe import moe_ffn, swiglu
from waste.reference.quant import ACTIVATION_ROUNDING, RoundedInputWeights, reference_dequantize

ROUTER_WEIGHTS = ("unbiased", "biased")
LM_HEAD_BLOCK = 2048  # vocabulary rows decoded to float64 at a time (bounds the temporaries)


def gated_mlp(cfg: Any) -> MLP:
    """The float64 gated MLP of the config's hidden_act: SwiGLU ("silu") or SiTU ("situ")."""
    if cfg.hidden_act == "silu":
        return swiglu
    return lambda x, gate, up, down: situ_mlp(x, gate, up, down, cfg.situ_beta, cfg.situ_linear_beta)


@dataclass
class ReferenceOutput:
    """logits [T, vocab]; hidden_states: L + 1 arrays [T, hidden] (embedding, then each layer's output,
    before the final norm; with AttnRes the stored blocks plus the partial sum, i.e. still the
    embedding plus every output so far); routing: MoE layer
    index -> expert ids [T, k] in rank order."""

    logits: np.ndarray
    hidden_states: list[np.ndarray]
    routing: dict[int, np.ndarray] = field(default_factory=dict)


class ReferenceModel:
    """The float64 forward over an open container."""

    def __init__(self, container: Any, *, router_weights: str = "unbiased", cache_bytes: int = 1 << 30,
                 round_activations: bool = False):
        if router_weights not in ROUTER_WEIGHTS:
            raise WasteError(f"router_weights must be one of {', '.join(ROUTER_WEIGHTS)}, got {router_weights!r}")
        cfg = container.config
        self.container = container
        self.config = cfg
        self.mlp = gated_mlp(cfg)  # SwiGLU or SiTU: dense, shared and routed experts alike
        self.router_weights = router_weights
        self.round_activations = round_activations  # the engine's rounding model (module docstring)
        # Dequantised float64 weights are kept while they fit this budget, so repeated forwards
        # on a tiny model do not dequantise again; past it they are rebuilt on every use.
        self.cache_bytes = cache_bytes
        self._cache: dict[Any, Any] = {}
        self._cached = 0

    def _keep(self, key: Any, value: Any, nbytes: int) -> Any:
        if self._cached + nbytes <= self.cache_bytes:
            self._cache[key] = value
            self._cached += nbytes
        return value

    def _product_weights(self, m: Any) -> np.ndarray | RoundedInputWeights:
        """A stored matrix as float64 weights, rounding its products' inputs under `round_activations`."""
        w = reference_dequantize(m)
        return RoundedInputWeights(w, m.fmt) if self._rounds(m.fmt) else w

    def _rounds(self, fmt: str) -> bool:
        return self.round_activations and fmt in ACTIVATION_ROUNDING

    def matrix(self, name: str) -> np.ndarray | RoundedInputWeights:
        """A weight matrix dequantised to float64."""
        if name not in self._cache:
            w = self._product_weights(self.container.matrix(name))
            return self._keep(name, w, np.asarray(w).nbytes)
        return self._cache[name]

    def tensor(self, name: str) -> np.ndarray:
        """A float32 container array as float64."""
        if name not in self._cache:
            t = np.asarray(self.container.tensor(name), np.float64)
            return self._keep(name, t, t.nbytes)
        return self._cache[name]

    def expert(self, layer: int, e: int) -> tuple[np.ndarray | RoundedInputWeights, ...]:
        """Routed expert e of a layer as float64 (w1 gate, w3 up, w2 down)."""
        key = ("expert", layer, e)
        if key not in self._cache:
            w = tuple(self._product_weights(m) for m in self.container.expert(layer, e))
            return self._keep(key, w, sum(np.asarray(a).nbytes for a in w))
        return self._cache[key]

    def _embed(self, ids: np.ndarray) -> np.ndarray:
        # Only the rows in use: the full float64 table of a real vocabulary would not fit.
        return reference_dequantize(self.container.matrix("model.embed_tokens.weight"), rows=ids)

    def _lm_head(self, x: np.ndarray) -> np.ndarray:
        name = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        m = self.container.matrix(name)
        vocab = m.shape[0]
        if self._rounds(m.fmt):
            x = ACTIVATION_ROUNDING[m.fmt](x)
        logits = np.empty((x.shape[0], vocab))
        for r in range(0, vocab, LM_HEAD_BLOCK):
            rows = np.arange(r, min(vocab, r + LM_HEAD_BLOCK))
            logits[:, r : r + rows.size] = x @ reference_dequantize(m, rows=rows).T
        return logits

    def mla(self, layer: int, x: np.ndarray) -> np.ndarray:
        """MLA layer `layer` on x [T, hidden] (after input_layernorm) -> [T, hidden]."""
        cfg = self.config
        p = f"model.layers.{layer}.self_attn."
        names = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
        names += ["q_proj"] if cfg.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
        names += ["g_proj"] if cfg.mla_output_gate else []
        w = {n: self.matrix(f"{p}{n}.weight") for n in names}
        w["kv_a_layernorm"] = self.tensor(p + "kv_a_layernorm.weight")
        if cfg.q_lora_rank is not None:
            w["q_a_layernorm"] = self.tensor(p + "q_a_layernorm.weight")
        return naive_mla_layer(x, w, cfg)

    def kda(self, layer: int, x: np.ndarray) -> np.ndarray:
        """KDA layer `layer` on x [T, hidden] (after input_layernorm) -> [T, hidden]."""
        cfg = self.config
        p = f"model.layers.{layer}.self_attn."
        names = ["q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "o_proj"]
        names += ["g_proj"] if cfg.kda_full_rank_gate else ["g_a_proj", "g_b_proj"]
        w = {f"{n}.weight": self.matrix(f"{p}{n}.weight") for n in names}
        for n in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight", "A_log", "dt_bias"):
            w[n] = self.tensor(p + n)
        return naive_kda_layer(x, w, cfg)[0]

    def ffn(self, layer: int, x: np.ndarray, forced_ids: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray | None]:
        """FFN of `layer` on x [T, hidden] (after post_attention_layernorm) -> (y, routed ids or None).

        The ids are the oracle's own choice; `forced_ids` [T, k] sets the experts applied instead.
        """
        cfg = self.config
        if layer < cfg.first_k_dense_replace:
            p = f"model.layers.{layer}.mlp."
            return self.mlp(x, *(self.matrix(f"{p}{n}_proj.weight") for n in ("gate", "up", "down"))), None
        p = f"model.layers.{layer}.block_sparse_moe."
        shared = None
        if cfg.num_shared_experts:
            shared = tuple(self.matrix(f"{p}shared_experts.{n}_proj.weight") for n in ("gate", "up", "down"))
        route_options = dict(
            top_k=cfg.num_experts_per_token, num_groups=cfg.num_expert_group, topk_group=cfg.topk_group,
            renormalize=cfg.moe_renormalize, scaling=cfg.routed_scaling_factor, router_weights=self.router_weights,
        )
        router, bias = self.tensor(p + "gate.weight"), self.tensor(p + "gate.e_score_correction_bias")
        if cfg.routed_expert_hidden_size is not None:
            norm = self.tensor(p + "routed_expert_norm.weight") if cfg.latent_moe_use_norm else None
            return latent_moe_ffn(
                x, router, bias, lambda e: self.expert(layer, e), shared,
                self.matrix(p + "routed_expert_down_proj.weight"), self.matrix(p + "routed_expert_up_proj.weight"),
                norm, mlp=self.mlp, eps=cfg.rms_norm_eps, route_options=route_options, forced_ids=forced_ids,
            )
        y, ids, _ = moe_ffn(x, router, bias, lambda e: self.expert(layer, e), shared, forced_ids=forced_ids,
                            mlp=self.mlp, **route_options)
        return y, ids

    def attn_res(self, prefix: str, blocks: list[np.ndarray], partial: np.ndarray) -> np.ndarray:
        """AttnRes mix at one site (prefix like 'model.layers.3.mlp_res') of the stored blocks and
        the partial sum, each [T, hidden] -> [T, hidden]; just the partial sum while no block exists."""
        if not blocks:
            return partial
        w_eff = self.tensor(prefix + "_norm.weight") * self.tensor(prefix + "_proj.weight").reshape(-1)
        mixed, _ = attn_res_mix(blocks, partial, w_eff, self.config.rms_norm_eps)
        return mixed

    def forward(self, ids: Sequence[int], forced_routing: dict[int, np.ndarray] | None = None) -> ReferenceOutput:
        """Token ids [T] -> logits [T, vocab] float64 and every layer's hidden state.

        `forced_routing` {MoE layer: ids [T, k]} makes those layers apply the given experts
        (e.g. the engine's) while `routing` still reports the oracle's own choice.

        With AttnRes (K3, `attn_res_block_size` = S) h is the partial sum of the current block:
        each norm reads the mix of the stored blocks and h at its site; before the attention of
        a layer l with l % S == 0, after its mix, h is stored as a block and restarts from 0;
        after the last layer the output site's mix is what the final norm reads.
        """
        cfg = self.config
        a = np.asarray(ids, np.int64).reshape(-1)
        if a.size == 0:
            raise WasteError("the reference model needs at least one token id")
        bad = a[(a < 0) | (a >= cfg.vocab_size)]
        if bad.size:
            raise WasteError(f"token id {int(bad[0])} is outside the vocabulary 0..{cfg.vocab_size - 1}")
        h = self._embed(a)
        hidden = [h]
        routing = {}
        eps = cfg.rms_norm_eps
        block_size = cfg.attn_res_block_size
        blocks: list[np.ndarray] = []  # AttnRes block summaries b_0, b_1, ... (none without AttnRes)
        for layer, kind in enumerate(cfg.layer_kinds):
            p = f"model.layers.{layer}."
            attn_in = self.attn_res(p + "self_attention_res", blocks, h) if block_size else h
            if block_size and layer % block_size == 0:
                blocks.append(h)
                h = np.zeros_like(h)
            x = rms_norm(attn_in, self.tensor(p + "input_layernorm.weight"), eps)
            h = h + (self.mla(layer, x) if kind == "mla" else self.kda(layer, x))
            ffn_in = self.attn_res(p + "mlp_res", blocks, h) if block_size else h
            x = rms_norm(ffn_in, self.tensor(p + "post_attention_layernorm.weight"), eps)
            y, routed = self.ffn(layer, x, None if forced_routing is None else forced_routing.get(layer))
            if routed is not None:
                routing[layer] = routed
            h = h + y
            hidden.append(sum(blocks, h))
        if block_size:
            h = self.attn_res("model.output_attn_res", blocks, h)
        logits = self._lm_head(rms_norm(h, self.tensor("model.norm.weight"), eps))
        return ReferenceOutput(logits, hidden, routing)
