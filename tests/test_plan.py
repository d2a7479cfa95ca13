"""The memory planner against hand-computed figures."""

import json
import subprocess
import sys

import pytest

from waste.cli import main
from waste.config import load_preset
from waste.plan import all_mla_state_bytes, make_plan, state_bytes, sweep_contexts

MiB = 1 << 20


def test_k3_reproduces_the_seed_figures_exactly():
    s = state_bytes(load_preset("k3"), 4096)
    assert s.kda_state == 69 * 96 * 128 * 128 * 4 == 414 * MiB
    assert s.mla_latent == 24 * 4096 * 576 * 4 == 216 * MiB
    assert s.conv_rings == 69 * 3 * 3 * 12288 * 4  # 29.1 MiB
    assert round(s.total / MiB) == 659


def test_kimi_linear_state_lines_by_hand():
    cfg = load_preset("kimi-linear-48b-a3b")
    s = state_bytes(cfg, 131072, "bf16")
    assert s.kda_state == 20 * 32 * 128 * 128 * 2
    assert s.conv_rings == 20 * 3 * 3 * 4096 * 2
    assert s.mla_latent == 7 * 131072 * 576 * 2
    assert all_mla_state_bytes(cfg, 131072, "bf16") == 27 * 131072 * 576 * 2


# tiny, by hand (hidden 64, vocab 512, KDA 4x16, MLA 4 heads nope 16 rope 8 v 16 kv_lora 32,
# dense 128, 8 experts of 32, one shared):
#   embedding + lm_head 2 x 512 x 64 = 65536; final norm 64; block norms 5 x 2 x 64 = 640
#   KDA layer: q,k,v 3x64x64 + convs 3x64x4 + A_log 4 + dt_bias 64 + f_a,f_b,g_a,g_b 4x1024
#              + b_proj 4x64 + o_norm 16 + o_proj 64x64 = 21588  (x3 layers)
#   MLA layer: q 96x64 + kv_a 40x64 + kv_a_norm 32 + kv_b 128x32 + o 64x64 = 16928  (x2 layers)
#   dense layer 0: 3 x 128 x 64 = 24576
#   MoE layers 1-4: router 8x64 + bias 8 + shared 3x32x64 = 6664 each
#   trunk = 216092 parameters; one expert = 3 x 32 x 64 = 6144 parameters
TINY_TRUNK_PARAMS = 65536 + 64 + 640 + 3 * 21588 + 2 * 16928 + 24576 + 4 * 6664
TINY_EXPERT_PARAMS = 3 * 32 * 64


def test_tiny_weights_by_hand_f32():
    plan = make_plan("tiny", scheme="f32", context=1024)
    assert TINY_TRUNK_PARAMS == 216092
    assert plan.weights.trunk == 4 * TINY_TRUNK_PARAMS
    assert plan.weights.per_expert == 4 * TINY_EXPERT_PARAMS
    assert plan.weights.experts_total == 4 * TINY_EXPERT_PARAMS * 8 * 4
    assert plan.weights.per_expert_layer == 4 * TINY_EXPERT_PARAMS * 8
    assert plan.touched_per_token == 2 * 4 * 4 * TINY_EXPERT_PARAMS
    assert plan.state.mla_latent == 2 * 1024 * 40 * 4


def test_ram_budget_counts_experts_that_fit():
    plan = make_plan("tiny", scheme="f32", context=1024, ram=2 * MiB)
    room = 2 * MiB - 4 * (TINY_TRUNK_PARAMS - 512 * 64) - plan.state.total  # the embedding is read from disk
    assert plan.cache_room == room
    assert plan.experts_fit == min(room // (4 * TINY_EXPERT_PARAMS), 32)
    short = make_plan("tiny", scheme="f32", ram="100K")
    assert short.cache_room < 0 and short.experts_fit == 0


def test_quantised_schemes_shrink_weights_in_order():
    sizes = {s: make_plan("kimi-linear-48b-a3b", scheme=s).weights for s in ("f32", "bf16", "q8", "q4")}
    assert sizes["f32"].trunk > sizes["bf16"].trunk > sizes["q8"].trunk == sizes["q4"].trunk
    assert sizes["q8"].per_expert > sizes["q4"].per_expert
    # Kimi-Linear has about 48 billion parameters, almost all of them in the routed experts.
    params = (sizes["bf16"].trunk + sizes["bf16"].experts_total) / 2
    assert 47e9 < params < 50e9


def test_sweep_runs_to_the_maximum():
    cfg = load_preset("kimi-linear-48b-a3b")
    ctxs = sweep_contexts(cfg)
    assert ctxs[0] == 1024 and ctxs[-1] == 1048576 and len(ctxs) == 11


def test_cli_plan_k3_prints_the_seed_figures(capsys):
    assert main(["plan", "k3", "--context", "4K"]) == 0
    out = capsys.readouterr().out
    for figure in ("414 MiB", "216 MiB", "29.1 MiB", "659 MiB"):
        assert figure in out


def test_cli_plan_json_and_sweep(capsys):
    assert main(["plan", "kimi-linear-48b-a3b", "--context", "128K", "--json", "--sweep", "--ram", "24G"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["context"] == 131072 and d["mla_latent_bytes"] == 7 * 131072 * 576 * 4
    assert d["sweep"][-1]["context"] == 1048576 and d["experts_fit"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "nonesuch"], "not a preset"),
        (["plan", "tiny", "--context", "lots"], "context 'lots'"),
        (["plan", "tiny", "--context", "1M"], "exceeds the model's maximum"),
        (["plan", "tiny", "--ram", "much"], "--ram 'much'"),
        (["plan", "tiny", "--quant", "q2"], "invalid choice"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_console_script_exit_code(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{}")
    r = subprocess.run([sys.executable, "-m", "waste.cli", "plan", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and "'model_type' is missing" in r.stderr


def test_tiny_expert_bytes_by_hand_quantised():
    # docs/QUANT.md: rows in blocks of 16, K in groups of 32; per (block, group) q8g stores
    # 512 code bytes + 16 float16 scales, q4g 256 + 16 x 2; plus one float32 tscale per matrix.
    # w1, w3 [32, 64]: 2 blocks x 2 groups; w2 [64, 32]: 4 blocks x 1 group. The container stores
    # each buffer 64-byte aligned and the blob padded to 4096 bytes (docs/CONTAINER.md).
    from waste.plan import matrix_bytes

    q8 = 2 * (2 * 2 * (512 + 32) + 4) + (4 * 1 * (512 + 32) + 4)
    q4 = 2 * (2 * 2 * (256 + 32) + 4) + (4 * 1 * (256 + 32) + 4)
    assert matrix_bytes("q8g", (32, 64)) * 2 + matrix_bytes("q8g", (64, 32)) == q8 == 6540
    assert matrix_bytes("q4g", (32, 64)) * 2 + matrix_bytes("q4g", (64, 32)) == q4 == 3468
    assert make_plan("tiny", scheme="q8").weights.per_expert == 8192
    assert make_plan("tiny", scheme="q4").weights.per_expert == 4096


def test_plan_of_a_container_reads_the_manifest(tmp_path, capsys):
    from waste.container.reader import open_container
    from waste.testing import tiny_container

    path = tiny_container(tmp_path / "q4", quant="q4")
    plan = make_plan(str(path), context="1K")
    with open_container(path) as c:
        counts = c.byte_counts()
        blob = c.expert_span(1, 0)[1]
    assert plan.scheme == "q4" and plan.weights.source == "container"
    assert plan.weights.trunk == counts["trunk_bytes"] and plan.weights.experts_total == counts["expert_bytes"]
    # A pread fetches whole 4 KiB-aligned blobs, so the container's expert size is the blob's.
    assert plan.weights.per_expert == blob == 4096 == make_plan("tiny", scheme="q4").weights.per_expert
    # The trunk differs from the formula only by the 64-byte alignment of each tensor.
    formula = make_plan("tiny", scheme="q4").weights.trunk
    assert formula <= plan.weights.trunk < formula + 64 * len(c.names())
    assert main(["plan", str(path), "--quant", "q8"]) == 2
    assert "stored as 'q4'" in capsys.readouterr().err
    assert main(["plan", str(path)]) == 0
    assert "(container)" in capsys.readouterr().out


# K3 (FACTS.md) by hand: D 7168, vocab 163840, 69 KDA + 24 MLA layers, layer 0 dense, 92 MoE layers.
# Matrices are stored at the scheme's width; vectors, conv taps, the router and the AttnRes
# projections stay float32 arrays in every scheme (4 bytes each).
K3_D, K3_HK = 7168, 96 * 128
K3_KDA_MATRICES = 3 * K3_HK * K3_D + 128 * K3_D + K3_HK * 128 + 96 * K3_D + K3_HK * K3_D + K3_D * K3_HK
K3_KDA_ARRAYS = 3 * K3_HK * 4 + 128 + K3_HK + 128  # convs; A_log [128]; dt_bias; o_norm
K3_MLA_MATRICES = 1536 * K3_D + 96 * 192 * 1536 + 576 * K3_D + 96 * 256 * 512 + K3_D * 96 * 128 + 96 * 128 * K3_D
K3_MLA_ARRAYS = 1536 + 512  # q_a and kv_a layernorms
K3_MOE_MATRICES = 3584 * K3_D + K3_D * 3584 + 3 * (2 * 3072) * K3_D  # latent down/up, two shared experts
K3_MOE_ARRAYS = 896 * K3_D + 896 + 3584  # router, its bias, the latent norm
K3_LAYER_ARRAYS = 2 * K3_D + 4 * K3_D  # two block norms; AttnRes norm + proj before attention and before the FFN
K3_TRUNK_MATRICES = 2 * 163840 * K3_D + 69 * K3_KDA_MATRICES + 24 * K3_MLA_MATRICES + 3 * 33792 * K3_D \
    + 92 * K3_MOE_MATRICES  # embedding, lm_head, attention, dense FFN, MoE
K3_TRUNK_ARRAYS = K3_D + 2 * K3_D + 69 * K3_KDA_ARRAYS + 24 * K3_MLA_ARRAYS + 93 * K3_LAYER_ARRAYS \
    + 92 * K3_MOE_ARRAYS  # final norm, output AttnRes, ...
K3_TRUNK_PARAMS = K3_TRUNK_MATRICES + K3_TRUNK_ARRAYS
K3_TRUNK_BF16 = 2 * K3_TRUNK_MATRICES + 4 * K3_TRUNK_ARRAYS
# one routed expert: w1, w3 [3072, 3584] and w2 [3584, 3072], 4 bits per weight + one scale byte per 32
K3_EXPERT_MXFP4 = 3 * 3072 * 3584 * 17 // 32


def test_k3_weights_by_hand_bf16():
    plan = make_plan("k3", scheme="bf16")
    w = plan.weights
    assert w.trunk == K3_TRUNK_BF16
    assert w.expert_storage == "mxfp4" and w.per_expert == K3_EXPERT_MXFP4 == 17_547_264
    assert w.per_expert * 8 == 3 * 3072 * 3584 * 4.25  # 4.25 bits per weight
    assert w.experts_total == 92 * 896 * K3_EXPERT_MXFP4
    assert w.by_class["attn_res"] == 4 * (93 * 4 * K3_D + 2 * K3_D)
    assert w.by_class["latent_moe"] == 92 * (2 * 2 * 3584 * K3_D + 4 * 3584)
    # K3 is a 2.8-trillion-parameter model
    assert 2.7e12 < K3_TRUNK_PARAMS + 92 * 896 * 3 * 3072 * 3584 < 2.9e12


def test_k3_cache_fraction_at_24_and_512_gib(capsys):
    plan = make_plan("k3", scheme="bf16")
    resident = K3_TRUNK_BF16 - 2 * 163840 * K3_D + plan.state.total  # the bf16 embedding is read from disk
    total = 92 * 896
    assert plan.experts_fit_at(24 << 30) == 0 and plan.cache_room_at(24 << 30) == (24 << 30) - resident < 0
    fit = ((512 << 30) - resident) // K3_EXPERT_MXFP4
    assert plan.experts_fit_at(512 << 30) == fit and 0 < fit < total
    assert main(["plan", "k3", "--quant", "bf16", "--json"]) == 0
    budgets = json.loads(capsys.readouterr().out)["budgets"]
    assert [b["ram_bytes"] for b in budgets] == [24 << 30, 512 << 30]
    assert budgets[1]["experts_fit"] == fit and budgets[1]["experts_fit_fraction"] == fit / total
    assert main(["plan", "k3", "--quant", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "RAM budget 24 GiB" in out and "RAM budget 512 GiB" in out and "does NOT fit" in out
    assert f"experts that fit: {fit:,d} of {total:,d} ({100 * fit / total:.1f}%)" in out
    assert "routed experts (mxfp4), total" in out


def test_k3_experts_can_be_priced_in_another_storage():
    q4 = make_plan("k3", scheme="q4", experts="q4").weights
    mx = make_plan("k3", scheme="q4").weights
    assert (q4.expert_storage, mx.expert_storage) == ("q4g", "mxfp4")
    assert q4.trunk == mx.trunk and q4.per_expert > mx.per_expert  # Q4G: 4.5 bits and more per weight


def _dense_only_config(tmp_path):
    from waste.config import preset_dict

    d = preset_dict("tiny")
    d["first_k_dense_replace"] = d["num_hidden_layers"]  # every FFN dense: no routed experts at all
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    return path


def test_dense_only_model_plans_without_dividing_by_zero(tmp_path, capsys):
    path = _dense_only_config(tmp_path)
    assert main(["plan", str(path), "--ram", "1M"]) == 0
    out = capsys.readouterr().out
    assert "experts that fit: none (no routed experts)" in out and "nan" not in out.lower()
    assert main(["plan", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["experts_count"] == 0 and d["experts_total_bytes"] == 0 and d["expert_bytes_per_token"] == 0
    assert [b["experts_fit_fraction"] for b in d["budgets"]] == [None, None]


@pytest.mark.parametrize(("preset", "scheme"), [("tiny", "q8"), ("tiny", "q4"), ("k3-tiny", "q4"),
                                                ("kimi-linear-48b-a3b", "q4")])
def test_formula_expert_bytes_are_the_containers_blob(preset, scheme):
    # experts.bin holds one 4096-aligned blob per expert (docs/CONTAINER.md); the cache and the
    # disk deal in blobs, so the planner prices a preset's expert as the container will store it.
    from waste.container.format import plan_experts

    w = make_plan(preset, scheme=scheme).weights
    assert w.per_expert == plan_experts(load_preset(preset), w.expert_storage).blob_bytes
    assert w.per_expert % 4096 == 0


@pytest.mark.parametrize("option", [["--disk-gbps", "3"], ["--mem-gbps", "20"], ["--measure"]])
def test_prediction_options_without_a_prediction_are_refused(option, capsys):
    # The bandwidths only feed the run prediction of a container with --ram; anywhere else they
    # would be silently ignored.
    assert main(["plan", "tiny", "--ram", "1G", *option]) == 2
    err = capsys.readouterr().err
    assert option[0] in err and err.count("\n") == 1


def test_bf16_state_is_refused_for_a_run_prediction(tmp_path, capsys):
    # waste run keeps its KDA state and MLA cache in float32 (waste.engine.session); a prediction
    # of that run cannot honour --state-dtype bf16, so it says so before measuring anything.
    from waste.testing import tiny_container

    path = tiny_container(tmp_path / "q4", quant="q4")
    assert main(["plan", str(path), "--ram", "1G", "--state-dtype", "bf16", "--disk-gbps", "1", "--mem-gbps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--state-dtype bf16" in err and err.count("\n") == 1
    assert main(["plan", str(path), "--state-dtype", "bf16"]) == 0  # no --ram: the model's bytes alone
    assert "state bf16" in capsys.readouterr().out
