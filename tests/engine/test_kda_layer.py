"""The KDA layer (projections, conv rings, gates, recurrence, gated norm, o_proj) against the
float64 layer oracle, and its state handling.

Tolerance: the float32 projections over hidden = 2304 inputs dominate (about 1e-6 relative
each, four matmuls deep); 1e-5 of each quantity's scale leaves a margin and still catches
any wiring error, which shows up at O(1).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from conftest import assert_close

from waste.config import ModelConfig, load_preset, parse_config, preset_dict
from waste.engine.kda_layer import KDALayer, KDAState, _sigmoid
from waste.errors import WasteError
from waste.kernels.kda import gated_rmsnorm, kda_gate_lower_bound, kda_gate_softplus
from waste.kernels.kda_decode import kda_decode_step_deferred
from waste.kernels.quant import quantize
from waste.kernels.short_conv import short_conv_silu_step
from waste.reference.kda import naive_kda_layer

RTOL = 1e-5
PREFIX = "model.layers.1.self_attn."


def _weights(cfg: ModelConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    H, K, hidden, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.hidden_size, cfg.short_conv_kernel
    HK = H * K

    def mat(n: int, m: int) -> np.ndarray:
        return rng.standard_normal((n, m), dtype=np.float32) / np.float32(np.sqrt(m))

    w = {f"{n}_proj.weight": mat(HK, hidden) for n in "qkv"}
    w |= {f"{n}_conv1d.weight": 0.5 * rng.standard_normal((HK, 1, W), dtype=np.float32) for n in "qkv"}
    a_log = np.log(rng.uniform(1, 16, H)).astype(np.float32)
    if cfg.kda_gate == "lower_bound":
        w["A_log"] = np.concatenate([a_log, np.zeros(K - H, np.float32)])  # K3: [K] zero-padded past H
    else:
        w["A_log"] = a_log.reshape(1, 1, H, 1)
    w["dt_bias"] = rng.standard_normal(HK, dtype=np.float32)
    w |= {"f_a_proj.weight": mat(K, hidden), "f_b_proj.weight": mat(HK, K), "b_proj.weight": mat(H, hidden)}
    if cfg.kda_full_rank_gate:
        w["g_proj.weight"] = mat(HK, hidden)
    else:
        w |= {"g_a_proj.weight": mat(K, hidden), "g_b_proj.weight": mat(HK, K)}
    w["o_norm.weight"] = rng.uniform(0.5, 1.5, K).astype(np.float32)
    w["o_proj.weight"] = mat(hidden, HK)
    return w


def _layer(cfg: ModelConfig, w: dict[str, np.ndarray]) -> KDALayer:
    def strip(name: str) -> str:
        assert name.startswith(PREFIX), name
        return name[len(PREFIX):]

    return KDALayer.from_weights(cfg, lambda n: quantize(w[strip(n)], "f32"), lambda n: w[strip(n)], PREFIX)


def _k3_like(preset: str) -> ModelConfig:
    d = copy.deepcopy(preset_dict(preset))
    d["linear_attn_config"] |= {"gate_lower_bound": -5.0, "use_full_rank_gate": True}
    return parse_config(d)



@pytest.mark.parametrize("preset", ["kimi-linear-48b-a3b", "k3-like-tiny"])
def test_layer_prefill_then_decode_matches_reference(preset: str) -> None:
    cfg = _k3_like("tiny") if preset == "k3-like-tiny" else load_preset(preset)
    rng = np.random.default_rng(31)
    w = _weights(cfg, rng)
    layer = _layer(cfg, w)
    T1, T2 = 5, 2
    x = rng.standard_normal((T1 + T2, cfg.hidden_size), dtype=np.float32)
    state = layer.new_state()
    y = np.concatenate([layer.prefill(x[:T1], state)] + [layer.decode(x[t], state)[None] for t in range(T1, T1 + T2)])
    y_ref, s_ref, conv_ref = naive_kda_layer(x, w, cfg)
    assert_close(y, y_ref, RTOL, "y")
    assert_close(state.recurrent, s_ref, RTOL, "recurrent state")
    assert_close(state.conv, conv_ref, RTOL, "conv rings")
    # a further chunk continues from the carried state and rings
    x2 = rng.standard_normal((3, cfg.hidden_size), dtype=np.float32)
    y2_ref, s2_ref, conv2_ref = naive_kda_layer(x2, w, cfg, initial_state=s_ref, conv_state=conv_ref)
    assert_close(layer.prefill(x2, state), y2_ref, RTOL, "y after the carried state")
    assert_close(state.recurrent, s2_ref, RTOL, "recurrent state after the second chunk")
    assert_close(state.conv, conv2_ref, RTOL, "conv rings after the second chunk")


def test_prefill_then_decode_equals_one_prefill_and_state_helpers() -> None:
    cfg = load_preset("tiny")
    rng = np.random.default_rng(32)
    layer = _layer(cfg, _weights(cfg, rng))
    x = rng.standard_normal((9, cfg.hidden_size), dtype=np.float32)
    one = layer.new_state()
    y_one = layer.prefill(x, one)
    split = layer.new_state()
    y_split = [layer.prefill(x[:2], split)]  # shorter than the conv ring
    snapshot = split.copy()
    y_split += [layer.prefill(x[2:6], split)] + [layer.decode(x[t], split)[None] for t in range(6, 9)]
    np.testing.assert_allclose(np.concatenate(y_split), y_one, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(split.recurrent, one.recurrent, rtol=1e-5, atol=1e-6)
    # the rings hold projections, and a [T, hidden] matmul rounds differently from a matvec
    np.testing.assert_allclose(split.conv, one.conv, rtol=1e-5, atol=1e-6)
    # copy() is deep, nbytes counts every buffer (state, rings, the pending rank-1 vectors)
    assert not np.array_equal(snapshot.recurrent, split.recurrent)
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    assert one.nbytes == 4 * (H * K * K + 3 * (cfg.short_conv_kernel - 1) * H * K + 2 * H * K)
    # inspect_decode advances the state exactly like decode and exposes decay, beta, state
    a, b = split.copy(), split.copy()
    y_a = layer.decode(x[0], a)
    info = layer.inspect_decode(x[0], b)
    np.testing.assert_array_equal(info["y"], y_a)
    np.testing.assert_array_equal(b.recurrent, a.recurrent)
    np.testing.assert_array_equal(info["state"], a.recurrent)
    assert info["decay"].shape == (H, K) and np.all((info["decay"] > 0) & (info["decay"] <= 1))
    assert info["beta"].shape == (H,)


def test_layer_rejects_bad_weights_and_state() -> None:
    cfg = load_preset("tiny")
    rng = np.random.default_rng(33)
    w = _weights(cfg, rng)
    bad = dict(w, **{"o_proj.weight": w["o_proj.weight"][:, :-1]})
    with pytest.raises(WasteError, match="o_proj"):
        _layer(cfg, bad)
    bad = dict(w, A_log=np.zeros(3, np.float32))
    with pytest.raises(WasteError, match="A_log"):
        _layer(cfg, bad)
    # Any length >= H that is zero past H, as convert accepts it (not only H or K).
    H = cfg.kda_num_heads
    per_head = w["A_log"].ravel()[:H]
    padded = dict(w, A_log=np.concatenate([per_head, np.zeros(3, np.float32)]))
    assert np.array_equal(_layer(cfg, padded).a_log, per_head)
    bad = dict(w, A_log=np.concatenate([per_head, np.ones(3, np.float32)]))
    with pytest.raises(WasteError, match="A_log"):
        _layer(cfg, bad)
    layer = _layer(cfg, w)
    wrong = KDAState.zeros(1, 2, (3, 3, 64))
    with pytest.raises(WasteError):
        layer.decode(np.zeros(cfg.hidden_size, np.float32), wrong)
    for field in ("pending_k", "pending_d", "conv"):
        state = layer.new_state()
        setattr(state, field, np.asfortranarray(getattr(state, field)[..., :-1]))
        with pytest.raises(WasteError, match="does not fit"):
            layer.decode(np.zeros(cfg.hidden_size, np.float32), state)


def test_reading_the_state_mid_decode_changes_no_bits() -> None:
    """Decode leaves a rank-1 update pending; reading `recurrent` folds it in early, which must
    round exactly as the next step would (observers and session saves read the state)."""
    cfg = load_preset("tiny")
    rng = np.random.default_rng(34)
    layer = _layer(cfg, _weights(cfg, rng))
    x = rng.standard_normal((6, cfg.hidden_size), dtype=np.float32)
    watched, unwatched = layer.new_state(), layer.new_state()
    layer.prefill(x[:2], watched)
    layer.prefill(x[:2], unwatched)
    for t in range(2, 6):
        np.testing.assert_array_equal(layer.decode(x[t], watched), layer.decode(x[t], unwatched))
        assert unwatched.has_pending
        watched.recurrent  # noqa: B018 - the read is the point
        assert not watched.has_pending and not np.any(watched.pending_d)
    np.testing.assert_array_equal(watched.recurrent, unwatched.recurrent)


@pytest.mark.parametrize(("fmts", "full_rank"), [(("q8g",), False), (("q4g",), True), (("q4g", "q8g"), False),
                                                 (("q8g", "q4g"), True)])
def test_batched_decode_products_equal_one_by_one(fmts: tuple[str, ...], full_rank: bool) -> None:
    """The decode step's two batched product calls (q formats) give the bits of the products one
    by one (the path of f32 and bf16 weights), in the outputs and the state, token after token:
    weights of one or two formats, low- and full-rank gates."""
    d = copy.deepcopy(preset_dict("tiny"))
    d["linear_attn_config"] |= {"use_full_rank_gate": full_rank}
    cfg = parse_config(d)
    rng = np.random.default_rng(53)
    w = _weights(cfg, rng)
    fmt_of = {name: fmts[i % len(fmts)] for i, name in enumerate(sorted(w))}

    def layer() -> KDALayer:
        return KDALayer.from_weights(cfg, lambda n: quantize(w[n[len(PREFIX):]], fmt_of[n[len(PREFIX):]]),
                                     lambda n: w[n[len(PREFIX):]], PREFIX)

    batched, one_by_one = layer(), layer()
    assert batched._decode_batches is not None
    one_by_one._decode_batches = None
    s1, s2 = batched.new_state(), one_by_one.new_state()
    for _ in range(3):
        x = (3 * rng.standard_normal(cfg.hidden_size)).astype(np.float32)
        np.testing.assert_array_equal(batched.decode(x, s1), one_by_one.decode(x, s2))
    np.testing.assert_array_equal(s1.recurrent, s2.recurrent)
    np.testing.assert_array_equal(s1.conv, s2.conv)
    with pytest.raises(WasteError, match="decode input"):
        batched.decode(np.ones(cfg.hidden_size + 1, np.float32), s1)


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_dense_layer_decodes_in_one_call(fmt: str) -> None:
    """An f32 or bf16 layer's decode step is one call (kda_decode_step_dense), not QBatch's; with
    it turned off, the call-by-call step (two dense_products calls) gives the same bits, in the
    output and the state, token after token (the bits of both against the public kernels:
    test_decode_equals_the_public_kernels_composed)."""
    cfg = load_preset("tiny")
    rng = np.random.default_rng(3)
    w = _weights(cfg, rng)

    def layer() -> KDALayer:
        return KDALayer.from_weights(cfg, lambda n: quantize(w[n[len(PREFIX):]], fmt), lambda n: w[n[len(PREFIX):]],
                                     PREFIX)

    one_call, by_call = layer(), layer()
    assert one_call._decode_batches is None and one_call._step_args is None
    assert one_call._dense_step_args is not None
    first, second = one_call._dense_decode
    assert [m.fmt for m in first + second] == [fmt] * 8
    by_call._dense_step_args = None
    s1, s2 = one_call.new_state(), by_call.new_state()
    for _ in range(3):
        x = (3 * rng.standard_normal(cfg.hidden_size)).astype(np.float32)
        np.testing.assert_array_equal(one_call.decode(x, s1), by_call.decode(x, s2))
        for field in ("base", "conv", "pending_k", "pending_d"):
            np.testing.assert_array_equal(getattr(s1, field), getattr(s2, field))


def _decode_through_wrappers(layer: KDALayer, x: np.ndarray, state: KDAState) -> np.ndarray:
    """The decode step as the public, checked kernels compose it, one product at a time."""
    H, K = layer.H, layer.K
    qkv = np.stack([m.matvec(x) for m in layer.qkv])
    q, k, v = short_conv_silu_step(qkv, layer.taps3, state.conv).reshape(3, H, K)
    if len(layer.gate) == 2:
        gate = layer.gate[1].matvec(layer.gate[0].matvec(x))
    else:
        gate = layer.gate[0].matvec(x)
    z = layer.f_b.matvec(layer.f_a.matvec(x))[None, :]
    if layer.lower_bound is None:
        g = kda_gate_softplus(z, layer.a_log, layer.dt_bias, num_heads=H)[0]
    else:
        g = kda_gate_lower_bound(z, layer.a_log, layer.dt_bias, layer.lower_bound, num_heads=H)[0]
    beta = _sigmoid(layer.b_proj.matvec(x))
    o = kda_decode_step_deferred(q, k, v, g, beta, state.base, state.pending_k, state.pending_d)
    state.has_pending = True
    return layer.o_proj.matvec(gated_rmsnorm(o, gate, layer.o_norm, layer.eps).reshape(H * K))


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8g", "q4g"])
@pytest.mark.parametrize("preset", ["tiny", "k3-like-tiny"])
def test_decode_equals_the_public_kernels_composed(fmt: str, preset: str) -> None:
    """decode calls the kernels directly, with what their wrappers derive per call derived once:
    the bits of the wrappers composed, in the output and the whole state, token after token
    (softplus and lower-bound gates, low- and full-rank output gates, every weight format)."""
    cfg = _k3_like("tiny") if preset == "k3-like-tiny" else load_preset(preset)
    rng = np.random.default_rng(59)
    w = _weights(cfg, rng)
    layer = KDALayer.from_weights(cfg, lambda n: quantize(w[n[len(PREFIX):]], fmt), lambda n: w[n[len(PREFIX):]],
                                  PREFIX)
    s1, s2 = layer.new_state(), layer.new_state()
    for _ in range(3):
        x = (3 * rng.standard_normal(cfg.hidden_size)).astype(np.float32)
        np.testing.assert_array_equal(layer.decode(x, s1), _decode_through_wrappers(layer, x, s2))
        for field in ("base", "conv", "pending_k", "pending_d"):
            np.testing.assert_array_equal(getattr(s1, field), getattr(s2, field))
