"""K3's own checkpoint layout: synth writes it, convert reads it (both AttnRes spellings, MXFP4 experts
kept byte for byte, vision tensors skipped), and damaged K3 checkpoints are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from waste.cli import main
from waste.config import load_preset
from waste.container import open_container
from waste.container.convert import convert
from waste.container.format import EXPERT_PARTS, expected_expert_tensors, expected_tensors, expert_name
from waste.container.k3_layout import MXFP4_QUANTIZATION_CONFIG, VISION_TENSORS, canonical, checkpoint_name
from waste.engine.model import Model
from waste.synth import synthesize

CFG = load_preset("k3-tiny")
LAYER = 1  # the first MoE layer
BLOCK = f"language_model.model.layers.{LAYER}"


def read_raw(hf: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint in its stored dtype (bfloat16 read as ml_dtypes.bfloat16)."""
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(hf / shard, "np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[name] = f.get_tensor(name)
    return out


def rewrite(hf: Path, edit) -> None:
    """Load every tensor of the checkpoint, edit the dict, write it back as one shard."""
    tensors = read_raw(hf)
    for p in hf.glob("*.safetensors"):
        p.unlink()
    edit(tensors)
    save_file(tensors, str(hf / "model-00001-of-00001.safetensors"))
    weight_map = dict.fromkeys(tensors, "model-00001-of-00001.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def f32_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """k3-tiny in f32 with f32 experts, and its f32 container."""
    root = tmp_path_factory.mktemp("k3-f32")
    hf = synthesize("k3-tiny", root / "hf", dtype="f32", expert_format="f32")
    return hf, convert(hf, root / "c.waste", quant="f32", progress=False)


def test_synth_writes_k3_layout(tmp_path: Path) -> None:
    hf = synthesize("k3-tiny", tmp_path / "hf", dtype="bf16", expert_format="bf16")
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and "text_config" in config
    assert "quantization_config" not in config["text_config"]
    raw = read_raw(hf)
    text = [n for n in raw if n not in VISION_TENSORS]
    assert set(VISION_TENSORS) <= set(raw)
    assert all(n.startswith("language_model.") for n in text)
    d, h, k = CFG.hidden_size, CFG.kda_num_heads, CFG.kda_head_dim
    a_log = raw["language_model.model.layers.0.self_attn.A_log"]
    assert a_log.shape == (max(h, k),) and a_log.dtype == np.float32 and not a_log[h:].any() and a_log[:h].all()
    for x in "qkv":
        assert raw[f"language_model.model.layers.0.self_attn.{x}_proj.weight"].shape == (h * k, d)
        assert raw[f"language_model.model.layers.0.self_attn.{x}_conv1d.weight"].dtype == np.float32
    assert raw["language_model.model.layers.0.self_attn.q_proj.weight"].dtype == ml_dtypes.bfloat16
    assert raw[f"{BLOCK}.self_attention_res_proj.weight"].shape == (1, d)
    assert raw["language_model.model.output_attn_res_norm.weight"].shape == (d,)
    r, inter = CFG.routed_expert_hidden_size, CFG.moe_intermediate_size
    w1 = raw[f"{BLOCK}.block_sparse_moe.experts.3.w1.weight"]
    assert w1.dtype == ml_dtypes.bfloat16 and w1.shape == (inter, r)
    assert raw[f"{BLOCK}.block_sparse_moe.routed_expert_down_proj.weight"].shape == (r, d)
    # every canonical tensor is there exactly once
    n_expert_tensors = len(CFG.moe_layers) * CFG.num_experts * len(EXPERT_PARTS)
    assert len(text) == len(expected_tensors(CFG)) + n_expert_tensors


def test_f32_round_trip_is_exact_and_keeps_attn_res_as_arrays(f32_pair: tuple[Path, Path]) -> None:
    hf, path = f32_pair
    raw = read_raw(hf)
    with open_container(path) as c:
        assert c.expert_storage == "f32"
        assert set(c.names()) == set(expected_tensors(c.config))
        for name in c.names():
            ref = raw[checkpoint_name(name)]
            e = c.entry(name)
            got = c.tensor(name) if e.kind == "array" else c.matrix(name).dequantize()
            assert np.array_equal(got, ref), name
        proj = c.entry(f"model.layers.{LAYER}.mlp_res_proj.weight")
        assert (proj.kind, proj.storage, proj.shape) == ("array", "f32", (1, CFG.hidden_size))
        for layer in c.config.moe_layers:
            for e in range(c.config.num_experts):
                for part, m in zip(EXPERT_PARTS, c.expert(layer, e), strict=True):
                    assert np.array_equal(m.dequantize(), raw[checkpoint_name(expert_name(layer, e, part))])


def test_dotted_attn_res_spelling_gives_the_same_container(f32_pair: tuple[Path, Path], tmp_path: Path) -> None:
    _, path = f32_pair
    hf = synthesize("k3-tiny", tmp_path / "hf", dtype="f32", expert_format="f32", attn_res_spelling="dotted")
    names = set(read_raw(hf))
    assert f"{BLOCK}.mlp_res.proj_weight" in names and f"{BLOCK}.mlp_res_proj.weight" not in names
    assert "language_model.model.output_attn_res.norm_weight" in names
    out = convert(hf, tmp_path / "c.waste", quant="f32", progress=False)
    for f in ("trunk.bin", "experts.bin"):
        assert (out / f).read_bytes() == (path / f).read_bytes()


def test_name_mapping_both_ways() -> None:
    for name in ("model.layers.3.self_attention_res_norm.weight", "model.output_attn_res_proj.weight",
                 "model.layers.0.self_attn.A_log"):
        assert canonical(checkpoint_name(name)) == name
        assert canonical(checkpoint_name(name, "dotted")) == name
    assert canonical("language_model.model.layers.2.block_sparse_moe.e_score_correction_bias") == \
        "model.layers.2.block_sparse_moe.gate.e_score_correction_bias"
    assert canonical("vision_tower.blocks.0.weight") is None
    assert canonical("language_model.mm_projector.proj.weight") is None


def test_alternative_spellings_and_a_longer_a_log_are_accepted(f32_pair: tuple[Path, Path], tmp_path: Path) -> None:
    _, path = f32_pair
    hf = synthesize("k3-tiny", tmp_path / "hf", dtype="f32", expert_format="f32")
    bias = f"{BLOCK}.block_sparse_moe.gate.e_score_correction_bias"
    a_log = "language_model.model.layers.0.self_attn.A_log"

    def edit(t: dict[str, np.ndarray]) -> None:
        t[f"{BLOCK}.block_sparse_moe.e_score_correction_bias"] = t.pop(bias)
        t[a_log] = np.concatenate([t[a_log], np.zeros(40, np.float32)])
        for name in list(VISION_TENSORS):
            t.pop(name)
        t["language_model.vision_tower.extra.weight"] = np.ones((3, 5), np.float32)
        t["vision_tower.encoder.pos_ids"] = np.arange(4, dtype=np.int64)  # a dtype no text tensor has

    rewrite(hf, edit)
    out = convert(hf, tmp_path / "c.waste", quant="f32", progress=False)
    with open_container(out) as c, open_container(path) as ref:
        assert np.array_equal(c.tensor(bias.removeprefix("language_model.")),
                              ref.tensor(bias.removeprefix("language_model.")))
        assert c.tensor(a_log.removeprefix("language_model.")).shape == (max(CFG.kda_num_heads,
                                                                              CFG.kda_head_dim) + 40,)
        assert c.manifest["source"]["ignored_tensors"] == 2
        assert not any("vision" in n for n in c.names())
        # The engine runs what convert accepted: the same logits as the original layout's.
        models = [Model(c), Model(ref)]
        logits = [m.prefill(m.new_session(), [1, 5, 9, 2]) for m in models]
    np.testing.assert_array_equal(logits[0], logits[1])


@pytest.mark.parametrize(
    ("drop", "spelling"),
    [
        (f"{BLOCK}.mlp_res_proj.weight", "canonical"),
        (f"{BLOCK}.mlp_res.proj_weight", "dotted"),
        ("language_model.model.output_attn_res_norm.weight", "canonical"),
        ("language_model.model.output_attn_res.norm_weight", "dotted"),
        (f"{BLOCK}.block_sparse_moe.routed_expert_up_proj.weight", "canonical"),
    ],
)
def test_missing_k3_tensor_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str], drop: str,
                                              spelling: str) -> None:
    """Named as the checkpoint spells it (prefix, AttnRes spelling), not by waste's canonical name."""
    hf = synthesize("k3-tiny", tmp_path / "hf", dtype="f32", expert_format="f32", attn_res_spelling=spelling)
    rewrite(hf, lambda t: t.pop(drop))
    code = main(["convert", str(hf), str(tmp_path / "c.waste"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and f"missing 1 tensor(s): {drop}" in err and err.count("\n") == 1, err
    assert not (tmp_path / "c.waste").exists()


def test_info_and_verify_on_a_k3_container(f32_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, path = f32_pair
    assert main(["info", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["expert_format"] == "f32" and info["model_type"] == "kimi_k3"
    assert info["per_class"]["attn_res"] > 0 and info["per_class"]["latent_moe"] > 0
    assert main(["verify", str(path)]) == 0


def test_synthesised_router_spreads_tokens_over_the_experts() -> None:
    from waste.synth import synth_values

    d, e, k = CFG.hidden_size, CFG.num_experts, CFG.num_experts_per_token
    x = synth_values("model.embed_tokens.weight", (CFG.vocab_size, d), CFG, 0)[:128].astype(np.float64)
    x /= np.sqrt(np.mean(x**2, axis=1, keepdims=True))
    for layer in CFG.moe_layers:
        w = synth_values(f"model.layers.{layer}.block_sparse_moe.gate.weight", (e, d), CFG, 0)
        chosen = np.argsort(-(x @ w.T), axis=1)[:, :k]
        counts = np.bincount(chosen.reshape(-1), minlength=e)
        # every expert is picked, none by more than half of the tokens
        assert counts.min() > 0 and counts.max() < 0.5 * len(x), counts



@pytest.fixture(scope="module")
def mxfp4_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """k3-tiny as K3 ships it (bf16, MXFP4 experts) and its f32-trunk container."""
    root = tmp_path_factory.mktemp("k3-mxfp4")
    hf = synthesize("k3-tiny", root / "hf", dtype="bf16")
    return hf, convert(hf, root / "c.waste", quant="f32", progress=False)



def test_synth_writes_mxfp4_experts_with_the_quantization_config(mxfp4_pair: tuple[Path, Path]) -> None:
    hf, _ = mxfp4_pair
    config = json.loads((hf / "config.json").read_text())
    assert config["text_config"]["quantization_config"] == MXFP4_QUANTIZATION_CONFIG
    raw = read_raw(hf)
    r, inter = CFG.routed_expert_hidden_size, CFG.moe_intermediate_size
    w1 = f"{BLOCK}.block_sparse_moe.experts.3.w1"
    assert raw[f"{w1}.weight_packed"].dtype == np.uint8 and raw[f"{w1}.weight_packed"].shape == (inter, r // 2)
    assert raw[f"{w1}.weight_scale"].dtype == np.uint8 and raw[f"{w1}.weight_scale"].shape == (inter, r // 32)
    assert raw[f"{BLOCK}.block_sparse_moe.experts.3.w2.weight_packed"].shape == (r, inter // 2)
    assert f"{w1}.weight" not in raw
    # every canonical tensor is there exactly once, experts as packed + scale pairs
    text = [n for n in raw if n not in VISION_TENSORS]
    n_expert_tensors = 2 * len(CFG.moe_layers) * CFG.num_experts * len(EXPERT_PARTS)
    assert len(text) == len(expected_tensors(CFG)) + n_expert_tensors
    # the packed experts decode to the random values synth drew, within MXFP4's rounding
    from waste.kernels.mxfp4 import dequantize_mxfp4
    from waste.synth import synth_values

    name = expert_name(LAYER, 3, "w1")
    want = synth_values(name, (inter, r), CFG, 0)
    got = dequantize_mxfp4(raw[f"{w1}.weight_packed"], raw[f"{w1}.weight_scale"])
    assert np.abs(got - want).max() <= 0.25 * np.abs(want).max()


def test_mxfp4_experts_reach_the_container_byte_for_byte(mxfp4_pair: tuple[Path, Path]) -> None:
    hf, path = mxfp4_pair
    raw = read_raw(hf)
    with open_container(path) as c:
        assert c.expert_storage == "mxfp4" and c.scheme == "f32"
        parts = expected_expert_tensors(c.config)
        for layer in c.config.moe_layers:
            for e in range(c.config.num_experts):
                for part, m in zip(EXPERT_PARTS, c.expert(layer, e), strict=True):
                    stem = checkpoint_name(expert_name(layer, e, part)).removesuffix(".weight")
                    assert m.fmt == "mxfp4" and m.shape == parts[part]
                    assert np.array_equal(m.buffers["packed"], raw[f"{stem}.weight_packed"])
                    assert np.array_equal(m.buffers["scales"], raw[f"{stem}.weight_scale"])
        # one blob = three matrices at 4.25 bits per weight, padded to the 4 KiB blob
        data = sum(n * k * 17 // 32 for n, k in parts.values())
        assert c.byte_counts()["expert_data_bytes"] == data
    assert main(["verify", str(path)]) == 0



@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t, s: t[s].__setitem__((0, 0), 255), "holds the E8M0 NaN scale byte 255"),
        (lambda t, s: t.update({s: t[s].astype(np.float32)}), "wrong dtype in 1 tensor(s)"),
        (lambda t, s: t.update({s.replace(".weight_scale", ".weight"): np.zeros((32, 32), np.float32)}),
         "unexpected 1 tensor(s)"),
    ],
)
def test_bad_mxfp4_tensors_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], edit,
                                       message: str) -> None:
    hf = synthesize("k3-tiny", tmp_path / "hf", dtype="bf16")
    rewrite(hf, lambda t: edit(t, f"{BLOCK}.block_sparse_moe.experts.0.w1.weight_scale"))
    code = main(["convert", str(hf), str(tmp_path / "c.waste"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_experts_can_be_requantised_or_widened_when_asked(mxfp4_pair: tuple[Path, Path], tmp_path: Path) -> None:
    hf, path = mxfp4_pair
    widened = convert(hf, tmp_path / "f32.waste", quant="f32", experts="f32", progress=False)
    q4 = convert(hf, tmp_path / "q4.waste", quant="q8", experts="q4", progress=False)
    with open_container(path) as c, open_container(widened) as w, open_container(q4) as q:
        assert (w.expert_storage, q.expert_storage) == ("f32", "q4g")
        for a, b, m in zip(c.expert(LAYER, 2), w.expert(LAYER, 2), q.expert(LAYER, 2), strict=True):
            exact = a.dequantize()
            assert np.array_equal(b.dequantize(), exact)
            assert m.fmt == "q4g"
            err = np.abs(m.dequantize() - exact).max()
            assert 0 < err <= 0.2 * np.abs(exact).max()



def test_info_shows_the_expert_storage(mxfp4_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, path = mxfp4_pair
    assert main(["info", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["expert_format"] == "mxfp4" and info["model_type"] == "kimi_k3"
    assert info["trunk_formats"]["array f32"] > 0



def test_expert_storage_in_the_manifest(mxfp4_pair: tuple[Path, Path], tmp_path: Path,
                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    import shutil

    from waste.container import ContainerError
    from waste.container.manifest import CHECKSUM_KEY, manifest_checksum
    from waste.testing import tiny_container

    _, path = mxfp4_pair
    # an MXFP4 container whose manifest lost experts.storage falls back to the scheme's and is refused
    broken = shutil.copytree(path, tmp_path / "broken.waste")
    manifest = json.loads((broken / "manifest.json").read_text())
    assert manifest["experts"].pop("storage") == "mxfp4"
    manifest[CHECKSUM_KEY] = manifest_checksum(manifest)
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ContainerError, match="blob_bytes: 4096, the f32 layout needs"):
        open_container(broken)
    # a manifest without experts.storage means the scheme's storage
    old = shutil.copytree(tiny_container(tmp_path_factory, quant="q4"), tmp_path / "old.waste")
    manifest = json.loads((old / "manifest.json").read_text())
    assert manifest["experts"].pop("storage") == "q4g"
    manifest[CHECKSUM_KEY] = manifest_checksum(manifest)
    (old / "manifest.json").write_text(json.dumps(manifest))
    with open_container(old) as c:
        assert c.expert_storage == "q4g"


def test_mxfp4_needs_k3_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["synth", "tiny", str(tmp_path / "hf"), "--expert-format", "mxfp4"])
    assert code == 2 and "K3's layout only" in capsys.readouterr().err


def test_missing_expert_scale_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = synthesize("k3-tiny", tmp_path / "hf", dtype="bf16")
    rewrite(hf, lambda t: t.pop(f"{BLOCK}.block_sparse_moe.experts.5.w2.weight_scale"))
    code = main(["convert", str(hf), str(tmp_path / "c.waste"), "--quiet"])
    err = capsys.readouterr().err
    message = f"missing 1 tensor(s): {BLOCK}.block_sparse_moe.experts.5.w2.weight_scale"
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "c.waste").exists()


def test_mxfp4_halves_in_different_shards_are_read_together(mxfp4_pair: tuple[Path, Path], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Every weight_scale in one shard and every weight_packed in another: each expert matrix's two
    halves are still read one after the other (memory bounded by a tensor, not by a shard of packed
    nibbles waiting for their scales), and the container is the same."""
    import waste.container.convert as conv

    hf, path = mxfp4_pair
    raw = read_raw(hf)
    work = tmp_path / "hf"
    work.mkdir()
    (work / "config.json").write_bytes((hf / "config.json").read_bytes())
    shards = {"model-00001-of-00002.safetensors": {n: v for n, v in raw.items() if n.endswith(".weight_scale")},
              "model-00002-of-00002.safetensors": {n: v for n, v in raw.items() if not n.endswith(".weight_scale")}}
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, str(work / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    (work / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    read: list[str] = []
    real = conv.read_tensor

    def recording(f: object, t: conv.SourceTensor) -> np.ndarray:
        read.append(t.name)
        return real(f, t)

    monkeypatch.setattr(conv, "read_tensor", recording)
    out = convert(work, tmp_path / "c.waste", quant="f32", progress=False)
    halves = [n for n in read if n.endswith((".weight_packed", ".weight_scale"))]
    assert len(halves) == 2 * len(CFG.moe_layers) * CFG.num_experts * len(EXPERT_PARTS)
    for a, b in zip(halves[::2], halves[1::2], strict=True):
        assert a.rsplit(".", 1)[0] == b.rsplit(".", 1)[0] and a != b, (a, b)
    for f in ("trunk.bin", "experts.bin"):
        assert (out / f).read_bytes() == (path / f).read_bytes()
