"""MoELayer and DenseFFN (float32, QMatrix, expert store) against the float64 MoE oracle.

Tolerance 1e-5 of the output scale (float32 matmuls over <= 64 inputs; see
tests/kernels/test_moe.py). Routing ids must agree exactly: the test inputs keep corrected
scores far from ties at float32 resolution.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close

from waste.config import ModelConfig, parse_config, preset_dict
from waste.engine import moe_layer
from waste.engine.expert_store import Arrivals
from waste.engine.moe_layer import DenseFFN, MoELayer
from waste.errors import WasteError
from waste.kernels.quant import QMatrix, quantize
from waste.reference.moe import moe_ffn, swiglu

RTOL = 1e-5
LAYER = 2
PREFIX = f"model.layers.{LAYER}.block_sparse_moe."


class FakeStore:
    """The expert store interface over a dict {(layer, e): (w1, w3, w2)}; records every call."""

    def __init__(self, experts: dict[tuple[int, int], tuple[QMatrix, QMatrix, QMatrix]]):
        self.experts = experts
        self.calls: list[tuple[int, list[int]]] = []

    def get(self, layer_index: int, expert_ids: list[int]) -> list[tuple[QMatrix, QMatrix, QMatrix]]:
        self.calls.append((layer_index, list(expert_ids)))
        return [self.experts[layer_index, e] for e in expert_ids]


def _config(**overrides) -> ModelConfig:
    hf = preset_dict("tiny")
    hf.update(num_experts=16, num_experts_per_token=3, num_expert_group=4, topk_group=2, num_shared_experts=2)
    hf.update(overrides)
    return parse_config(hf)


def _random(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    return (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)


def _build(cfg: ModelConfig, rng: np.random.Generator, router_weights: str = "unbiased"):
    d, inner = cfg.hidden_size, cfg.moe_intermediate_size
    arrays = {
        "gate.weight": rng.standard_normal((cfg.num_experts, d)).astype(np.float32),
        "gate.e_score_correction_bias": (0.1 * rng.standard_normal(cfg.num_experts)).astype(np.float32),
    }
    shared_inner = inner * cfg.num_shared_experts
    for n, s in (("gate_proj", (shared_inner, d)), ("up_proj", (shared_inner, d)), ("down_proj", (d, shared_inner))):
        arrays[f"shared_experts.{n}.weight"] = _random(rng, s)
    experts = {
        (LAYER, e): tuple(quantize(_random(rng, s), "f32") for s in ((inner, d), (inner, d), (d, inner)))
        for e in range(cfg.num_experts)
    }
    layer = MoELayer.from_weights(
        cfg, lambda n: quantize(arrays[n.removeprefix(PREFIX)], "f32"), lambda n: arrays[n.removeprefix(PREFIX)],
        PREFIX, LAYER, router_weights=router_weights,
    )
    return layer, arrays, FakeStore(experts)


def _reference(cfg: ModelConfig, arrays, store: FakeStore, x: np.ndarray, router_weights: str = "unbiased"):
    def f64(m: QMatrix) -> np.ndarray:
        return m.dequantize().astype(np.float64)

    shared = None
    if cfg.num_shared_experts:
        shared = tuple(arrays[f"shared_experts.{n}.weight"].astype(np.float64)
                       for n in ("gate_proj", "up_proj", "down_proj"))
    return moe_ffn(
        x, arrays["gate.weight"], arrays["gate.e_score_correction_bias"],
        lambda e: tuple(f64(m) for m in store.experts[LAYER, e]), shared,
        top_k=cfg.num_experts_per_token, num_groups=cfg.num_expert_group, topk_group=cfg.topk_group,
        renormalize=cfg.moe_renormalize, scaling=cfg.routed_scaling_factor, router_weights=router_weights,
    )



@pytest.mark.parametrize("router_weights", ["unbiased", "biased"])
def test_forward_matches_reference_and_fetches_each_expert_once(router_weights: str) -> None:
    cfg = _config()
    rng = np.random.default_rng(11 if router_weights == "biased" else 12)
    layer, arrays, store = _build(cfg, rng, router_weights)
    T = 20
    x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
    y, info = layer.forward(x, store)
    want, ids, weights = _reference(cfg, arrays, store, x, router_weights)
    assert_close(y, want, RTOL)
    np.testing.assert_array_equal(info.ids, ids)
    np.testing.assert_allclose(info.weights, weights, rtol=1e-6)
    assert info.ids.dtype == np.int64 and info.weights.dtype == np.float32
    assert store.calls == [(LAYER, sorted(set(ids.ravel().tolist())))]
    np.testing.assert_array_equal(info.unique, store.calls[0][1])
    assert info.dedup_ratio == pytest.approx(T * cfg.num_experts_per_token / len(info.unique))
    assert info.dedup_ratio > 1


class MappedStore(FakeStore):
    """A store that maps every expert, as the memory-mapped one does: a decode step whose experts
    all have rows runs through the layer's expert tables (routing and experts in one call)."""

    maps_every_expert = True

    def count_request(self, layer_index: int, unique: np.ndarray) -> None:
        pass

    def handed_out(self, layer_index: int, e: int) -> tuple[QMatrix, QMatrix, QMatrix]:
        return self.experts[layer_index, e]


@pytest.mark.parametrize("router_weights", ["unbiased", "biased"])
def test_decode_through_the_expert_tables_matches_reference(router_weights: str) -> None:
    """The decode step `waste run` takes over a map (routing inside the tables' kernel) chooses
    and weighs the experts as the reference does in either router mode: the steps above run
    the prefill's path and would not see the tables read the mode wrongly. (One shared expert,
    as wide as a routed one: twice as wide, they would not run together.)"""
    cfg = _config(num_shared_experts=1)
    rng = np.random.default_rng(23)
    layer, arrays, store = _build(cfg, rng, router_weights)
    mapped = MappedStore(store.experts)
    layer.forward(rng.standard_normal((40, cfg.hidden_size)).astype(np.float32), mapped)  # every expert gets rows
    for _ in range(4):
        x = rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)
        fetched = len(mapped.calls)
        y, info = layer.forward(x, mapped)
        assert len(mapped.calls) == fetched  # through the tables: nothing asked of the store
        want, ids, weights = _reference(cfg, arrays, store, x, router_weights)
        assert_close(y, want, RTOL)
        np.testing.assert_array_equal(info.ids, ids)
        np.testing.assert_allclose(info.weights, weights, rtol=1e-6)


class ReversedFetchStore(FakeStore):
    """A store whose `fetch` hands the experts out last id first, as a slow read might."""

    def fetch(self, layer_index: int, expert_ids: list[int]):
        return reversed(list(enumerate(self.get(layer_index, expert_ids))))


@pytest.mark.parametrize("T", [1, 9])
def test_arrival_order_does_not_change_the_bits(T: int) -> None:
    """Outputs are summed in id order whatever order the store hands the experts out in."""
    cfg = _config()
    rng = np.random.default_rng(17)
    layer, _, store = _build(cfg, rng)
    x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
    y, info = layer.forward(x, store)
    y_rev, info_rev = layer.forward(x, ReversedFetchStore(store.experts))
    np.testing.assert_array_equal(y_rev, y)
    np.testing.assert_array_equal(info_rev.ids, info.ids)


def test_router_modes_differ_only_in_weights() -> None:
    cfg = _config()
    rng = np.random.default_rng(13)
    x = rng.standard_normal((8, cfg.hidden_size)).astype(np.float32)
    unbiased, arrays, store = _build(cfg, np.random.default_rng(14))
    biased, _, _ = _build(cfg, np.random.default_rng(14), "biased")
    y0, i0 = unbiased.forward(x, store)
    y1, i1 = biased.forward(x, store)
    np.testing.assert_array_equal(i0.ids, i1.ids)
    assert not np.allclose(i0.weights, i1.weights)
    np.testing.assert_allclose(i0.weights.sum(axis=1), cfg.routed_scaling_factor, rtol=1e-6)
    np.testing.assert_allclose(i1.weights.sum(axis=1), cfg.routed_scaling_factor, rtol=1e-6)
    assert not np.allclose(y0, y1)


def test_tokens_are_independent() -> None:
    cfg = _config(num_expert_group=1, topk_group=1, num_shared_experts=1)
    rng = np.random.default_rng(15)
    layer, _, store = _build(cfg, rng)
    x = rng.standard_normal((12, cfg.hidden_size)).astype(np.float32)
    y, _ = layer.forward(x, store)
    for t in (0, 5, 11):
        yt, info = layer.forward(x[t : t + 1], store)
        assert_close(yt[0], y[t], RTOL)
        assert info.dedup_ratio == 1.0


def test_without_shared_experts() -> None:
    cfg = _config(num_shared_experts=0)
    rng = np.random.default_rng(16)
    layer, arrays, store = _build(cfg, rng)
    assert layer.shared is None
    x = rng.standard_normal((5, cfg.hidden_size)).astype(np.float32)
    y, _ = layer.forward(x, store)
    assert_close(y, _reference(cfg, arrays, store, x)[0], RTOL)


def test_dense_ffn_matches_reference() -> None:
    cfg = _config()
    rng = np.random.default_rng(17)
    d, inner = cfg.hidden_size, cfg.intermediate_size
    arrays = {f"model.layers.0.mlp.{n}.weight": _random(rng, s)
              for n, s in (("gate_proj", (inner, d)), ("up_proj", (inner, d)), ("down_proj", (d, inner)))}
    ffn = DenseFFN.from_weights(cfg, lambda n: quantize(arrays[n], "f32"), arrays.__getitem__, "model.layers.0.mlp.")
    x = rng.standard_normal((7, d)).astype(np.float32)
    want = swiglu(x, *(arrays[f"model.layers.0.mlp.{n}_proj.weight"].astype(np.float64)
                       for n in ("gate", "up", "down")))
    assert_close(ffn.forward(x), want, RTOL)
    arrays["model.layers.0.mlp.up_proj.weight"] = _random(rng, (inner, d + 1))
    with pytest.raises(WasteError, match="up_proj"):
        DenseFFN.from_weights(cfg, lambda n: quantize(arrays[n], "f32"), arrays.__getitem__, "model.layers.0.mlp.")


def test_bad_configuration_is_refused() -> None:
    cfg = _config()
    rng = np.random.default_rng(18)
    with pytest.raises(WasteError, match="router_weights"):
        _build(cfg, rng, "both")
    layer, arrays, store = _build(cfg, rng)
    with pytest.raises(WasteError, match="MoE input"):
        layer.forward(np.zeros((2, cfg.hidden_size + 1), np.float32), store)
    arrays["gate.e_score_correction_bias"] = arrays["gate.e_score_correction_bias"][:-1]
    with pytest.raises(WasteError, match="e_score_correction_bias"):
        MoELayer.from_weights(cfg, lambda n: quantize(arrays[n.removeprefix(PREFIX)], "f32"),
                              lambda n: arrays[n.removeprefix(PREFIX)], PREFIX, LAYER)
    latent = _config(routed_expert_hidden_size=32)
    with pytest.raises(WasteError, match="latent MoE"):
        MoELayer.from_weights(latent, None, None, PREFIX, LAYER)


class SplitFetchStore(FakeStore):
    """A streaming store's `fetch`: the first `ready` experts at once, the rest one by one, last id first."""

    def __init__(self, experts, ready: int):
        super().__init__(experts)
        self.ready = ready

    def fetch(self, layer_index: int, expert_ids: list[int]) -> Arrivals:
        pairs = list(enumerate(self.get(layer_index, expert_ids)))
        return Arrivals(iter(pairs[: self.ready] + pairs[self.ready:][::-1]), self.ready)


# SwiGLU, then SiTU with and without its linear beta
ACTIVATION_CONFIGS = [{}, {"hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0},
                      {"hidden_act": "situ", "activation_situ_beta": 2.0}]


@pytest.mark.parametrize("shared", ["f32", "same", "wider", "q8g"])
@pytest.mark.parametrize("act", range(len(ACTIVATION_CONFIGS)))
@pytest.mark.parametrize("fmt", ["q8g", "q4g", "mxfp4"])
def test_decode_of_q_experts_equals_one_expert_at_a_time(fmt: str, act: int, shared: str) -> None:
    """One token's routed experts run together (hits at once, misses as they arrive) give the
    bits of the sum of each expert's own MLP, added in id order, plus the shared experts' (the
    path before batching). Shared experts in float32, or in the routed format and shape, or in
    q8g beside q4g or mxfp4 routed experts (they join the batch), or twice as wide (they run
    alone)."""
    cfg = _config(num_experts_per_token=5, num_shared_experts=2 if shared == "wider" else 1,
                  **ACTIVATION_CONFIGS[act])
    rng = np.random.default_rng(19 + act)
    layer, _, store = _build(cfg, rng)
    experts = {key: tuple(quantize(m.dequantize(), fmt) for m in e) for key, e in store.experts.items()}
    if shared != "f32":
        layer.shared = tuple(quantize(m.dequantize(), "q8g" if shared == "q8g" else fmt) for m in layer.shared)
    x = rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)
    ids, weights = layer.route(x)
    want = np.zeros_like(x)
    for e in sorted(ids[0].tolist()):
        want += weights[0, ids[0].tolist().index(e)] * layer.mlp(x, *experts[LAYER, e])
    want += layer.mlp(x, *layer.shared)
    for source in (FakeStore(experts), *(SplitFetchStore(experts, ready) for ready in (0, 2, 5))):
        y, info = layer.forward(x, source)
        np.testing.assert_array_equal(info.ids, ids)
        np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("group_rows", [1024, 7])
@pytest.mark.parametrize("act", range(len(ACTIVATION_CONFIGS)))
@pytest.mark.parametrize("fmt", ["q8g", "q4g", "mxfp4"])
def test_prefill_of_q_experts_equals_one_expert_at_a_time(fmt: str, act: int, group_rows: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's routed experts run in groups (hits together, up to GROUP_ROWS routed rows a
    group; misses as they arrive) give the bits of each expert's own MLP over its tokens, added
    in id order, plus the shared experts' (the path before grouping), whatever the store hands
    out at once and however the groups fall."""
    monkeypatch.setattr(moe_layer, "GROUP_ROWS", group_rows)
    cfg = _config(num_experts_per_token=5, **ACTIVATION_CONFIGS[act])
    rng = np.random.default_rng(29 + act)
    layer, _, store = _build(cfg, rng)
    experts = {key: tuple(quantize(m.dequantize(), fmt) for m in e) for key, e in store.experts.items()}
    T = 37
    x = (rng.standard_normal((T, cfg.hidden_size)) * rng.uniform(0.1, 10, (T, 1))).astype(np.float32)
    ids, weights = layer.route(x)
    want = np.zeros_like(x)
    for e in np.unique(ids):
        rows, k = np.nonzero(ids == e)
        want[rows] += weights[rows, k, None] * layer.mlp(x[rows], *experts[LAYER, int(e)])
    want += layer.mlp(x, *layer.shared)
    for source in (FakeStore(experts), *(SplitFetchStore(experts, ready) for ready in (0, 3, 11))):
        y, info = layer.forward(x, source)
        np.testing.assert_array_equal(info.ids, ids)
        np.testing.assert_array_equal(y, want)
