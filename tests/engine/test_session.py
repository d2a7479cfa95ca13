"""Sessions: bit-exact resume, damage and foreign containers, agreement with the planner;
expert-cache budgets leave logits unchanged and match the cache simulator."""

import numpy as np
import pytest

from waste.analysis.cache_sim import recorded, simulate
from waste.cli import main
from waste.container.reader import open_container
from waste.engine.experts import StreamingExpertStore
from waste.engine.model import Model
from waste.engine.runner import generate
from waste.engine.sampling import Sampler
from waste.engine.trace import TraceRecorder, load
from waste.plan import kda_pending_bytes, state_bytes
from waste.testing import tiny_container

PROMPT = list(range(3, 53))  # 50 tokens: chunks of 32 cut it at 32


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    return tiny_container(tmp_path_factory.mktemp("session") / "q8", quant="q8")


def _run(container, prompt, max_new, sampler, session=None, chunk=32):
    model = Model(container)
    session = session or model.new_session()
    result = generate(model, session, prompt, max_new, sampler, chunk=chunk)
    return model, session, result


@pytest.mark.parametrize(("cut", "chunk"), [(40, 32), (40, 7), (50 + 3, 32)],
                         ids=["inside-prefill-chunk", "other-chunks", "during-decode"])
def test_resume_is_bit_exact(q8, tmp_path, cut, chunk):
    """A run cut at token `cut` and resumed from its saved session equals the uninterrupted run
    (prefilled in chunks of 32), also when the cut run uses other chunks."""
    with open_container(q8) as c:
        _, _, whole = _run(c, PROMPT, 8, Sampler(0.8, 0.95, seed=7))
        full_logits = whole.all_logits()
        first_prompt = PROMPT[:cut]
        first_new = max(cut - len(PROMPT), 0)
        model, session, first = _run(c, first_prompt, first_new, Sampler(0.8, 0.95, seed=7), chunk=chunk)
        session.save(tmp_path / "s.npz")
        model = Model(c)
        resumed = model.load_session(tmp_path / "s.npz")
        rest_prompt = PROMPT[cut:]
        second = generate(model, resumed, rest_prompt, 8 - first_new, Sampler.from_state(resumed.sampler_state),
                          chunk=chunk)
    assert first.generated + second.generated == whole.generated
    np.testing.assert_array_equal(np.concatenate([first.all_logits(), second.all_logits()]), full_logits)


def test_cli_session_round_trip(q8, tmp_path, capsys):
    s = tmp_path / "a.session"
    assert main(["run", str(q8), "--prompt-ids", "5,6,7,8", "--max-new", "0", "--session-out", str(s)]) == 0
    assert main(["run", str(q8), "--session-in", str(s), "--prompt-ids", "9,10", "--max-new", "3"]) == 0
    resumed = capsys.readouterr().out.split("generated:")[-1].splitlines()[0]
    assert main(["run", str(q8), "--prompt-ids", "5,6,7,8,9,10", "--max-new", "3"]) == 0
    whole = capsys.readouterr().out.split("generated:")[-1].splitlines()[0]
    assert resumed == whole


def test_damaged_and_foreign_sessions_are_refused(q8, tmp_path, capsys):
    s = tmp_path / "a.session"
    assert main(["run", str(q8), "--prompt-ids", "5,6,7", "--max-new", "1", "--session-out", str(s)]) == 0
    data = bytearray(s.read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "flipped.session").write_bytes(bytes(data))
    (tmp_path / "short.session").write_bytes(bytes(data[: len(data) // 3]))
    other = tiny_container(tmp_path / "other", quant="q8", seed=1)
    biased = tmp_path / "biased.session"
    assert main(["run", str(q8), "--prompt-ids", "5,6,7", "--max-new", "1", "--router-weights", "biased",
                 "--session-out", str(biased)]) == 0
    capsys.readouterr()
    for argv, message in [
        (["run", str(q8), "--session-in", str(tmp_path / "flipped.session")], "session"),
        (["run", str(q8), "--session-in", str(tmp_path / "short.session")], "damaged"),
        (["run", str(q8), "--session-in", str(tmp_path / "absent")], "no such file"),
        (["run", str(other), "--session-in", str(s)], "belongs to another container"),
        (["run", str(q8), "--session-in", str(s), "--router-weights", "biased"],
         "was run with --router-weights unbiased, this run has biased"),
        (["run", str(q8), "--session-in", str(biased)],  # the saved choice, not a default that matches
         "was run with --router-weights biased, this run has unbiased"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_session_bytes_agree_with_the_planner(q8):
    with open_container(q8) as c:
        model, session, _ = _run(c, PROMPT, 10, Sampler())
        planned = state_bytes(c.config, session.position, "f32")
    assert session.state_bytes == {"kda_state": planned.kda_state, "kda_pending": kda_pending_bytes(c.config),
                                   "conv_rings": planned.conv_rings, "mla_latent": planned.mla_latent}


def test_expert_cache_budgets_give_identical_logits_and_simulated_hits(q8):
    with open_container(q8) as c:
        blob = c.expert_span(c.config.moe_layers[0], 0)[1]
        all_experts = c.config.num_experts * len(c.config.moe_layers)
        results = {}
        for n_cached in (0, 20, all_experts):
            store = StreamingExpertStore(c, n_cached * blob, policy="lru", read_threads=2)
            model = Model(c, store=store)
            cfg = c.config
            recorder = TraceRecorder(cfg.num_layers, cfg.moe_layers, cfg.num_experts_per_token)
            run = generate(model, model.new_session(), PROMPT, 10, Sampler(), observer=recorder)
            results[n_cached] = (run.all_logits(), store.stats, recorder)
            store.close()
    base = results[0][0]
    for n_cached, (logits, stats, recorder) in results.items():
        np.testing.assert_array_equal(logits, base)
        trace = recorder.trace()
        sim = simulate(trace, "lru", n_cached)
        np.testing.assert_array_equal(sim.hit, recorded(trace).hit)
        assert sim.hits == stats.total.hits
    assert results[0][1].total.hits == 0 < results[20][1].total.hits < results[all_experts][1].total.hits


def test_trace_round_trip_through_run(q8, tmp_path, capsys):
    t = tmp_path / "trace.npz"
    assert main(["run", str(q8), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new", "4",
                 "--expert-cache", "64K", "--trace-out", str(t)]) == 0
    trace = load(t)
    assert trace.ids.shape[1] == 2
    assert set(np.unique(trace.layer)) == {1, 2, 3, 4}
    assert (trace.phase == 0).sum() == 50 * 4 and (trace.phase == 1).sum() == 4 * 4
