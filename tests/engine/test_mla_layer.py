"""MLALayer (absorbed, float32, latent cache) against the float64 non-absorbed layer oracle.

Both query forms (direct q_proj; q_a -> norm -> q_b) and the K3 output gate. Tolerance 1e-5
of the output scale: float32 projections over <= 64 inputs and attention over <= 20 tokens
keep the relative error near 1e-6 (see tests/kernels/test_mla.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close

from waste.config import ModelConfig, parse_config, preset_dict
from waste.engine.mla_layer import MLACache, MLALayer
from waste.errors import WasteError
from waste.kernels.quant import quantize
from waste.reference.mla import mla_attention, naive_mla_layer
from waste.reference.quant import reference_matmul

RTOL = 1e-5
PREFIX = "model.layers.1.self_attn."


def _config(variant: str) -> ModelConfig:
    hf = preset_dict("tiny")
    if variant == "k3":
        hf.update(q_lora_rank=24, mla_use_output_gate=True)
    return parse_config(hf)


def _weights(cfg: ModelConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random MLA weights named as in the checkpoint (without the prefix and '.weight')."""
    d, H = cfg.hidden_size, cfg.mla_num_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    shapes = {
        "kv_a_proj_with_mqa": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d),
        "kv_b_proj": (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "o_proj": (d, H * cfg.v_head_dim),
    }
    if cfg.q_lora_rank is None:
        shapes["q_proj"] = (H * qk, d)
    else:
        shapes["q_a_proj"] = (cfg.q_lora_rank, d)
        shapes["q_b_proj"] = (H * qk, cfg.q_lora_rank)
    if cfg.mla_output_gate:
        shapes["g_proj"] = (H * cfg.v_head_dim, d)
    w = {n: (rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32) for n, s in shapes.items()}
    w["kv_a_layernorm"] = (1 + 0.1 * rng.standard_normal(cfg.kv_lora_rank)).astype(np.float32)
    if cfg.q_lora_rank is not None:
        w["q_a_layernorm"] = (1 + 0.1 * rng.standard_normal(cfg.q_lora_rank)).astype(np.float32)
    return w


def _layer(cfg: ModelConfig, w: dict[str, np.ndarray], fmt: str = "f32") -> MLALayer:
    def get_matrix(name: str):
        return quantize(w[name.removeprefix(PREFIX).removesuffix(".weight")], fmt)

    def get_tensor(name: str):
        return w[name.removeprefix(PREFIX).removesuffix(".weight")]

    return MLALayer.from_weights(cfg, get_matrix, get_tensor, PREFIX)



def _f64(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) for k, v in w.items()}


@pytest.mark.parametrize("variant", ["kimi_linear", "k3"])
def test_prefill_then_decode_matches_reference(variant: str) -> None:
    cfg = _config(variant)
    rng = np.random.default_rng(1 if variant == "k3" else 2)
    w = _weights(cfg, rng)
    layer = _layer(cfg, w)
    T = 17
    x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
    want = naive_mla_layer(x, _f64(w), cfg)

    one = layer.new_cache(T)
    assert_close(layer.prefill(x, one), want, RTOL)
    assert one.length == T

    # Uneven chunks, then token-by-token decode, must reproduce the one-shot sequence.
    cache = layer.new_cache(T + 3)
    cache.latent[:] = np.nan  # rows not yet written must never be read
    parts = [layer.prefill(x[0:5], cache), layer.prefill(x[5:6], cache), layer.prefill(x[6:12], cache)]
    parts += [layer.decode(x[t], cache)[None] for t in range(12, T)]
    assert_close(np.concatenate(parts), want, RTOL)
    assert cache.length == T
    # The same rows bit for bit: no product's row depends on how many rows share the call.
    np.testing.assert_array_equal(cache.latent[:T], one.latent[:T])


def test_cache_rows_are_normalised_latent_plus_rope() -> None:
    cfg = _config("kimi_linear")
    rng = np.random.default_rng(3)
    w = _weights(cfg, rng)
    layer = _layer(cfg, w)
    x = rng.standard_normal((4, cfg.hidden_size)).astype(np.float32)
    cache = layer.new_cache(8)
    layer.prefill(x, cache)
    R = cfg.kv_lora_rank
    ckv = x.astype(np.float64) @ w["kv_a_proj_with_mqa"].T.astype(np.float64)
    c = ckv[:, :R] / np.sqrt(np.mean(ckv[:, :R] ** 2, axis=1, keepdims=True) + 1e-6) * w["kv_a_layernorm"]
    assert_close(cache.latent[:4, :R], c, RTOL)
    assert_close(cache.latent[:4, R:], ckv[:, R:], RTOL)
    assert cache.latent.shape == (8, cfg.mla_latent_size)
    assert cache.nbytes == 4 * cfg.mla_latent_size * 4


def test_decode_probabilities_match_reference() -> None:
    cfg = _config("k3")
    rng = np.random.default_rng(4)
    w = _weights(cfg, rng)
    layer = _layer(cfg, w)
    x = rng.standard_normal((9, cfg.hidden_size)).astype(np.float32)
    cache = layer.new_cache(9)
    layer.prefill(x[:8], cache)
    before = cache.copy()
    seen = layer.inspect_decode(x[8], cache)
    assert cache.length == 8 and np.array_equal(cache.latent, before.latent)
    assert seen["probs"].shape == (cfg.mla_num_heads, 9)
    # The float64 oracle's last-query probabilities, from the cache rows the layer wrote.
    full = cache.copy()
    y = layer.decode(x[8], full)
    np.testing.assert_array_equal(y, seen["y"])
    np.testing.assert_array_equal(layer.attention_weights_last, seen["probs"])
    np.testing.assert_array_equal(full.latent[8], seen["latent"])
    wf = _f64(w)
    xq = x[8:].astype(np.float64)
    q = (xq @ wf["q_a_proj"].T)
    q = q / np.sqrt(np.mean(q**2, axis=1, keepdims=True) + cfg.kv_layernorm_eps) * wf["q_a_layernorm"]
    q = (q @ wf["q_b_proj"].T).reshape(1, cfg.mla_num_heads, -1)
    _, probs = mla_attention(
        q, full.latent[:9], wf["kv_b_proj"], start=8, kv_rank=cfg.kv_lora_rank, nope=cfg.qk_nope_head_dim,
        v_dim=cfg.v_head_dim, scale=(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5,
    )
    assert_close(seen["probs"], probs[0], RTOL)


@pytest.mark.parametrize("fmt", ["q8g", "q4g"])
@pytest.mark.parametrize("kind", ["kimi_linear", "k3"])
def test_decode_step_in_one_call_equals_call_by_call(fmt: str, kind: str) -> None:
    """A layer of q products decodes in one kernel call (waste.kernels.mla_step), with a plain
    query or K3's low-rank one and output gate: outputs, cache rows and attention weights bit for
    bit those of the call-by-call step, across the context length where the attention's token
    ranges go from one to two (DECODE_RANGE)."""
    cfg = _config(kind)
    rng = np.random.default_rng(8)
    w = _weights(cfg, rng)
    fused, by_call = _layer(cfg, w, fmt), _layer(cfg, w, fmt)
    assert fused._step_args is not None
    by_call._step_args = None
    caches = [layer.new_cache(300) for layer in (fused, by_call)]
    prompt = rng.standard_normal((250, cfg.hidden_size)).astype(np.float32)
    for layer, cache in zip((fused, by_call), caches, strict=True):
        layer.prefill(prompt, cache)
    for _ in range(10):
        x = rng.standard_normal(cfg.hidden_size).astype(np.float32)
        ys = [layer.decode(x, cache) for layer, cache in zip((fused, by_call), caches, strict=True)]
        np.testing.assert_array_equal(ys[0], ys[1])
        np.testing.assert_array_equal(fused.attention_weights_last, by_call.attention_weights_last)
    assert caches[0].length == caches[1].length == 260
    np.testing.assert_array_equal(caches[0].latent, caches[1].latent)
    with pytest.raises(WasteError, match="MLA decode input must have"):
        fused.decode(np.zeros(cfg.hidden_size + 1, np.float32), caches[0])
    assert caches[0].length == 260
    assert (fused.q_b_proj is not None, fused.g_proj is not None) == ((True, True) if kind == "k3" else (False, False))
    assert _layer(cfg, w)._step_args is None  # float weights decode call by call


@pytest.mark.parametrize("fmt", ["f32", "q8g"])
def test_capacity_overflow_names_the_capacity(fmt: str) -> None:
    cfg = _config("kimi_linear")
    rng = np.random.default_rng(5)
    layer = _layer(cfg, _weights(cfg, rng), fmt)
    cache = layer.new_cache(4)
    x = rng.standard_normal((3, cfg.hidden_size)).astype(np.float32)
    layer.prefill(x, cache)
    with pytest.raises(WasteError, match="capacity 4"):
        layer.prefill(x[:2], cache)
    layer.decode(x[0], cache)
    with pytest.raises(WasteError, match="capacity 4"):
        layer.decode(x[1], cache)
    assert cache.length == 4


def test_cache_copy_is_independent() -> None:
    cache = MLACache(np.zeros((3, 5), np.float32), 1)
    twin = cache.copy()
    twin.latent[0, 0] = 1.0
    twin.length = 2
    assert cache.latent[0, 0] == 0.0 and cache.length == 1
    assert twin.nbytes == 2 * 5 * 4


def test_wrong_shapes_are_refused() -> None:
    cfg = _config("kimi_linear")
    w = _weights(cfg, np.random.default_rng(6))
    w["kv_b_proj"] = w["kv_b_proj"][:-1]
    with pytest.raises(WasteError, match="kv_b_proj"):
        _layer(cfg, w)
    w = _weights(cfg, np.random.default_rng(6))
    w["kv_a_layernorm"] = w["kv_a_layernorm"][:-1]
    with pytest.raises(WasteError, match="kv_a_layernorm"):
        _layer(cfg, w)


def test_bf16_weights_match_reference_on_their_values() -> None:
    cfg = _config("k3")
    rng = np.random.default_rng(7)
    w = _weights(cfg, rng)
    layer = _layer(cfg, w, fmt="bf16")
    # The oracle reads what the bf16 matrices stand for; vectors stay float32. bf16 products
    # also round their activations to bf16 (2**-9 relative, docs/QUANT.md): the oracle's
    # projections are the format's reference products, which round them too, on the float32
    # activations the layer hands each product (kv_b_proj is widened to float32 at load).
    mats = {k: quantize(v, "bf16") for k, v in w.items() if v.ndim == 2}
    wq = {k: mats[k].dequantize() if k in mats else v for k, v in w.items()}
    x = rng.standard_normal((6, cfg.hidden_size)).astype(np.float32)

    def bf16_product(name: str, a: np.ndarray) -> np.ndarray:
        return reference_matmul(mats[name], np.asarray(a, np.float32))

    # Within 1e-7 of the output scale, or 1e-5 where an activation lies so near a bf16 rounding
    # boundary that the layer's float32 and the oracle's float64 round it apart (k3, seed 0).
    got = layer.prefill(x, layer.new_cache(6))
    assert_close(got, naive_mla_layer(x, _f64(wq), cfg, product=bf16_product), 1e-4)
    # An oracle that does not round them is 1.8e-3 to 5e-3 of the output scale away (ten seeds).
    want = naive_mla_layer(x, _f64(wq), cfg)
    assert np.max(np.abs(got - want)) > 1e-3 * np.max(np.abs(want))
