"""The memory_planning what-if: the hit rate follows the budget, the binding term, plans that do not fit."""

import dataclasses
import json

import numpy as np
import pytest

from waste.analysis.budget import cache_fraction
from waste.analysis.whatif import (
    WhatIfPanel,
    curve_over_hit_rate,
    curve_over_ram,
    measured_points,
    multiply_adds_per_token,
    what_if,
)
from waste.config import load_preset
from waste.plan import make_plan

RATES = {"nvme_gbps": 7.0, "mem_gbps": 20.0, "gmacs": 40.0}


@pytest.fixture(scope="module")
def plans():
    return {t: make_plan(t, context="4K", scheme="q4") for t in ("kimi-linear-48b-a3b", "mini")}


def at(plans, target, gib):
    return dataclasses.replace(plans[target], ram=int(gib * 2**30))


def test_multiply_adds_count_trunk_matrices_and_the_routed_experts(plans):
    cfg = load_preset("kimi-linear-48b-a3b")
    macs = multiply_adds_per_token(plans["kimi-linear-48b-a3b"])
    experts = cfg.num_experts_per_token * len(cfg.moe_layers) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    lm_head = cfg.vocab_size * cfg.hidden_size
    assert experts + lm_head < macs < experts + lm_head + 1.5e9  # about 3B active parameters in all
    assert 2.5e9 < macs < 3.5e9


def test_hit_rate_follows_the_budget_and_rises_with_it(plans):
    points = [what_if(at(plans, "kimi-linear-48b-a3b", g), **RATES) for g in (8, 16, 24, 64, 256)]
    assert all(p.fits and p.hit_rate_from_cache for p in points)
    rates = [p.hit_rate for p in points]
    assert rates == sorted(rates) and rates[0] < 0.5 and rates[-1] == 1.0
    assert rates[2] == pytest.approx(cache_fraction(points[2].plan))
    speeds = [p.tokens_per_second for p in points]
    assert speeds == sorted(speeds)


def test_binding_term_is_named_and_the_bound_is_the_slowest_term(plans):
    p = what_if(at(plans, "kimi-linear-48b-a3b", 8), nvme_gbps=0.5, mem_gbps=20.0, gmacs=40.0)
    assert p.binding == "nvme" and "bound by disk" in p.describe()
    assert p.tokens_per_second == pytest.approx(1 / max(p.seconds.values()))
    full = what_if(at(plans, "kimi-linear-48b-a3b", 256), **RATES)
    assert full.binding == "memory" and full.bound.nvme_bytes == 0
    slow_cpu = what_if(at(plans, "kimi-linear-48b-a3b", 256), nvme_gbps=7.0, mem_gbps=20.0, gmacs=0.5)
    assert slow_cpu.binding == "compute" and "bound by compute" in slow_cpu.describe()
    # When RAM binds, a hand-set hit rate leaves the bound where it is, and the text says why.
    manual = [what_if(at(plans, "mini", 1), hit_rate=h, **RATES) for h in (0.5, 1.0)]
    assert not manual[0].hit_rate_from_cache and "set by hand" in manual[0].describe()
    assert manual[0].binding == "memory" and manual[0].tokens_per_second == manual[1].tokens_per_second


def test_a_plan_that_does_not_fit_gives_no_bound(plans):
    p = what_if(at(plans, "kimi-linear-48b-a3b", 1), **RATES)
    assert not p.fits and p.binding is None and np.isnan(p.tokens_per_second)
    text = p.describe()
    assert "DOES NOT FIT" in text and "tok/s" not in text
    tps, hit = curve_over_ram(lambda r: dataclasses.replace(plans["mini"], ram=r), [2**20, 2**30], **RATES)
    assert np.isnan(tps[0]) and np.isnan(hit[0]) and np.isfinite(tps[1]) and hit[1] == 1.0
    assert np.isnan(curve_over_hit_rate(p.plan, [0.0, 1.0], **RATES)).all()


def test_panel_ram_slider_moves_the_hit_rate(plans):
    make = lambda t, ram: dataclasses.replace(plans[t], ram=ram)  # noqa: E731
    panel = WhatIfPanel({"48B": "kimi-linear-48b-a3b", "mini": "mini"}, make, ram_gib=8, mem_gbps=20, gmacs=40)
    panel.nvme.value = 7.0
    seen = []
    for gib in (8, 16, 32, 64):
        panel.ram.value = gib
        seen.append(panel.result.hit_rate)
        assert panel.hit.value == pytest.approx(round(panel.result.hit_rate, 2)) and panel.hit.disabled
    assert seen == sorted(seen) and seen[0] < seen[-1]
    panel.manual.value = True
    assert not panel.hit.disabled
    panel.hit.value = 0.25
    assert panel.result.hit_rate == 0.25 and not panel.result.hit_rate_from_cache
    panel.manual.value = False
    panel.ram.value = 1
    assert not panel.result.fits and panel.figure is not None
    panel.target.value = "mini"
    assert panel.result.plan.name == "mini" and panel.result.fits


def test_measured_points_from_bench_json(tmp_path, plans):
    assert measured_points(tmp_path) == []
    engine = {"preset": "mini", "runs": [{"scheme": "q4", "decode_tps": 120.0}]}
    (tmp_path / "engine.json").write_text(json.dumps(engine))
    (tmp_path / "streaming.json").write_text(json.dumps({"preset": "mini", "scheme": "q4", "budgets": [
        {"budget_fraction": 0.5, "budget_bytes": 1000, "decode_hit_rate": 0.6, "decode_tps": 40.0}]}))
    points = measured_points(tmp_path, {"mini/q4": 5000})
    assert [(p.label, p.ram_bytes, p.hit_rate, p.tokens_per_second) for p in points] == [
        ("bench/engine.py q4", None, 1.0, 120.0), ("bench/streaming.py 50% cache", 6000, 0.6, 40.0)]
    assert points[0].preset == "mini"
    # bench/engine.py now runs mini and k3-mini in one file, each run naming its preset.
    engine = {"presets": ["mini", "k3-mini"], "runs": [{"preset": "mini", "scheme": "q8", "decode_tps": 100.0},
                                                       {"preset": "k3-mini", "scheme": "q8", "decode_tps": 30.0}]}
    (tmp_path / "engine.json").write_text(json.dumps(engine))
    assert [(p.preset, p.scheme, p.tokens_per_second) for p in measured_points(tmp_path)[:2]] == [
        ("mini", "q8", 100.0), ("k3-mini", "q8", 30.0)]
    # Files another version of a bench wrote (a field renamed, a list for an object) place no point
    # from that file, and no exception: the memory_planning notebook reads whatever bench/results holds.
    (tmp_path / "engine.json").write_text(json.dumps({"runs": [{"scheme": "q8", "decode_tok_s": 100.0}]}))
    assert [p.label for p in measured_points(tmp_path)] == ["bench/streaming.py 50% cache"]
    (tmp_path / "streaming.json").write_text(json.dumps({"preset": "mini", "budgets": [{"fraction": 0.5}]}))
    (tmp_path / "engine.json").write_text(json.dumps([1, 2]))
    assert measured_points(tmp_path) == []


def test_multiply_adds_count_a_tied_lm_head(tmp_path):
    from waste.config import preset_dict

    untied = make_plan("tiny", scheme="f32")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(preset_dict("tiny") | {"tie_word_embeddings": True}))
    # The tied model multiplies by the same 512 x 64 lm_head; only the storage is shared.
    assert multiply_adds_per_token(make_plan(str(path), scheme="f32")) == multiply_adds_per_token(untied)
