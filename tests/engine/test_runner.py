"""waste.engine.runner: what a run reports about its own timings."""

from __future__ import annotations

import dataclasses
import re

import numba
import numpy as np
import pytest

from waste.cli import main
from waste.container.reader import open_container
from waste.engine import runner
from waste.engine.model import Model
from waste.engine.sampling import Sampler
from waste.testing import tiny_container


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_container(tmp_path_factory.mktemp("runner") / "tiny", quant="f32")


class _CompilesOnFirstLayer:
    """An observer whose first on_layer compiles a kernel never compiled before (cache=False)."""

    def __init__(self):
        @numba.njit(cache=False)
        def norm(h):
            return np.sqrt((h * h).sum())

        self.norm = norm

    def on_layer(self, layer, positions, hidden):
        self.norm(hidden)

    def on_routing(self, layer, positions, phase, routing, hits):
        pass


def test_generate_reports_the_seconds_spent_compiling(tiny) -> None:
    """Compiling inside the prefill is counted there; a decode whose kernels are all compiled
    counts none."""
    with open_container(tiny) as c:
        model = Model(c)
        prompt = [5, 9, 11, 40, 2]
        runner.generate(model, model.new_session(32), prompt, 3, Sampler(temperature=0.0))  # every kernel ready
        run = runner.generate(model, model.new_session(32), prompt, 3, Sampler(temperature=0.0),
                              observer=_CompilesOnFirstLayer())
    assert run.prefill_compile_seconds > 0.0
    assert run.decode_compile_seconds == 0.0
    assert run.prefill_seconds >= run.prefill_compile_seconds


def test_waste_run_says_when_its_timings_include_compiling(tiny, monkeypatch, capsys) -> None:
    argv = ["run", str(tiny), "--prompt-ids", "5,9,11,40,2", "--max-new", "3"]
    assert main(argv) == 0  # kernels compiled or loaded from the cache
    capsys.readouterr()
    assert main(argv) == 0
    assert "compiling kernels" not in capsys.readouterr().out  # nothing left to compile
    real = runner.generate
    monkeypatch.setattr(runner, "generate", lambda *a, **k: dataclasses.replace(
        real(*a, **k), prefill_compile_seconds=12.25, decode_compile_seconds=3.5))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "of these, compiling kernels: 12.2 s of the prefill, 3.5 s of the decode" in out


def test_speeds_are_undefined_without_tokens() -> None:
    """A resumed session with an empty prompt, or --max-new 0, times a little work but no token:
    no speed (the stats line shows "-"), not 0 tok/s."""
    empty = runner.RunResult(prompt_len=0, generated=[], logits=[], prefill_seconds=1e-4, decode_seconds=1e-4)
    assert np.isnan(empty.prefill_tps) and np.isnan(empty.decode_tps)
    run = runner.RunResult(prompt_len=8, generated=[1, 2], logits=[], prefill_seconds=0.5, decode_seconds=0.25)
    assert run.prefill_tps == 16.0 and run.decode_tps == 8.0


def test_run_memory_line_agrees_with_the_store_table(tmp_path_factory, capsys):
    """`waste run`'s line "hit rate ..., read ... GB" says what the store's table counts: hits over
    lookups, and the misses' blobs in GB (1e9 bytes)."""
    q4 = tiny_container(tmp_path_factory.mktemp("runner") / "q4", quant="q4")
    ids = ",".join(str(int(t)) for t in np.random.default_rng(5).integers(3, 500, 40))
    assert main(["run", str(q4), "--prompt-ids", ids, "--max-new", "4", "--expert-cache", "1G"]) == 0
    out = capsys.readouterr().out
    total = next(x for x in out.splitlines() if x.split()[:1] == ["total"]).split()
    requests, hits, misses = int(total[1]), int(total[2]), int(total[3])
    with open_container(q4) as c:
        blob = int(c.expert_span(c.config.moe_layers[0], 0)[1])
    assert misses > 0 and f"hit rate {100 * hits / requests:.1f}%" in out
    m = re.search(r"read (\d+\.\d\d) GB", out)
    assert m and m.group(1) == f"{misses * blob / 1e9:.2f}", (m and m.group(0), misses * blob)
