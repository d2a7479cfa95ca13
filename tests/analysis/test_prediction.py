"""`waste plan CONTAINER --ram R`: a run's cache, hit rate, decode bound and peak RSS, from the
arithmetic `waste run` plans with, and the bandwidths it is given, caches or measures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import waste.analysis.machine as machine
from waste.analysis.budget import decode_speed_bound, predict_run, prefill_speed_bound, trace_hit_rate
from waste.analysis.cache_sim import simulate
from waste.analysis.machine import Bandwidth, Bandwidths, bandwidths
from waste.cli import main
from waste.container import open_container
from waste.engine.trace import load
from waste.plan import _trace_origin, make_plan
from waste.testing import tiny_container

RATES = Bandwidths(Bandwidth(2.0, "given"), Bandwidth(10.0, "given"))


# A context whose prompt works in less memory (1 MB) than half the experts of the q4 container
# below take (2 MB), so that a plan can cache half of them while a prompt still fits.
CONTEXT = 64


@pytest.fixture(scope="module")
def q4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_container(tmp_path_factory, quant="q4", overrides={"num_experts": 256})


def _ram_for_half_the_experts(plan, runtime: int) -> int:
    """RAM whose run plan leaves a decode cache of half the experts (headroom at its 256 MiB floor)."""
    zero = predict_run(plan, 0, RATES, runtime=runtime).memory
    return zero.decode_resident + zero.headroom + plan.weights.experts_total // 2


def test_cli_prediction_is_predict_run(q4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WASTE_CACHE_DIR", str(tmp_path))
    assert main(["plan", str(q4), "--ram", "8G", "--disk-gbps", "2", "--mem-gbps", "10", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["run"]
    mp = run["memory_plan"]
    assert mp["runtime"] > 0 and mp["available"] == 8 << 30 and mp["experts_fit"]
    expected = predict_run(make_plan(str(q4), ram="8G"), 8 << 30, RATES, runtime=mp["runtime"])
    assert run["planned_peak_rss"] == expected.memory.planned_peak == mp["planned_peak"]
    assert run["hit_rate"] == 1.0 and run["decode_bound_tps"] == pytest.approx(expected.bound.tokens_per_second)
    # The prompt is the context less the generated tokens; every expert fits, so it reads each once.
    plan = make_plan(str(q4), ram="8G")
    assert run["prompt_tokens"] == expected.prefill.prompt_tokens == plan.context - expected.decode_tokens > 0
    cold = prefill_speed_bound(plan, run["prompt_tokens"], 2.0, 10.0, experts_fit=True)
    assert run["prefill_bound_tps"] == pytest.approx(cold.tokens_per_second)
    assert run["prefill_disk_bytes"] == cold.nvme_bytes
    assert run["disk_source"] == "given (--disk-gbps)" and run["mem_source"] == "given (--mem-gbps)"
    assert not (tmp_path / "machine.json").exists()  # nothing measured, nothing cached
    # A decode step's compute is measured on the container's model (every expert fits: no disk).
    compute = run["decode_compute"]
    assert compute["pool"] == plan.config.num_experts_per_token + 1 and 0 < compute["step_seconds"] < 10
    assert run["decode_estimate_tps"] == run["decode_estimate_serial_tps"] == pytest.approx(1 / compute["step_seconds"])
    assert main(["plan", str(q4), "--ram", "8G", "--disk-gbps", "2", "--mem-gbps", "10"]) == 0
    text = capsys.readouterr().out
    assert "waste run with 8 GiB available" in text and "planned peak RSS" in text and "decode bound" in text
    assert "decode estimate" in text and "a step's compute measured at" in text
    assert f"prefill of the {run['prompt_tokens']} prompt tokens from a cold cache" in text
    assert main(["plan", "tiny", "--ram", "8G", "--json"]) == 0  # a preset: the model's figures, no run
    assert "run" not in json.loads(capsys.readouterr().out)


def test_uniform_routing_hit_rate_is_the_cached_fraction(q4: Path) -> None:
    plan = make_plan(str(q4), context=CONTEXT)
    runtime = 300 << 20
    ram = _ram_for_half_the_experts(plan, runtime)
    p = predict_run(plan, ram, RATES, runtime=runtime)
    total = plan.config.num_experts * plan.weights.expert_layers
    assert p.fits and not p.memory.experts_fit and p.memory.cache_budget == plan.weights.experts_total // 2
    assert p.cached_experts == p.memory.cache_budget // plan.weights.per_expert and 0 < p.cached_experts < total
    assert p.hit_rate == p.cached_experts / total and "uniform" in p.hit_rate_source
    bound = decode_speed_bound(plan, p.hit_rate, 2.0, 10.0)
    assert p.bound == bound and p.memory.planned_peak == p.memory.decode_resident + p.memory.cache_budget
    short = predict_run(plan, 1 << 20, RATES, runtime=runtime)
    assert not short.fits and "does NOT fit" in short.describe()


def test_decode_estimate_puts_the_disk_beside_the_measured_compute(q4: Path) -> None:
    """With a measured step, the estimate runs from the step and the disk's time for the misses one
    after the other to the larger of the two; without one there is none."""
    from waste.analysis.compute import DecodeCompute

    plan = make_plan(str(q4), context=CONTEXT)
    runtime = 300 << 20
    ram = _ram_for_half_the_experts(plan, runtime)
    assert predict_run(plan, ram, RATES, runtime=runtime).decode_estimate is None
    disk = decode_speed_bound(plan, predict_run(plan, ram, RATES, runtime=runtime).hit_rate, 2.0, 10.0).nvme_seconds
    assert disk > 0
    for step in (disk / 4, disk * 3):
        p = predict_run(plan, ram, RATES, runtime=runtime, compute=DecodeCompute(step, 8, 9, 1 << 20))
        overlapped, serial = p.decode_estimate
        assert overlapped == pytest.approx(1 / max(step, disk)) and serial == pytest.approx(1 / (step + disk))
        as_dict = p.as_dict()
        assert as_dict["decode_estimate_tps"] == overlapped and as_dict["decode_compute"]["step_seconds"] == step
        assert f"decode estimate {serial:.2f} to {overlapped:.2f} tok/s" in p.describe()
    # Random blob reads measured beside the step price the misses instead of the disk bandwidth.
    bound = predict_run(plan, ram, RATES, runtime=runtime).bound
    p = predict_run(plan, ram, RATES, runtime=runtime, compute=DecodeCompute(disk, 8, 9, 1 << 20, 0.5, 1 << 20))
    blob_disk = bound.nvme_bytes / 0.5e9
    assert p.estimate_disk_seconds == pytest.approx(blob_disk) and blob_disk == pytest.approx(4 * disk)
    assert p.decode_estimate == pytest.approx((1 / blob_disk, 1 / (disk + blob_disk)))
    assert "0.50 GB/s, random blobs read" in p.describe()
    # Guesses their layer did not ask for add their reads where the expert is not cached.
    guessing = predict_run(plan, ram, RATES, runtime=runtime,
                           compute=DecodeCompute(disk, 8, 9, 1 << 20, 0.5, 1 << 20, 6.0))
    expert_bytes = plan.weights.per_expert
    unused = 6.0 * (1 - guessing.hit_rate) * expert_bytes
    assert guessing.unused_guess_bytes == pytest.approx(unused) and unused > 0
    assert guessing.estimate_disk_seconds == pytest.approx((bound.nvme_bytes + unused) / 0.5e9)
    assert guessing.as_dict()["decode_estimate_unused_guess_bytes"] == pytest.approx(unused)
    assert "(with 6.0 unused guesses a step)" in guessing.describe()


def test_trace_gives_the_hit_rate(q4: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ids = ",".join(str(int(t)) for t in np.random.default_rng(3).integers(3, 500, 40))
    trace_path = tmp_path / "t.npz"
    assert main(["run", str(q4), "--prompt-ids", ids, "--max-new", "24", "--trace-out", str(trace_path)]) == 0
    capsys.readouterr()
    trace = load(trace_path)
    plan = make_plan(str(q4), context=CONTEXT)
    runtime = 300 << 20
    p = predict_run(plan, _ram_for_half_the_experts(plan, runtime), RATES, runtime=runtime, trace=trace,
                    trace_name="t.npz")
    sim = simulate(trace, "lru", p.memory.cache_budget // plan.weights.per_expert)
    req = trace.requests()
    decode = np.repeat(req.phase == 1, np.diff(req.start))
    assert p.hit_rate == trace_hit_rate(trace, p.memory.cache_budget, plan.weights.per_expert)
    assert p.hit_rate == sim.hit[decode].mean() and "routing trace t.npz" in p.hit_rate_source
    assert main(["plan", "tiny", "--trace", str(trace_path)]) == 2
    assert "needs a container and --ram" in capsys.readouterr().err
    with open_container(q4) as container:
        assert trace.metadata == {"container": str(q4), "container_sha256": container.manifest_sha256}
        assert _trace_origin(trace.metadata, container.manifest_sha256) == ""


def test_a_trace_of_another_model_is_named_so() -> None:
    recorded = {"container": "/m/other.waste", "container_sha256": "ab" * 32}
    assert (_trace_origin(recorded, "cd" * 32)
            == " (recorded on another container, /m/other.waste: that model's routing)")
    assert _trace_origin({}, "cd" * 32) == " (recorded without naming its container)"
    assert _trace_origin({"synthetic": True, "skew": 1.0}, "cd" * 32) == " (synthetic)"


def test_bandwidths_measured_once_then_cached(q4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WASTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(machine, "MEMORY_SAMPLE_BYTES", 4 << 20)
    experts = q4 / "experts.bin"
    first = bandwidths(disk_file=experts)
    assert first.memory.source.startswith("measured now") and first.memory.gbps > 0
    assert "too short a read to cache" in first.disk.source  # tiny's experts.bin: used once, not cached
    monkeypatch.setattr(machine, "MIN_CACHED_DISK_SAMPLE", 0)
    second = bandwidths(disk_file=experts)
    assert second.memory.source.startswith("measured ") and "cached in" in second.memory.source
    assert second.memory.gbps == first.memory.gbps and second.disk.source.startswith("measured now")
    third = bandwidths(disk_file=experts)
    assert third.disk.gbps == second.disk.gbps and "cached in" in third.disk.source
    assert not third.disk.source.startswith("measured now")
    again = bandwidths(disk_file=experts, measure=True)
    assert again.disk.source.startswith("measured now") and again.memory.source.startswith("measured now")
    given = bandwidths(disk_file=experts, disk_gbps=1.5, mem_gbps=3.0)
    assert (given.disk.gbps, given.memory.gbps) == (1.5, 3.0)


def test_memory_is_what_the_decode_kernel_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory figure is the q8g matvec's own read speed over a matrix of the sample size (its
    codes and scales), and a cache from before it, which held a copy's speed, is not reused."""
    m = machine.measure_memory(8 << 20, rounds=2)
    assert (8 << 20) - (2 << 20) <= m["bytes"] <= 8 << 20
    assert m["gbps"] == pytest.approx(m["bytes"] / m["best_seconds"] / 1e9) and m["gbps"] > 0
    calls = []
    monkeypatch.setattr(machine, "measure_memory", lambda n: calls.append(n) or {"bytes": n, "gbps": 12.5})
    monkeypatch.setenv("WASTE_CACHE_DIR", str(tmp_path))
    (tmp_path / machine.CACHE_FILE).write_text(json.dumps({"memory": {"gbps": 999.0, "what": "a copy"}}))
    got = bandwidths(disk_file=tmp_path / machine.CACHE_FILE, disk_gbps=1.0)
    assert got.memory.gbps == 12.5 and calls == [machine.MEMORY_SAMPLE_BYTES]
    assert "q8g matvecs" in got.memory.source
    assert json.loads((tmp_path / machine.CACHE_FILE).read_text())[machine.MEMORY_KEY]["gbps"] == 12.5


def test_a_cache_entry_out_of_range_is_measured_again_and_an_unwritable_cache_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "measure_memory", lambda n: {"bytes": n, "gbps": 12.5})
    monkeypatch.setenv("WASTE_CACHE_DIR", str(tmp_path))
    for bad in ("Infinity", "NaN", "1e300", "0", '"fast"'):
        (tmp_path / machine.CACHE_FILE).write_text(f'{{"{machine.MEMORY_KEY}": {{"gbps": {bad}}}}}')
        got = bandwidths(disk_file=tmp_path / machine.CACHE_FILE, disk_gbps=1.0)
        assert got.memory.gbps == 12.5 and f"cached in {tmp_path / machine.CACHE_FILE}" in got.memory.source, bad
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("WASTE_CACHE_DIR", str(blocked))  # a file where the cache directory would be
    got = bandwidths(disk_file=blocked, disk_gbps=1.0)
    assert got.memory.gbps == 12.5 and "not cached" in got.memory.source and "cached in" not in got.memory.source


def test_measured_scale_point_sits_beside_waste_plans_prediction(q4: Path, tmp_path: Path) -> None:
    """A bench/scale.py result (its shape) on the memory_planning plot: the measured run at the
    RAM it planned with, and what `waste plan` (predict_run) predicts for that RAM."""
    from waste.analysis.whatif import measured_points

    plan = make_plan(str(q4), context=CONTEXT)
    runtime = 300 << 20
    ram = _ram_for_half_the_experts(plan, runtime)
    from waste.analysis.compute import DecodeCompute

    predicted = predict_run(plan, ram, RATES, runtime=runtime, compute=DecodeCompute(0.004, 8, 9, 1 << 20))
    run = {"store": "streaming", "cache_budget": predicted.memory.cache_budget, "decode_hit_rate_steady": 0.4,
           "decode_tps_steady": 1.5, "prefill_tps": 20.0, "peak_rss": predicted.memory.planned_peak,
           "memory_plan": predicted.memory.as_dict(),
           "prediction": {"waste_plan": predicted.as_dict(), "decode_bound_tps_measured_hit": 2.5}}
    (tmp_path / "scale-tiny-q4.json").write_text(json.dumps({"preset": "tiny", "scheme": "q4", "runs": [run]}))
    (point,) = measured_points(tmp_path)
    assert point.label == "bench/scale.py streaming" and (point.preset, point.scheme) == ("tiny", "q4")
    assert point.ram_bytes == ram and point.tokens_per_second == 1.5
    assert point.predicted_tps == predicted.bound.tokens_per_second
    assert point.estimated_tps == (predicted.decode_estimate[1], predicted.decode_estimate[0])
    from waste.analysis.whatif import curve_over_hit_rate, curve_over_ram, plot_what_if, what_if

    rates = {"nvme_gbps": 2.0, "mem_gbps": 10.0, "gmacs": 5.0}
    current = what_if(make_plan(str(q4), ram=ram), **rates)
    rams = [ram // 2, ram, 2 * ram]
    over_ram = curve_over_ram(lambda r: make_plan(str(q4), ram=r), rams, **rates)
    fig = plot_what_if(rams, over_ram, [0.0, 1.0], curve_over_hit_rate(current.plan, [0.0, 1.0], **rates), current,
                       [point])
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    triangle = lines["waste plan's bound at streaming's RAM"]
    assert list(triangle.get_xdata()) == [ram / 2**30] and list(triangle.get_ydata()) == [point.predicted_tps]
    estimate = lines["waste plan's estimate at streaming's RAM"]
    assert list(estimate.get_xdata()) == [ram / 2**30] * 2 and tuple(estimate.get_ydata()) == point.estimated_tps
