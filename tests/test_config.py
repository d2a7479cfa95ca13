"""Config parsing: both model types, the layer partition, variant detection, bad input."""

import copy
import json

import pytest

from waste.config import PRESETS, load_config_file, load_preset, parse_config, preset_dict
from waste.container.k3_layout import MXFP4_QUANTIZATION_CONFIG
from waste.errors import ConfigError


def test_kimi_linear_preset_matches_the_published_shape():
    cfg = load_preset("kimi-linear-48b-a3b")
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (2304, 27, 163840)
    # 1-based full_attn_layers [4, 8, ..., 24, 27] become 0-based 3, 7, ..., 23, 26
    assert cfg.mla_layers == [3, 7, 11, 15, 19, 23, 26]
    assert len(cfg.kda_layers) == 20
    assert cfg.kda_gate == "softplus" and cfg.gate_lower_bound is None
    assert not cfg.kda_full_rank_gate and not cfg.mla_output_gate and cfg.q_lora_rank is None
    assert cfg.mla_latent_size == 576 and cfg.kda_proj_size == 4096
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.num_shared_experts) == (256, 8, 1)
    assert cfg.routed_scaling_factor == 2.446 and cfg.first_k_dense_replace == 1
    assert cfg.moe_layers == list(range(1, 27))
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (163584, 163586, 163839)
    # FACTS.md: kv_a_layernorm's eps is 1e-6 (HF remote code and transformers), not rms_norm_eps
    # (1e-5) nor vLLM's 1e-5; the goldens' tolerance barely sees the difference, so it is held here.
    assert cfg.rms_norm_eps == 1e-5 and cfg.kv_layernorm_eps == 1e-6


def test_k3_preset_reads_text_config_and_detects_variants():
    cfg = load_preset("k3")
    assert cfg.model_type == "kimi_k3"
    assert (cfg.num_layers, len(cfg.kda_layers), len(cfg.mla_layers)) == (93, 69, 24)
    assert cfg.mla_layers[-2:] == [91, 92]
    assert cfg.kda_gate == "lower_bound" and cfg.gate_lower_bound == -5.0
    assert cfg.kda_full_rank_gate and cfg.mla_output_gate and cfg.q_lora_rank == 1536
    assert cfg.expert_input_size == 3584 and cfg.hidden_act == "situ"
    assert cfg.kv_layernorm_eps == 1e-6  # q_a and kv_a layernorms alike (FACTS.md)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_parses_and_partitions_its_layers(name):
    cfg = load_preset(name)
    assert len(cfg.layer_kinds) == cfg.num_layers
    assert sorted(cfg.kda_layers + cfg.mla_layers) == list(range(cfg.num_layers))


def test_tiny_and_mini_have_the_shapes_the_issue_asks_for():
    tiny, mini = load_preset("tiny"), load_preset("mini")
    assert tiny.first_k_dense_replace == 1 and tiny.num_experts > tiny.num_experts_per_token > 1
    assert any(i < tiny.num_layers - 1 for i in tiny.mla_layers)
    assert 768 <= mini.hidden_size <= 1536 and mini.num_layers >= 8 and mini.num_experts >= 64
    assert mini.kda_head_dim == 128


def _broken(mutate):
    d = copy.deepcopy(preset_dict("kimi-linear-48b-a3b"))
    mutate(d)
    return d


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("hidden_size"), "'hidden_size' is missing"),
        (lambda d: d.update(hidden_size="big"), "'hidden_size': expected an integer"),
        (lambda d: d.update(model_type="llama"), "'model_type': expected one of"),
        (lambda d: d["linear_attn_config"]["kda_layers"].remove(5), "missing [5]"),
        (lambda d: d["linear_attn_config"]["kda_layers"].append(4), "layer 4 is listed twice"),
        (lambda d: d["linear_attn_config"]["full_attn_layers"].append(28), "outside 1..27"),
        (lambda d: d["linear_attn_config"].update(gate_lower_bound=5.0), "expected a negative number"),
        (lambda d: d.update(num_experts_per_token=300), "exceeds num_experts"),
        (lambda d: d.update(num_expert_group=3), "cannot form 3 groups"),
        (lambda d: d.update(moe_router_activation_func="softmax"), "expected 'sigmoid'"),
        (lambda d: d.pop("linear_attn_config"), "'linear_attn_config' is missing"),
        (lambda d: d.update(rms_norm_eps=10**400), "'rms_norm_eps': expected a finite number"),
        (lambda d: d.update(num_hidden_layers=10**9), "'num_hidden_layers': 1000000000 is more than"),
        (lambda d: d.update(mla_use_nope=False), "'mla_use_nope': waste implements NoPE MLA only"),
        (lambda d: d.pop("mla_use_nope"), "'mla_use_nope': waste implements NoPE MLA only"),
        (lambda d: d.update(rms_norm_eps=0), "'rms_norm_eps': expected a positive number, got 0"),
        (lambda d: d.update(rms_norm_eps=-1e-6), "'rms_norm_eps': expected a positive number"),
        (lambda d: d.update(routed_scaling_factor=0.0), "'routed_scaling_factor': expected a positive number"),
        (lambda d: d.update(eos_token_id=d["vocab_size"]), "'eos_token_id': token id 163840 is outside the vocabulary"),
        (lambda d: d.update(bos_token_id=-1), "'bos_token_id': expected an integer >= 0"),
    ],
)
def test_bad_config_names_the_key(mutate, message):
    with pytest.raises(ConfigError) as e:
        parse_config(_broken(mutate))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_k3_error_paths_name_the_nested_key():
    d = copy.deepcopy(preset_dict("k3"))
    del d["text_config"]["linear_attn_config"]["num_heads"]
    with pytest.raises(ConfigError, match=r"text_config\.linear_attn_config\.num_heads"):
        parse_config(d)


def test_config_file_and_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset_dict("tiny")))
    assert load_config_file(tmp_path) == load_config_file(tmp_path / "config.json") == load_preset("tiny")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config_file(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="no such file"):
        load_config_file(tmp_path / "absent.json")


def test_k3_preset_reads_every_k3_field():
    cfg = load_preset("k3")
    assert cfg.attn_res_block_size == 12 and cfg.latent_moe_use_norm
    assert (cfg.situ_beta, cfg.situ_linear_beta) == (4.0, 25.0)
    assert cfg.expert_quant == "mxfp4" and cfg.routed_expert_hidden_size == 3584
    assert cfg.raw["text_config"]["quantization_config"] == MXFP4_QUANTIZATION_CONFIG


def test_small_k3_presets_have_the_shapes_tests_and_notebooks_need():
    tiny, mini = load_preset("k3-tiny"), load_preset("k3-mini")
    for cfg in (tiny, mini):
        assert cfg.model_type == "kimi_k3" and cfg.hidden_act == "situ" and cfg.expert_quant == "mxfp4"
        assert cfg.kda_layers and cfg.mla_layers and cfg.first_k_dense_replace == 1
        # several AttnRes blocks, the last one partial
        assert cfg.num_layers > 2 * cfg.attn_res_block_size and cfg.num_layers % cfg.attn_res_block_size
        assert cfg.num_expert_group > 1 and cfg.topk_group < cfg.num_expert_group
        assert cfg.kda_gate == "lower_bound" and cfg.kda_full_rank_gate and cfg.mla_output_gate
        assert cfg.q_lora_rank is not None
        # MXFP4 experts need both widths they read in whole groups of 32
        assert cfg.routed_expert_hidden_size % 32 == 0 and cfg.moe_intermediate_size % 32 == 0
        assert cfg.routed_expert_hidden_size < cfg.hidden_size
    assert not tiny.latent_moe_use_norm and tiny.situ_linear_beta is None
    assert mini.latent_moe_use_norm and mini.situ_linear_beta == 25.0
    assert tiny.hidden_size <= 64 and tiny.num_layers <= 6 and tiny.num_experts <= 8
    assert mini.hidden_size >= 512 and mini.num_experts >= 64 and mini.kda_head_dim == 128


def _k3(mutate):
    d = copy.deepcopy(preset_dict("k3"))
    d["text_config"]["quantization_config"] = copy.deepcopy(MXFP4_QUANTIZATION_CONFIG)
    mutate(d["text_config"], d)
    return parse_config(d)


def _quant(text):
    return text["quantization_config"]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda t, d: None, "mxfp4"),
        (lambda t, d: t.pop("quantization_config"), None),
        # the format given once for all groups
        (lambda t, d: _quant(t)["config_groups"]["group_0"].pop("format"), "mxfp4"),
        # the quantization config at the top level instead of under text_config
        (lambda t, d: d.update(quantization_config=t.pop("quantization_config")), "mxfp4"),
        # targets as a regex naming the routed experts
        (lambda t, d: _quant(t)["config_groups"]["group_0"].update(targets=[r"re:.*experts\.\d+\.w[123]$"]), "mxfp4"),
        # the experts ignored: nothing routed is quantised
        (lambda t, d: _quant(t)["ignore"].append("re:.*block_sparse_moe.*"), None),
        # targets that do not reach the experts
        (lambda t, d: _quant(t)["config_groups"]["group_0"].update(targets=["re:.*self_attn.*"]), None),
    ],
)
def test_k3_quantization_config_decides_expert_quant(mutate, expected):
    assert _k3(mutate).expert_quant == expected


def test_null_linear_beta_is_allowed():
    cfg = _k3(lambda t, d: t.update(activation_situ_linear_beta=None))
    assert cfg.situ_linear_beta is None and cfg.situ_beta == 4.0


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t, d: t.update(rms_norm_eps=0.0), "'text_config.rms_norm_eps': expected a positive number"),
        (lambda t, d: t.update(rms_norm_eps=-1e-5), "'text_config.rms_norm_eps': expected a positive number"),
        (lambda t, d: t.update(attn_res_block_size=0), "'text_config.attn_res_block_size': expected an integer >= 1"),
        (lambda t, d: t.update(attn_res_block_size=1.5), "'text_config.attn_res_block_size': expected an integer"),
        (lambda t, d: t.update(routed_expert_hidden_size=3600),
         "'text_config.routed_expert_hidden_size': 3600 is not a multiple of 32"),
        (lambda t, d: t.update(moe_intermediate_size=3000),
         "'text_config.moe_intermediate_size': 3000 is not a multiple of 32"),
        (lambda t, d: t.update(activation_situ_beta=-4.0), "'text_config.activation_situ_beta': expected a positive"),
        (lambda t, d: t.update(activation_situ_linear_beta=0), "'text_config.activation_situ_linear_beta'"),
        (lambda t, d: t.update(latent_moe_use_norm="yes"), "'text_config.latent_moe_use_norm': expected true or false"),
        (lambda t, d: _quant(t).update(format="nvfp4-pack-quantized") or _quant(t)["config_groups"]["group_0"].pop(
            "format"), "'text_config.quantization_config.config_groups.group_0.format': expected"),
        (lambda t, d: _quant(t)["config_groups"]["group_0"]["weights"].update(num_bits=8),
         "'text_config.quantization_config.config_groups.group_0.weights': mxfp4-pack-quantized needs num_bits 4"),
        (lambda t, d: _quant(t).update(quant_method="gptq"), "'text_config.quantization_config.quant_method'"),
        (lambda t, d: _quant(t).update(ignore="re:.*"), "'text_config.quantization_config.ignore': expected a list"),
        # an ignore list that exempts some routed experts and not others: a layer, a projection,
        # one expert (the first MoE layer is layer 1; the k3 preset has 896 experts a layer)
        (lambda t, d: _quant(t)["ignore"].append(r"re:.*layers\.2\.block_sparse_moe\.experts\..*"),
         "quantises some routed experts and not others (language_model.model.layers.1.block_sparse_moe.experts.0.w1 "
         "is mxfp4-pack-quantized, language_model.model.layers.2.block_sparse_moe.experts.0.w1 is not)"),
        (lambda t, d: _quant(t)["ignore"].append(r"re:.*layers\.1\.block_sparse_moe\.experts\..*"),
         "(language_model.model.layers.2.block_sparse_moe.experts.0.w1 is mxfp4-pack-quantized, "
         "language_model.model.layers.1.block_sparse_moe.experts.0.w1 is not)"),
        (lambda t, d: _quant(t)["ignore"].append(r"re:.*\.w2$"), "is mxfp4-pack-quantized, "
         "language_model.model.layers.1.block_sparse_moe.experts.0.w2 is not"),
        (lambda t, d: _quant(t)["ignore"].append(r"re:.*experts\.17\.w1$"), "is mxfp4-pack-quantized, "
         "language_model.model.layers.1.block_sparse_moe.experts.17.w1 is not"),
        # a plain module name, written without the checkpoint's language_model. prefix
        (lambda t, d: _quant(t)["ignore"].append("model.layers.1.block_sparse_moe.experts.17.w1"),
         "is mxfp4-pack-quantized, language_model.model.layers.1.block_sparse_moe.experts.17.w1 is not"),
    ],
)
def test_bad_k3_config_names_the_key(mutate, message):
    with pytest.raises(ConfigError) as e:
        _k3(mutate)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_mxfp4_width_check_applies_only_to_mxfp4_experts():
    cfg = _k3(lambda t, d: (t.update(routed_expert_hidden_size=3600), t.pop("quantization_config")))
    assert cfg.expert_input_size == 3600 and cfg.expert_quant is None
