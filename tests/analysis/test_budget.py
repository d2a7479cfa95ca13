"""Plan breakdowns, the decode speed bound and the state curves against hand-computed figures."""

import json

import numpy as np
import pytest

from waste.analysis import budget
from waste.analysis.budget import (
    PLAN_PARTS,
    budget_summary,
    cache_fraction,
    copy_bandwidth,
    copy_buffers,
    crossover_context,
    decode_speed_bound,
    plan_breakdown,
    prefill_speed_bound,
    ram_breakdown,
    state_curve,
    state_curves,
    target_config,
)
from waste.config import load_preset, preset_dict
from waste.errors import WasteError
from waste.plan import make_plan, state_bytes

MiB = 1 << 20


def test_breakdown_parts_add_up_to_the_plan():
    plan = make_plan("tiny", scheme="f32", context=1024)
    parts = plan_breakdown(plan)
    assert tuple(parts) == PLAN_PARTS
    assert sum(parts.values()) == plan.resident + parts["row_read"] + plan.weights.experts_total
    assert parts["row_read"] == 4 * 512 * 64  # tiny's untied f32 embedding: read from disk, not resident
    assert parts["mla_latent"] == 2 * 1024 * 40 * 4


def test_ram_breakdown_fills_the_budget_with_whole_experts():
    plan = make_plan("tiny", scheme="f32", context=1024, ram=2 * MiB)
    ram = ram_breakdown(plan)
    assert sum(ram.values()) == 2 * MiB
    assert ram["expert_cache"] == plan.experts_fit * plan.weights.per_expert
    assert 0 <= ram["free"] < plan.weights.per_expert or plan.experts_fit == 32
    assert cache_fraction(plan) == plan.experts_fit / 32
    short = ram_breakdown(make_plan("tiny", scheme="f32", ram="100K"))
    assert short["expert_cache"] == 0 and short["free"] < 0
    with pytest.raises(WasteError, match="RAM budget"):
        ram_breakdown(make_plan("tiny", scheme="f32"))


def test_decode_bound_by_hand_on_tiny():
    plan = make_plan("tiny", scheme="f32", context=1024)
    # experts per token: top-2 x 4 MoE layers x (3 x 32 x 64 x 4 B) = 196608; half missed.
    # RAM: trunk 864368 - embedding 131072, KDA state and rings twice (12288 + 6912),
    # latent 2 x 1024 x 40 x 4 once, plus all the experts (missed ones pass through RAM too).
    b = decode_speed_bound(plan, 0.5, nvme_gbps=2.0, mem_gbps=60.0)
    assert b.nvme_bytes == 98304
    assert b.memory_bytes == (864368 - 131072) + 2 * (12288 + 6912) + 327680 + 196608
    assert b.nvme_seconds == pytest.approx(98304 / 2e9)
    assert b.memory_seconds == pytest.approx(b.memory_bytes / 60e9)
    assert b.tokens_per_second == pytest.approx(1 / max(b.nvme_seconds, b.memory_seconds))
    assert b.serial_tokens_per_second == pytest.approx(1 / (b.nvme_seconds + b.memory_seconds))
    assert b.serial_tokens_per_second < b.tokens_per_second


def test_decode_bound_rises_with_hit_rate_and_is_memory_bound_at_full_hits():
    plan = make_plan("kimi-linear-48b-a3b", scheme="bf16")
    bounds = [decode_speed_bound(plan, h, 7.0, 60.0) for h in (0, 0.25, 0.5, 0.75, 0.99, 1)]
    speeds = [b.tokens_per_second for b in bounds]
    assert speeds == sorted(speeds) and len(set(b.memory_bytes for b in bounds)) == 1
    assert decode_speed_bound(plan, 0.0, 7.0, 60.0).limited_by == "nvme"
    full = decode_speed_bound(plan, 1.0, 7.0, 60.0)
    assert full.nvme_bytes == 0 and full.limited_by == "memory"
    bads = ({"hit_rate": 1.5}, {"nvme_gbps": 0}, {"mem_gbps": -1})
    for bad in bads:
        with pytest.raises(WasteError):
            decode_speed_bound(plan, **({"hit_rate": 0.5, "nvme_gbps": 7.0, "mem_gbps": 60.0} | bad))


def test_prefill_bound_by_hand_on_tiny():
    """tiny: 8 experts, top-2, 4 MoE layers of 8 x 24576 B (f32). One token routes to 2 experts per
    layer, the decode token's bytes; a long pass to all 8; the streaming store reads them again
    every pass, the memory map once."""
    plan = make_plan("tiny", scheme="f32", context=4096)
    layer = 8 * 24576
    one = prefill_speed_bound(plan, 1, nvme_gbps=2.0, mem_gbps=60.0)
    assert one.nvme_bytes == plan.touched_per_token == 4 * 2 * 24576
    # 3 tokens of 8 experts, top-2: 8 * (1 - (6/8)^3) = 4.625 experts per layer expected.
    assert prefill_speed_bound(plan, 3, 2.0, 60.0).nvme_bytes == round(4 * 4.625 * 24576)
    trunk_read = 864368 - 131072
    streamed = prefill_speed_bound(plan, 4096, nvme_gbps=2.0, mem_gbps=60.0, pass_tokens=2048)
    assert streamed.nvme_bytes == 2 * 4 * layer == 2 * plan.weights.experts_total
    assert streamed.memory_bytes == 2 * trunk_read + 2 * 4 * layer
    mapped = prefill_speed_bound(plan, 4096, nvme_gbps=2.0, mem_gbps=60.0, pass_tokens=2048, experts_fit=True)
    assert mapped.nvme_bytes == plan.weights.experts_total and mapped.memory_bytes == streamed.memory_bytes
    assert streamed.limited_by == "nvme"
    assert streamed.tokens_per_second == pytest.approx(4096 / (2 * 4 * layer / 2e9))
    assert mapped.tokens_per_second == pytest.approx(2 * streamed.tokens_per_second)
    slow_ram = prefill_speed_bound(plan, 4096, nvme_gbps=2.0, mem_gbps=0.001, pass_tokens=2048)
    assert slow_ram.limited_by == "memory"
    assert slow_ram.tokens_per_second == pytest.approx(4096 / (slow_ram.memory_bytes / 1e6))
    for bad in ({"prompt_tokens": 0}, {"nvme_gbps": 0}, {"mem_gbps": -1}):
        with pytest.raises(WasteError):
            prefill_speed_bound(plan, **({"prompt_tokens": 10, "nvme_gbps": 2.0, "mem_gbps": 60.0} | bad))


def test_state_curve_matches_the_planner_and_the_seed():
    cfg = load_preset("k3")
    ctxs = [1024, 4096, 1 << 20]
    curve = state_curve(cfg, ctxs)
    assert list(curve) == [state_bytes(cfg, c).total for c in ctxs]
    assert round(curve[1] / MiB) == 659
    assert list(state_curve(cfg, ctxs, "bf16") * 2) == list(curve)
    assert list(state_curve(cfg, ctxs, all_mla=True)) == [93 * c * 576 * 4 for c in ctxs]
    curves = state_curves({"K3": cfg}, ctxs)
    assert set(curves) == {"K3", "K3, all MLA"}


@pytest.mark.parametrize("preset", ["tiny", "kimi-linear-48b-a3b", "k3"])
def test_crossover_is_where_all_mla_overtakes(preset):
    cfg = load_preset(preset)
    c = crossover_context(cfg)
    hybrid = state_curve(cfg, [c - 1, c])
    all_mla = state_curve(cfg, [c - 1, c], all_mla=True)
    assert hybrid[0] >= all_mla[0] and hybrid[1] < all_mla[1]


def test_k3_crossover_by_hand():
    # fixed KDA state + rings, over the latent rows per token that 69 KDA layers do not keep
    fixed = 69 * 96 * 128 * 128 * 4 + 69 * 3 * 3 * 12288 * 4
    assert crossover_context(load_preset("k3")) == fixed // (69 * 576 * 4) + 1 == 2923


def test_target_config_reads_presets_and_config_files(tmp_path):
    assert target_config("tiny")[1].hidden_size == 64
    (tmp_path / "config.json").write_text(json.dumps(preset_dict("mini")))
    name, cfg = target_config(str(tmp_path))
    assert name == tmp_path.name and cfg == load_preset("mini")


def test_budget_summary_names_the_figures():
    plan = make_plan("tiny", scheme="f32", context=1024, ram=2 * MiB)
    text = budget_summary(plan, decode_speed_bound(plan, 0.5, 7.0, 60.0))
    assert f"{plan.experts_fit:,d} of 32 experts fit" in text and "tok/s" in text
    short = make_plan("tiny", scheme="f32", ram="100K")
    assert "does NOT fit" in budget_summary(short, decode_speed_bound(short, 0.5, 7.0, 60.0))


def test_copy_bandwidth_is_measured(monkeypatch) -> None:
    """The notebook's default RAM bandwidth is a measurement of this machine, not a constant: on a
    clock that makes the copies take 4, 2 and 3 ms, it reports the best round (2 ms) and counts
    bytes read plus bytes written."""
    durations = iter([0.004, 0.002, 0.003])
    now = [0.0]
    started: list[float] = []

    def fake_clock() -> float:
        if started:  # the end of a round: advance by that round's duration
            now[0] = started.pop() + next(durations)
        else:
            started.append(now[0])
        return now[0]

    monkeypatch.setattr(budget.time, "perf_counter", fake_clock)
    result = copy_bandwidth(4 << 20, rounds=3)
    assert result["buffer_bytes"] == 4 << 20
    assert result["best_seconds"] == pytest.approx(0.002)
    assert result["gbps"] == pytest.approx(2 * (4 << 20) / 0.002 / 1e9)


def test_copy_bandwidth_on_threads() -> None:
    """A copy on several threads (uneven slices) runs and says on how many; zero threads is refused."""
    result = copy_bandwidth((4 << 20) + 12, rounds=1, threads=3)
    assert result["threads"] == 3 and result["gbps"] > 0
    with pytest.raises(WasteError):
        copy_bandwidth(4 << 20, threads=0)


def test_copy_bandwidth_reuses_given_buffers() -> None:
    """With buffers from copy_buffers, the copy measures those (their size, whatever nbytes says)
    and leaves the destination equal to the source."""
    src, dst = copy_buffers(1 << 20)
    result = copy_bandwidth(64 << 20, rounds=2, threads=2, buffers=(src, dst))
    assert result["buffer_bytes"] == 1 << 20 and result["gbps"] > 0
    assert np.array_equal(src, dst)


def test_read_bandwidth_reads_the_whole_buffer() -> None:
    """The plain read sums every row once whatever the split into threads (uneven here), reports
    the bytes it read (a whole number of READ_LANES rows), and refuses zero threads."""
    rng = np.random.default_rng(0)
    rows = rng.integers(-4, 5, (1001, budget.READ_LANES)).astype(np.float32)  # exact float sums
    for parts in (1, 2, 3):
        assert budget._read_all(rows, parts) == rows.sum(dtype=np.float64)
    result = budget.read_bandwidth(np.ones(1000 * budget.READ_LANES + 7, np.float32), rounds=2, threads=2)
    assert result["buffer_bytes"] == 1000 * budget.READ_LANES * 4 and result["threads"] == 2 and result["gbps"] > 0
    with pytest.raises(WasteError):
        budget.read_bandwidth(np.ones(1024, np.float32), threads=0)


def test_load_scale_bench(tmp_path) -> None:
    import json

    from waste.analysis.budget import load_scale_bench
    from waste.errors import WasteError

    run = {"store": "streaming", "cache_budget": 5, "decode_hit_rate_steady": 0.5, "decode_tps_steady": 2.5,
           "prefill_tps": 30.0, "peak_rss": 9, "memory_plan": {"available": 20, "planned_peak": 10},
           "prediction": {"decode_bound_tps_uniform": 4.0, "decode_bound_tps_measured_hit": 3.5,
                          "waste_plan": {"decode_bound_tps": 3.9, "prefill_bound_tps": 12.5}}}
    path = tmp_path / "scale.json"
    path.write_text(json.dumps({"runs": [run]}))
    (point,) = load_scale_bench(path)
    assert point["ram"] == 20 and point["decode_tps"] == 2.5 and point["bound_tps"] == 3.5
    assert point["predicted_tps"] == 3.9 and point["predicted_prefill_tps"] == 12.5
    path.write_text(json.dumps({"runs": [{"store": "mmap"}]}))
    with pytest.raises(WasteError, match="not a bench/scale.py result"):
        load_scale_bench(path)
    with pytest.raises(WasteError, match="no such bench result"):
        load_scale_bench(tmp_path / "absent.json")


def test_tied_embeddings_are_read_whole_by_the_lm_head(tmp_path):
    # With tie_word_embeddings the lm_head multiplies by the embedding table (waste.engine.model),
    # so a token reads all of it, not one row: nothing is left out of the RAM traffic.
    d = preset_dict("tiny") | {"tie_word_embeddings": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    plan = make_plan(str(path), scheme="f32", context=1024)
    assert "lm_head" not in plan.weights.by_class and plan.weights.by_class["embedding"] == 512 * 64 * 4
    b = decode_speed_bound(plan, 0.5, nvme_gbps=2.0, mem_gbps=60.0)
    assert b.memory_bytes == plan.weights.trunk + 2 * (12288 + 6912) + 327680 + 196608
    p = prefill_speed_bound(plan, 4096, nvme_gbps=2.0, mem_gbps=60.0, pass_tokens=2048)
    assert p.memory_bytes == 2 * plan.weights.trunk + 2 * plan.weights.experts_total
