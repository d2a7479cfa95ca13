"""Runs larger than their RAM budget: the default store, identical logits, expert reads of a prefill."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import waste.engine.memory as memory
import waste.engine.model as model_module
from waste.cli import main
from waste.container.reader import open_container
from waste.engine.experts import GUESS_LAYERS, StreamingExpertStore
from waste.engine.memory import MemoryPlan, available_memory, measure_runtime, plan_memory, plan_run_memory
from waste.engine.model import Model
from waste.engine.moe_layer import GROUP_ROWS
from waste.plan import container_weight_bytes
from waste.testing import tiny_container
from waste.units import parse_size

PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, 500, 100)]


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    return tiny_container(tmp_path_factory.mktemp("memory") / "q4", quant="q4")


def _plan(**kw: int) -> MemoryPlan:
    base = dict(available=10_000, headroom=1_000, runtime=2_000, trunk=3_000, mla_weights=100, state=200,
                working=700, experts_total=5_000, decode_working=300)
    return MemoryPlan(**{**base, **kw})


def test_plan_arithmetic() -> None:
    """The cache takes what a decode step does not work in: the prefill's extra working memory
    while a prompt is read, and the same peak either way."""
    p = _plan()
    assert p.resident == 6_000 and p.prefill_cache_budget == 3_000 and not p.experts_fit
    assert p.decode_resident == 5_600 and p.cache_budget == 3_400
    assert p.planned_peak == 9_000 and "streaming, cache budget" in p.describe()
    assert "while a prompt is read" in p.describe()
    fits = _plan(experts_total=2_000)
    assert fits.experts_fit and fits.planned_peak == 8_000 and "memory map" in fits.describe()
    # Experts that would fit only in the decode's budget stream: a prompt would not leave them room.
    assert not _plan(experts_total=3_200).experts_fit
    assert _plan(available=5_000).cache_budget == 0 and _plan(available=5_000).prefill_cache_budget == 0
    assert _plan(available=6_500).prefill_cache_budget == 0 and _plan(available=6_500).cache_budget == 0
    assert _plan(available=6_800).prefill_cache_budget == 0 and _plan(available=6_800).cache_budget == 200


def test_a_decode_step_works_in_less_than_a_prefill_pass(q4) -> None:
    """plan_memory: a decode step's working memory is its few experts (its misses and guesses), a
    prefill pass's a whole layer of routed experts; the difference is the cache's gain."""
    from waste.engine.experts import GUESS_LAYERS
    from waste.plan import container_weight_bytes

    with open_container(q4) as c:
        cfg = c.config
        per_expert = container_weight_bytes(c).per_expert
        plan = plan_run_memory(c, 600, chunk=32, pass_tokens=2048, runtime=0, decode_tokens=64, available=1 << 30)
        assert plan.working - plan.decode_working > (cfg.num_experts - (1 + GUESS_LAYERS)
                                                     * cfg.num_experts_per_token) * per_expert
        assert plan.decode_working > (1 + GUESS_LAYERS) * cfg.num_experts_per_token * per_expert
        assert plan.cache_budget - plan.prefill_cache_budget == plan.working - plan.decode_working
        # A one-token prompt works in no more than a decode step.
        short = plan_run_memory(c, 1, chunk=32, pass_tokens=2048, runtime=0, decode_tokens=0, available=1 << 30)
        assert short.working == short.decode_working


def test_available_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WASTE_RAM", "3G")
    assert available_memory() == 3 << 30
    monkeypatch.delenv("WASTE_RAM")
    assert 0 < available_memory() < 1 << 50
    monkeypatch.setenv("WASTE_RAM", "lots")
    assert main(["run", "nowhere.waste", "--prompt-ids", "1"]) == 2


def test_available_memory_counts_mapped_file_pages_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A mapped file's resident pages are page cache, which MemAvailable already counts: only the
    process's anonymous memory is added to it (adding all of its RSS once planned a 48B run past
    the machine's RAM)."""
    from waste.engine import memory

    monkeypatch.delenv("WASTE_RAM", raising=False)
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 0)
    monkeypatch.setattr(memory, "_cgroup_room", lambda: None)
    size = 64 << 20
    path = tmp_path / "mapped.bin"
    path.write_bytes(b"\1" * size)
    mapped = np.memmap(path, np.uint8, "r")
    assert int(mapped[:: 4096].sum()) == size // 4096  # every page touched: resident and in RSS
    assert memory.current_rss() - memory.anonymous_rss() >= size
    assert memory.available_memory() == pytest.approx(memory.anonymous_rss(), abs=16 << 20)
    assert memory.available_memory() <= memory.current_rss() - size + (16 << 20)
    del mapped


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """stderr (where the store's choice is said), then stdout."""
    assert main(argv) == 0
    captured = capsys.readouterr()
    return captured.err + captured.out


def test_default_streams_when_the_experts_do_not_fit(q4, tmp_path, monkeypatch, capsys) -> None:
    """With RAM for only half the experts `waste run` streams into a cache of the planned room,
    and its logits are those of the memory-mapped run bit for bit; with room for them all it maps
    them and copies each into memory (Container.hold_experts_in_memory), the same bits again."""
    ids = ",".join(map(str, PROMPT))
    argv = ["run", str(q4), "--prompt-ids", ids, "--max-new", "6", "--prefill-chunk", "16"]
    mapped = _run([*argv, "--expert-cache", "mmap", "--logits-out", str(tmp_path / "a.npy")], capsys)
    assert "store mmap," in mapped  # asked for the map: no copy

    def plan_now():  # what the next run will plan, measured in this same process just before it
        with open_container(q4) as c:
            _, runtime = measure_runtime(c, chunk=16)
            plan = plan_run_memory(c, len(PROMPT) + 6, chunk=16, pass_tokens=model_module.PREFILL_PASS_TOKENS,
                                   runtime=runtime, decode_tokens=6, all_logits=True, available=0)
            return plan, c.byte_counts()["expert_bytes"]

    plan, experts = plan_now()
    monkeypatch.setenv("WASTE_RAM", str(plan.resident + plan.headroom + experts // 2))
    streamed = _run([*argv, "--logits-out", str(tmp_path / "b.npy")], capsys)
    first = streamed.splitlines()[0]
    assert first.startswith("expert store: streaming, cache budget") and "resident" in first
    assert "while a prompt is read" in first and "while the prompt was read)" in streamed
    # O_DIRECT by default (buffered where this file system refuses it)
    assert re.search(r"store (direct|buffered)", streamed) and "planned peak" in streamed and "peak RSS" in streamed
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))
    paged = _run([*argv, "--expert-io", "page-cache", "--logits-out", str(tmp_path / "p.npy")], capsys)
    assert "store page-cache" in paged
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "p.npy"))
    # Planned again: the streamed run compiled kernels of its own, which the process's RSS now
    # holds (on a cold Numba cache, more than the slack); 64 MiB of slack for what moves between plans.
    plan, experts = plan_now()
    monkeypatch.setenv("WASTE_RAM", str(plan.resident + plan.headroom + 2 * experts + (64 << 20)))
    roomy = _run([*argv, "--logits-out", str(tmp_path / "c.npy")], capsys)
    # Room for every expert: the map, each expert copied into memory as it is first used; the same logits.
    assert "expert store:" not in roomy and "store mmap (experts copied into memory)" in roomy
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "c.npy"))


def test_the_cache_keeps_to_the_prefill_budget_while_a_prompt_is_read(q4) -> None:
    """Model.prefill keeps the streaming cache to its prefill budget; the decode then fills the
    whole budget; and the logits are those of the memory-mapped run, bit for bit."""
    from waste.engine.expert_store import MmapExpertStore

    with open_container(q4) as c:
        experts = c.byte_counts()["expert_bytes"]
        logits = {}
        for name, store in (("mapped", MmapExpertStore(c)),
                            ("streamed", StreamingExpertStore(c, experts // 2, prefill_budget_bytes=experts // 8))):
            model = Model(c, store=store)
            session = model.new_session(len(PROMPT) + 2 * 12)
            rows = [model.prefill(session, PROMPT[:60], chunk=16, all_logits=False)[0]]
            if name == "streamed":
                assert 0 < store.cached_bytes <= experts // 8
            for _ in range(12):
                rows.append(model.decode(session, int(np.argmax(rows[-1]))))
            if name == "streamed":
                assert experts // 8 < store.cached_bytes <= experts // 2
            rows.append(model.prefill(session, PROMPT[60:], chunk=16, all_logits=False)[0])
            if name == "streamed":
                assert 0 < store.cached_bytes <= experts // 8
            logits[name] = np.stack(rows)
            store.close()
    np.testing.assert_array_equal(logits["mapped"], logits["streamed"])


@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_prefill_reads_each_expert_at_most_once_per_layer(q4, chunk) -> None:
    """A 100-token prefill with no cache at all reads at most the model's expert bytes (a
    chunk-by-chunk prefill would read every expert again for each chunk)."""
    with open_container(q4) as c:
        store = StreamingExpertStore(c, 0)
        model = Model(c, store=store)
        model.prefill(model.new_session(len(PROMPT)), PROMPT, chunk=chunk, all_logits=False)
        total = store.stats.total
        assert 0 < total.bytes_read <= c.byte_counts()["expert_bytes"]
        for layer, s in store.stats.layers.items():
            assert s.calls == 1 and s.misses <= c.config.num_experts, layer
        store.close()


def test_passes_bound_the_reads_of_a_long_prompt(q4, monkeypatch) -> None:
    """Prompts longer than a pass read the experts at most once per pass, and give the same bits
    as one pass (a position's output does not depend on where passes begin)."""
    with open_container(q4) as c:
        runs = {}
        for pass_tokens in (40, 1000):
            monkeypatch.setattr(model_module, "PREFILL_PASS_TOKENS", pass_tokens)
            store = StreamingExpertStore(c, 0)
            model = Model(c, store=store)
            runs[pass_tokens] = model.prefill(model.new_session(len(PROMPT)), PROMPT, chunk=16)
            passes = -(-len(PROMPT) // pass_tokens)
            assert store.stats.total.bytes_read <= passes * c.byte_counts()["expert_bytes"]
            assert all(s.calls == passes for s in store.stats.layers.values())
            store.close()
    np.testing.assert_array_equal(runs[40], runs[1000])


def _memory_line(stdout: str) -> tuple[int, int]:
    """(planned peak, peak RSS) in bytes from `waste run`'s memory line."""
    line = next(x for x in stdout.splitlines() if x.startswith("memory: planned peak"))
    planned, peak = (parse_size(m.replace(" ", "")) for m in re.findall(r"(\d+(?:\.\d+)? [KMGT]iB)", line)[:2])
    return planned, peak


def test_planned_peak_agrees_with_the_measured_peak(q4) -> None:
    """`waste run`, each in its own process (a peak RSS of its own): the peak RSS it reports is
    within -10% .. +10% of the peak it planned, with RAM for none of the experts (streaming, a
    cache of 0, into buffers of its own or the page cache: the blobs it does not keep leave its
    RSS) and for all of them (mapped, each copied into memory as it is first used). The first
    run only fills Numba's cache, so that the runs measured load their kernels as a run
    normally does."""
    argv = [sys.executable, "-m", "waste.cli", "run", str(q4), "--prompt-ids", ",".join(map(str, PROMPT)),
            "--max-new", "8"]
    for ram, io, store in (("64G", "direct", None), ("1M", "direct", "(direct|buffered)"),
                           ("1M", "page-cache", "page-cache"),
                           ("64G", "direct", r"mmap \(experts copied into memory\)")):
        done = subprocess.run([*argv, "--expert-io", io], env={**os.environ, "WASTE_RAM": ram}, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        if store is None:
            continue
        assert re.search(f"store {store},", done.stdout), done.stdout
        planned, peak = _memory_line(done.stdout)
        assert 0.9 * planned <= peak <= 1.1 * planned, (store, planned, peak, done.stdout, done.stderr)


def test_the_warm_up_leaves_no_expert_mapped_or_tabled(q4) -> None:
    """The warm-up's pass through the memory map leaves none of experts.bin's pages in the
    process's RSS (a streaming run would carry them past its plan) and no MoE layer holding
    tables of its closed stores."""
    from waste.engine.memory import mapped_rss
    from waste.engine.moe_layer import MoELayer

    with open_container(q4) as c:
        model, _ = measure_runtime(c, chunk=16)
        assert mapped_rss([c.experts_fd]) == 0
        moe = [f for f in model.ffn if isinstance(f, MoELayer)]
        assert moe and all(f._tables is None and f._tables_store is None for f in moe)


# Run in a process of its own (whatever this one has loaded would hide a miss): the warm-up, then
# the Numba kernels of waste's modules and how many signatures each holds, then prompts of
# several lengths and their decodes through both kinds of store; prints the kernels that gained one.
_KERNELS_AFTER_THE_WARM_UP = """
import sys
import numba
from waste.container.reader import open_container
from waste.engine.experts import open_expert_store
from waste.engine.memory import measure_runtime

def kernels():
    for name, module in list(sys.modules.items()):
        if name.startswith("waste"):
            for attr, value in vars(module).items():
                if isinstance(value, numba.core.registry.CPUDispatcher):
                    yield f"{name}.{attr}", value

with open_container(sys.argv[1]) as c:
    model, _ = measure_runtime(c, chunk=16)
    before = {name: len(k.signatures) for name, k in kernels()}
    for budget in (0, None):
        model.store = open_expert_store(c, budget)
        for tokens in (1, 2, 40):
            session = model.new_session(tokens + 1)
            model.prefill(session, list(range(3, 3 + tokens)), chunk=16, all_logits=False)
            model.decode(session, 5)
        model.store.close()
    print(sorted(name for name, k in kernels() if len(k.signatures) > before.get(name, 0)))
"""


def test_the_warm_up_meets_every_kernel_a_run_uses(q4) -> None:
    """measure_runtime's warm-up loads (or compiles) every kernel the run then uses, whichever
    store the plan picks and however long the prompt: a kernel first met in the run would load
    or compile beyond the planned runtime (on an empty Numba cache, 250 MiB on `tiny`)."""
    done = subprocess.run([sys.executable, "-c", _KERNELS_AFTER_THE_WARM_UP, str(q4)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_planned_state_is_what_the_session_holds(q4):
    """The plan's state term is the session's bytes after the same positions, the KDA layers'
    pending updates included."""
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 500, 40)]
    with open_container(q4) as c:
        model = Model(c)
        session = model.new_session(len(prompt) + 3)
        logits = model.prefill(session, prompt, all_logits=False)[-1]
        for _ in range(3):
            logits = model.decode(session, int(np.argmax(logits)))
        plan = plan_run_memory(c, session.position, chunk=32, pass_tokens=2048, runtime=0, decode_tokens=3,
                               available=1 << 30)
    assert plan.state == sum(session.state_bytes.values())


def test_working_memory_counts_a_group_of_routed_rows(q4, monkeypatch):
    """A prefill's MoE runs GROUP_ROWS routed rows at a time: its inputs, gate, up and outputs
    (float32) are in the working memory, and nothing else changes with it."""
    with open_container(q4) as c:
        cfg, w = c.config, container_weight_bytes(c)
    kw = dict(chunk=32, pass_tokens=2048, runtime=0, decode_tokens=0, available=1 << 30)
    with_group = plan_memory(cfg, w, 600, **kw)
    monkeypatch.setattr(memory, "GROUP_ROWS", 0)
    without = plan_memory(cfg, w, 600, **kw)
    rows = min(600 * cfg.num_experts_per_token, GROUP_ROWS)
    expert_in = cfg.routed_expert_hidden_size or cfg.hidden_size
    assert with_group.working - without.working == 4 * rows * (2 * expert_in + 5 * cfg.moe_intermediate_size)


def test_decode_working_holds_its_misses_and_the_guesses(q4):
    """A decode step holds its own layer's experts and the GUESS_LAYERS layers' guessed ones; a
    prefill pass, every expert its tokens pick. Experts made huge so that they set the figures."""
    with open_container(q4) as c:
        cfg = c.config
        huge = dataclasses.replace(container_weight_bytes(c), per_expert=1 << 40)
    p = plan_memory(cfg, huge, 600, chunk=32, pass_tokens=2048, runtime=0, decode_tokens=64, available=1 << 62)
    per_layer = min(cfg.num_experts, cfg.num_experts_per_token)
    assert p.decode_working >> 40 == (1 + GUESS_LAYERS) * per_layer
    assert p.working >> 40 == max(min(cfg.num_experts, 600 * cfg.num_experts_per_token),
                                  (1 + GUESS_LAYERS) * per_layer)


def test_a_prefill_pass_is_priced_at_pass_tokens_not_the_context(q4):
    """A prompt longer than a pass is read pass by pass: its working memory is one pass's, and
    only the state grows with the context."""
    with open_container(q4) as c:
        cfg, w = c.config, container_weight_bytes(c)
    kw = dict(chunk=16, pass_tokens=64, runtime=0, decode_tokens=0, available=1 << 30)
    one_pass, four_passes = plan_memory(cfg, w, 64, **kw), plan_memory(cfg, w, 256, **kw)
    assert four_passes.working == one_pass.working and four_passes.trunk == one_pass.trunk
    assert four_passes.state > one_pass.state
