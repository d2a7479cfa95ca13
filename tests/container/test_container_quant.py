"""q8 / q4 / q4all containers: the stored buffers are quantize()'s, dequantised within the formats' error;
bf16 containers: a bf16 checkpoint's bits, unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from waste.container import open_container
from waste.container.format import EXPERT_PARTS, Q4ALL_KEEP_Q8, expected_expert_tensors, expert_name, is_matrix
from waste.kernels import quant as qk
from waste.qformat import GROUP, QMAX
from waste.testing import load_checkpoint, tiny_checkpoint, tiny_container


def within_format_error(got: np.ndarray, ref: np.ndarray, fmt: str) -> None:
    """Per group of 32 along K: q8g within half a step, q4g within one step (its clipped +8)."""
    n, k = ref.shape
    pad = -k % GROUP
    ref64 = np.pad(ref.astype(np.float64), ((0, 0), (0, pad))).reshape(n, -1, GROUP)
    err = np.abs(np.pad(got.astype(np.float64), ((0, 0), (0, pad))).reshape(n, -1, GROUP) - ref64)
    # The float16 group scale is within 2^-11 of amax / QMAX (the statement of tests/kernels/test_quant.py).
    step = np.abs(ref64).max(axis=-1, keepdims=True) / QMAX[fmt] * (1 + 2.0**-10)
    assert np.all(err <= (0.5 if fmt == "q8g" else 1.0) * step)


@pytest.mark.parametrize("scheme", ["q8", "q4", "q4all"])
@pytest.mark.parametrize("overrides", [None, {"q_lora_rank": 16, "linear_attn_config": {"use_full_rank_gate": True}}])
def test_quantised_round_trip(tmp_path_factory: pytest.TempPathFactory, scheme: str, overrides: dict | None) -> None:
    out = tiny_container(tmp_path_factory, quant=scheme, dtype="bf16", overrides=overrides)
    source = load_checkpoint(tiny_checkpoint(out))
    expert_fmt = "q8g" if scheme == "q8" else "q4g"
    with open_container(out) as c:
        c.verify()
        assert c.scheme == scheme
        for name in c.names():
            ref = source[name]
            if not is_matrix(name, ref.shape):
                assert c.entry(name).storage == "f32"
                assert np.array_equal(c.tensor(name), ref), name  # arrays and the router stay exact
                continue
            m = c.matrix(name)
            # q4all: every trunk matrix in 4 bits but the embedding and lm_head
            fmt = "q4g" if scheme == "q4all" and name not in Q4ALL_KEEP_Q8 else "q8g"
            assert m.fmt == fmt and m.shape == ref.shape, name
            want = qk.quantize(ref, fmt).buffers
            for b, view in m.buffers.items():
                assert np.array_equal(view, want[b]), (name, b)
            within_format_error(m.dequantize(), ref, fmt)
        cfg = c.config
        for layer in cfg.moe_layers:
            for e in range(cfg.num_experts):
                for part, m in zip(EXPERT_PARTS, c.expert(layer, e), strict=True):
                    ref = source[expert_name(layer, e, part)]
                    assert m.fmt == expert_fmt
                    within_format_error(m.dequantize(), ref, expert_fmt)
        x = np.random.default_rng(1).standard_normal((3, cfg.hidden_size)).astype(np.float32)
        w1 = c.expert(cfg.moe_layers[0], 2)[0]
        exact = x.astype(np.float64) @ source[expert_name(cfg.moe_layers[0], 2, "w1")].T.astype(np.float64)
        assert np.abs(w1.matmul(x) - exact).max() < (0.05 if scheme == "q8" else 0.5) * np.abs(exact).max()


def test_q4_is_smaller_than_q8_where_it_should_be(tmp_path_factory: pytest.TempPathFactory) -> None:
    with open_container(tiny_container(tmp_path_factory, quant="q8")) as q8, \
            open_container(tiny_container(tmp_path_factory, quant="q4")) as q4, \
            open_container(tiny_container(tmp_path_factory, quant="q4all")) as q4all:
        assert q8.byte_counts()["per_class"] == q4.byte_counts()["per_class"]
        assert q4.byte_counts()["expert_data_bytes"] < 0.6 * q8.byte_counts()["expert_data_bytes"]
        assert q4all.byte_counts()["expert_data_bytes"] == q4.byte_counts()["expert_data_bytes"]
        q4_class, q4all_class = q4.byte_counts()["per_class"], q4all.byte_counts()["per_class"]
        for cls in ("embedding", "lm_head", "router", "norms"):
            assert q4all_class[cls] == q4_class[cls], cls
        for cls in ("kda", "mla", "dense_ffn", "shared_experts"):
            assert q4all_class[cls] < 0.6 * q4_class[cls], cls


def test_bf16_container_keeps_a_bf16_checkpoint_bit_for_bit(tmp_path_factory: pytest.TempPathFactory) -> None:
    import ml_dtypes

    from waste.cli import main

    out = tiny_container(tmp_path_factory, quant="bf16", dtype="bf16")
    source = load_checkpoint(tiny_checkpoint(out))  # float32 widenings of the bf16 values: exact
    with open_container(out) as c:
        c.verify()
        assert c.scheme == "bf16"
        for name in c.names():
            ref = source[name]
            if not is_matrix(name, ref.shape):
                assert c.entry(name).storage == "f32" and np.array_equal(c.tensor(name), ref), name
                continue
            m = c.matrix(name)
            assert m.fmt == "bf16" and m.shape == ref.shape, name
            np.testing.assert_array_equal(m.buffers["w"], ref.astype(ml_dtypes.bfloat16).view(np.uint16))
        cfg = c.config
        for layer in cfg.moe_layers:
            for e in range(cfg.num_experts):
                for part, m in zip(EXPERT_PARTS, c.expert(layer, e), strict=True):
                    ref = source[expert_name(layer, e, part)]
                    assert m.fmt == "bf16"
                    np.testing.assert_array_equal(m.buffers["w"], ref.astype(ml_dtypes.bfloat16).view(np.uint16))
        # two bytes a weight, nothing else
        assert c.byte_counts()["expert_data_bytes"] == sum(2 * a * b for a, b in expected_expert_tensors(cfg).values())
    # The engine against the float64 oracle at the bf16 scheme's tolerance (exit code 0: passed).
    assert main(["check", str(out), "--prompt-len", "24", "--new", "4"]) == 0
