"""Synthetic checkpoints: HF layout, determinism, value ranges, a forward pass that stays in range."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from waste.cli import main
from waste.config import load_preset
from waste.container import open_container
from waste.container.format import expected_expert_tensors, expected_tensors
from waste.synth import checkpoint_tensors, synth_values, synthesize
from waste.testing import tiny_config, tiny_container


def test_layout_of_a_sharded_checkpoint(tmp_path: Path) -> None:
    hf = synthesize("tiny", tmp_path / "hf", dtype="bf16", shard_bytes=200_000)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n > 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(p.name for p in hf.glob("*.safetensors")) == shards
    cfg = load_preset("tiny")
    names = checkpoint_tensors(cfg)
    assert list(index["weight_map"]) == list(names)
    n_experts = len(cfg.moe_layers) * cfg.num_experts * len(expected_expert_tensors(cfg))
    assert len(names) == len(expected_tensors(cfg)) + n_experts
    total = 0
    for shard in shards:
        with safe_open(hf / shard, "np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = f.get_tensor(name)
                assert index["weight_map"][name] == shard and tuple(t.shape) == names[name]
                assert str(t.dtype) == "bfloat16"
                total += t.nbytes
    assert index["metadata"]["total_size"] == total
    written = json.loads((hf / "config.json").read_text())
    assert written["dtype"] == "bfloat16" and written["hidden_size"] == cfg.hidden_size


def test_deterministic_for_a_seed(tmp_path: Path) -> None:
    a = synthesize("tiny", tmp_path / "a", seed=7, dtype="f32")
    b = synthesize("tiny", tmp_path / "b", seed=7, dtype="f32")
    c = synthesize("tiny", tmp_path / "c", seed=8, dtype="f32")
    shard = "model-00001-of-00001.safetensors"
    assert (a / shard).read_bytes() == (b / shard).read_bytes()
    assert (a / shard).read_bytes() != (c / shard).read_bytes()


def test_value_ranges() -> None:
    cfg = load_preset("tiny")
    h = cfg.kda_num_heads
    v = {n: synth_values(n, s, cfg, 0) for n, s in expected_tensors(cfg).items()}
    a_log = v["model.layers.0.self_attn.A_log"]
    assert a_log.shape == (1, 1, h, 1) and np.all((a_log >= 0) & (a_log <= math.log(16)))
    for name, x in v.items():
        assert np.isfinite(x).all()
        if name.endswith("norm.weight"):
            assert abs(x.mean() - 1) < 0.05 and x.std() < 0.1, name
    bias = v["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"]
    assert np.abs(bias).max() < 0.05
    taps = v["model.layers.0.self_attn.q_conv1d.weight"]
    assert abs(taps[:, 0, -1].mean() - 1) < 0.1 and np.abs(taps[:, 0, :-1]).mean() < 0.15
    assert np.abs(v["model.layers.0.self_attn.dt_bias"]).max() < 0.5
    q = v["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std() * math.sqrt(cfg.hidden_size) - 1) < 0.1


def test_lower_bound_gate_writes_padded_a_log() -> None:
    from waste.config import parse_config

    cfg = parse_config(tiny_config(linear_attn_config={"gate_lower_bound": -5.0}))
    shape = expected_tensors(cfg)["model.layers.0.self_attn.A_log"]
    a_log = synth_values("model.layers.0.self_attn.A_log", shape, cfg, 0)
    assert shape == (cfg.kda_head_dim,)
    assert np.all(a_log[cfg.kda_num_heads:] == 0) and np.all(a_log[: cfg.kda_num_heads] >= 0)
    assert np.any(a_log[: cfg.kda_num_heads] > 0)


@pytest.mark.parametrize("overrides", [None, {"linear_attn_config": {"gate_lower_bound": -5.0,
                                                                     "use_full_rank_gate": True},
                                              "q_lora_rank": 16, "mla_use_output_gate": True}])
def test_forward_pass_stays_in_range(tmp_path_factory: pytest.TempPathFactory, overrides: dict | None) -> None:
    """The float64 oracle over a synthesised model: hidden states O(1) in every layer, logits spread."""
    from waste.reference.model import ReferenceModel

    with open_container(tiny_container(tmp_path_factory, dtype="bf16", overrides=overrides)) as c:
        ids = np.random.default_rng(0).integers(0, c.config.vocab_size, 48)
        out = ReferenceModel(c).forward(ids)
    for layer, h in enumerate(out.hidden_states):
        rms = np.sqrt((h**2).mean(-1))
        assert 0.3 < rms.min() and rms.max() < 4, (layer, rms.min(), rms.max())
    logits = out.logits - out.logits.max(-1, keepdims=True)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    assert 1.5 < out.logits.std(-1).mean() < 5
    assert 0.05 < p.max(-1).mean() < 0.9  # a clear favourite, not a one-hot


def test_cli_synth_with_a_config_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(tiny_config(num_hidden_layers=3, linear_attn_config={
        "kda_layers": [1, 2], "full_attn_layers": [3]})))
    out = tmp_path / "hf"
    assert main(["synth", str(cfg_path), str(out), "--dtype", "f32", "--shard-size", "100K", "--seed", "2"]) == 0
    assert "tensors" in capsys.readouterr().out
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert main(["synth", "no-such-preset", str(tmp_path / "x")]) == 2
