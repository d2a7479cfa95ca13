"""The float64 whole-model oracle: block structure, invariants, and agreement with the engine's layers.

An in-memory fake container (random weights under the checkpoint names) keeps most tests
independent of synth/convert; one test runs the oracle on real tiny containers.

Composition check tolerance: the engine layers run in float32 through 5 layers of a 64-wide
model; relative error per layer stays near 1e-6, compared at 1e-5 of each array's scale.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FakeContainer, max_rel_err

from waste.config import ModelConfig, parse_config
from waste.container.reader import open_container
from waste.engine.mla_layer import MLALayer
from waste.engine.moe_layer import DenseFFN, MoELayer
from waste.errors import WasteError
from waste.kernels.quant import QMatrix
from waste.reference.model import ReferenceModel
from waste.testing import tiny_config, tiny_container

RTOL = 1e-5
ALL_MLA = {"linear_attn_config": {"kda_layers": [], "full_attn_layers": [1, 2, 3, 4, 5]}}


class Store:
    def __init__(self, container: FakeContainer):
        self.container = container

    def get(self, layer_index: int, expert_ids: list[int]) -> list[tuple[QMatrix, QMatrix, QMatrix]]:
        return [self.container.expert(layer_index, e) for e in expert_ids]


def _cfg(**overrides) -> ModelConfig:
    return parse_config(tiny_config(**overrides))


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]



def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w).astype(np.float32)


@pytest.mark.parametrize("q_lora", [None, 24])
def test_matches_engine_layers_composed_by_hand(q_lora: int | None) -> None:
    """An all-MLA model: the float32 engine layers chained per FACTS.md reproduce every hidden state."""
    overrides = dict(ALL_MLA, num_expert_group=4, topk_group=2)
    if q_lora is not None:
        overrides.update(q_lora_rank=q_lora, mla_use_output_gate=True)
    cfg = _cfg(**overrides)
    c = FakeContainer(cfg, seed=1)
    ids = _ids(19, cfg.vocab_size, seed=1)
    ref = ReferenceModel(c).forward(ids)
    assert len(ref.hidden_states) == cfg.num_layers + 1
    assert ref.logits.shape == (19, cfg.vocab_size) and ref.logits.dtype == np.float64

    store = Store(c)
    h = c.arrays["model.embed_tokens.weight"][ids]
    np.testing.assert_array_equal(ref.hidden_states[0], h)
    eps = cfg.rms_norm_eps
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = MLALayer.from_weights(cfg, c.matrix, c.tensor, p + "self_attn.")
        h = h + attn.prefill(_rms(h, c.arrays[p + "input_layernorm.weight"], eps), attn.new_cache(len(ids)))
        x = _rms(h, c.arrays[p + "post_attention_layernorm.weight"], eps)
        if i < cfg.first_k_dense_replace:
            h = h + DenseFFN.from_weights(cfg, c.matrix, c.tensor, p + "mlp.").forward(x)
        else:
            y, info = MoELayer.from_weights(cfg, c.matrix, c.tensor, p + "block_sparse_moe.", i).forward(x, store)
            np.testing.assert_array_equal(info.ids, ref.routing[i])
            h = h + y
        assert max_rel_err(h, ref.hidden_states[i + 1]) <= RTOL, f"layer {i}"
    logits = _rms(h, c.arrays["model.norm.weight"], eps) @ c.arrays["lm_head.weight"].T
    assert max_rel_err(logits, ref.logits) <= RTOL
    assert sorted(ref.routing) == cfg.moe_layers


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": 24, "mla_use_output_gate": True,
                                             "linear_attn_config": {"gate_lower_bound": -5.0,
                                                                    "use_full_rank_gate": True}}])
def test_causal(overrides: dict) -> None:
    cfg = _cfg(**overrides)
    oracle = ReferenceModel(FakeContainer(cfg, seed=2))
    ids = _ids(12, cfg.vocab_size, seed=2)
    full = oracle.forward(ids)
    changed = oracle.forward(ids[:7] + _ids(5, cfg.vocab_size, seed=3))
    np.testing.assert_array_equal(full.logits[:7], changed.logits[:7])
    for a, b in zip(full.hidden_states, changed.hidden_states, strict=True):
        np.testing.assert_array_equal(a[:7], b[:7])
    assert not np.allclose(full.logits[7:], changed.logits[7:])
    prefix = oracle.forward(ids[:7])
    np.testing.assert_allclose(prefix.logits, full.logits[:7], rtol=1e-12, atol=1e-12)


def test_router_weight_modes() -> None:
    cfg = _cfg()
    c = FakeContainer(cfg, seed=4)
    ids = _ids(10, cfg.vocab_size, seed=4)
    unbiased = ReferenceModel(c).forward(ids)
    biased = ReferenceModel(c, router_weights="biased").forward(ids)
    np.testing.assert_array_equal(unbiased.hidden_states[1], biased.hidden_states[1])  # dense layer 0
    assert not np.allclose(unbiased.logits, biased.logits)
    for layer in cfg.moe_layers:
        c.arrays[f"model.layers.{layer}.block_sparse_moe.gate.e_score_correction_bias"][:] = 0
    # With a zero correction bias the two modes are the same model.
    a = ReferenceModel(c).forward(ids)
    b = ReferenceModel(c, router_weights="biased").forward(ids)
    np.testing.assert_array_equal(a.logits, b.logits)


def test_tied_embeddings_and_weight_cache() -> None:
    cfg = _cfg(tie_word_embeddings=True)
    c = FakeContainer(cfg, seed=5)
    assert not c.has("lm_head.weight")
    oracle = ReferenceModel(c, cache_bytes=0)
    out = oracle.forward([3, 1, 4])
    assert oracle._cached == 0
    h = out.hidden_states[-1]
    x = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + cfg.rms_norm_eps) * c.arrays["model.norm.weight"]
    np.testing.assert_allclose(out.logits, x @ c.arrays["model.embed_tokens.weight"].T.astype(np.float64),
                               rtol=1e-12, atol=1e-12)
    cached = ReferenceModel(c)
    np.testing.assert_array_equal(cached.forward([3, 1, 4]).logits, out.logits)
    assert cached._cached > 0


def test_bad_input_is_refused() -> None:
    cfg = _cfg()
    oracle = ReferenceModel(FakeContainer(cfg))
    with pytest.raises(WasteError, match="outside the vocabulary"):
        oracle.forward([1, cfg.vocab_size])
    with pytest.raises(WasteError, match="at least one"):
        oracle.forward([])
    with pytest.raises(WasteError, match="router_weights"):
        ReferenceModel(FakeContainer(cfg), router_weights="both")


@pytest.mark.parametrize("name", ["kimi-linear", "k3-gates"])
def test_runs_on_tiny_containers(tmp_path_factory, name: str) -> None:
    overrides = {} if name == "kimi-linear" else {
        "q_lora_rank": 24, "mla_use_output_gate": True,
        "linear_attn_config": {"gate_lower_bound": -5.0, "use_full_rank_gate": True},
    }
    path = tiny_container(tmp_path_factory, quant="f32", overrides=overrides)
    with open_container(path) as c:
        cfg = c.config
        oracle = ReferenceModel(c)
        ids = _ids(40, cfg.vocab_size, seed=6)
        out = oracle.forward(ids)
        assert out.logits.shape == (40, cfg.vocab_size)
        assert len(out.hidden_states) == cfg.num_layers + 1
        assert all(np.all(np.isfinite(h)) for h in out.hidden_states)
        np.testing.assert_array_equal(out.hidden_states[0], c.matrix("model.embed_tokens.weight").dequantize()[ids])
        # The MLA and MoE pieces agree with the engine's layer objects on the container's weights.
        layer = cfg.mla_layers[0]
        p = f"model.layers.{layer}."
        x = np.random.default_rng(7).standard_normal((9, cfg.hidden_size)).astype(np.float32)
        attn = MLALayer.from_weights(cfg, c.matrix, c.tensor, p + "self_attn.")
        assert max_rel_err(attn.prefill(x, attn.new_cache(9)), oracle.mla(layer, x.astype(np.float64))) <= RTOL
        moe = MoELayer.from_weights(cfg, c.matrix, c.tensor, p + "block_sparse_moe.", layer)
        y, info = moe.forward(x, Store(c))
        ref_y, ref_ids = oracle.ffn(layer, x.astype(np.float64))
        np.testing.assert_array_equal(info.ids, ref_ids)
        assert max_rel_err(y, ref_y) <= RTOL
