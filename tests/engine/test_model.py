"""The engine against the float64 oracle on tiny containers, prefill/decode consistency, bad input."""

import warnings

import numba
import numpy as np
import pytest

from waste.cli import main
from waste.container.reader import open_container
from waste.engine.check import SAFETY_FACTOR, check_against_oracle, clear_margin
from waste.engine.model import Model
from waste.engine.runner import generate
from waste.engine.sampling import Sampler
from waste.reference.model import ReferenceModel
from waste.testing import tiny_container

VARIANTS = {
    "kimi-linear": None,
    "q-lora": {"q_lora_rank": 24},
    "expert-groups": {"num_expert_group": 4, "topk_group": 2},
    "k3-gates": {"linear_attn_config": {"gate_lower_bound": -5.0, "use_full_rank_gate": True},
                 "mla_use_output_gate": True},
}


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return {name: tiny_container(root / name, quant="f32", overrides=o) for name, o in VARIANTS.items()}


def _prompt(n, vocab, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_matches_oracle_per_layer(containers, variant):
    with open_container(containers[variant]) as c:
        # 80 prompt tokens: longer than a 64-token KDA chunk, several 32-token prefill chunks.
        report = check_against_oracle(c, _prompt(80, c.config.vocab_size), 6)
    assert max(report.layer_errors) <= 1e-5, report.format()
    assert report.logits_error <= 1e-5, report.format()
    assert report.greedy_clear > 0 and not report.greedy_disagreements, report.format()
    assert report.greedy_clear_agree == report.greedy_clear <= report.greedy_agree <= len(report.ids)


@pytest.mark.parametrize("quant", ["f32", "q8", "q4"])
def test_prefill_is_chunk_invariant(tmp_path_factory, quant):
    """Every prompt position's logits, and the decoded tokens' after it, are the same bits
    whatever the prefill chunk (issue 13); 80 tokens span two MLA key blocks."""
    with open_container(tiny_container(tmp_path_factory, quant=quant)) as c:
        model = Model(c)
        prompt = _prompt(80, c.config.vocab_size, seed=1)
        runs = {chunk: generate(model, model.new_session(), prompt, 5, Sampler(), chunk=chunk)
                for chunk in (1, 7, 32, 64)}
    for chunk in (7, 32, 64):
        np.testing.assert_array_equal(runs[chunk].all_logits(), runs[1].all_logits(), err_msg=f"chunk {chunk}")


def test_biased_router_weights_follow_the_remote_code(containers):
    with open_container(containers["kimi-linear"]) as c:
        ids = _prompt(12, c.config.vocab_size, seed=2)
        engine = {}
        for mode in ("unbiased", "biased"):
            model = Model(c, router_weights=mode)
            engine[mode] = model.prefill(model.new_session(), ids)
            ref = ReferenceModel(c, router_weights=mode).forward(ids).logits
            np.testing.assert_allclose(engine[mode], ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    assert not np.allclose(engine["unbiased"], engine["biased"])


def test_sampling_is_seeded(containers):
    with open_container(containers["kimi-linear"]) as c:
        model = Model(c)
        prompt = _prompt(8, c.config.vocab_size, seed=3)
        out = [generate(model, model.new_session(), prompt, 12, Sampler(1.0, 0.9, seed=s)).generated
               for s in (5, 5, 6)]
    assert out[0] == out[1] and out[0] != out[2]


def test_run_cli_writes_logits(containers, tmp_path, capsys):
    path = containers["kimi-linear"]
    logits = tmp_path / "logits.npy"
    assert main(["run", str(path), "--prompt-ids", "1,2,3,4,5", "--max-new", "4", "--logits-out", str(logits)]) == 0
    out = capsys.readouterr().out
    assert "generated:" in out and "tok/s" in out
    a = np.load(logits)
    assert a.shape == (5 + 4, 512) and a.dtype == np.float32 and np.isfinite(a).all()


def test_check_cli_passes_on_f32(containers, capsys):
    assert main(["check", str(containers["kimi-linear"]), "--prompt-len", "20", "--new", "4"]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--prompt-ids", "1,2,512"], "token id 512 is outside the vocabulary"),
        (["--prompt-ids", "1,x"], "'x' is not a token id"),
        ([], "the prompt is empty"),
        (["--prompt-ids", "1", "--max-new", "5000"], "exceeds the model's capacity"),
        (["--prompt-ids", "1", "--prefill-chunk", "0"], "--prefill-chunk: 0 is outside 1.."),
    ],
)
def test_run_bad_input_exits_2(containers, extra, message, capsys):
    assert main(["run", str(containers["kimi-linear"]), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_run_missing_container_exits_2(tmp_path, capsys):
    assert main(["run", str(tmp_path / "absent.waste"), "--prompt-ids", "1"]) == 2
    assert "absent.waste" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", ["q4", "q4all"])
def test_quantised_check_follows_the_engine_routing(tmp_path, scheme):
    path = tiny_container(tmp_path / scheme, quant=scheme)
    with open_container(path) as c:
        report = check_against_oracle(c, _prompt(40, c.config.vocab_size, seed=4), 4)
    assert report.routing_forced and report.passed, report.format()
    assert report.tolerance == pytest.approx(SAFETY_FACTOR * report.modelled_error, rel=1e-6)
    assert report.greedy_clear > 0, report.format()  # the margin rule leaves positions to judge
    assert 0.9 < report.routing_agreement <= 1.0
    # Errors grow smoothly through the layers once no routing flip can jump them.
    assert max(report.layer_errors) < 3e-2 and report.layer_errors[0] < 1e-2


def test_reference_router_forced_ids_keep_its_own_weights():
    from waste.reference.moe import route

    logits = np.random.default_rng(5).normal(size=(6, 8))
    bias = np.zeros(8)
    ids, weights = route(logits, bias, top_k=2, scaling=2.0)
    same_ids, same_weights = route(logits, bias, top_k=2, scaling=2.0, forced_ids=ids)
    np.testing.assert_array_equal(same_ids, ids)
    np.testing.assert_array_equal(same_weights, weights)
    other = (ids + 1) % 8
    forced_ids, forced_weights = route(logits, bias, top_k=2, scaling=2.0, forced_ids=other)
    np.testing.assert_array_equal(forced_ids, other)
    s = 1 / (1 + np.exp(-logits[0, other[0]]))
    np.testing.assert_allclose(forced_weights[0], 2.0 * s / s.sum())


def test_prefill_last_logits_only(containers):
    """all_logits=False computes the last position's row only: the same bits as with every row,
    the same session afterwards, for chunkings that do and do not divide the prompt."""
    with open_container(containers["kimi-linear"]) as c:
        model = Model(c)
        prompt = _prompt(18, c.config.vocab_size, seed=4)
        for chunk in (1, 6, 7, 18, 32):
            full_session, last_session = model.new_session(), model.new_session()
            full = model.prefill(full_session, prompt, chunk=chunk)
            last = model.prefill(last_session, prompt, chunk=chunk, all_logits=False)
            assert full.shape == (18, c.config.vocab_size) and last.shape == (1, c.config.vocab_size)
            assert np.isfinite(full).all()
            np.testing.assert_array_equal(last[0], full[-1])
            np.testing.assert_array_equal(last_session.last_logits, full_session.last_logits)
            np.testing.assert_array_equal(model.decode(last_session, 3), model.decode(full_session, 3))
        runs = [generate(model, model.new_session(), prompt, 3, Sampler(), all_prompt_logits=flag)
                for flag in (True, False)]
    assert runs[0].generated == runs[1].generated
    assert runs[0].all_logits().shape[0] == 18 + 3 and runs[1].all_logits().shape[0] == 1 + 3


def test_f32_tolerance_is_float32_rounding_only(containers):
    # f32 with f32 experts rounds no activation: the tolerance stays 1e-5, with no modelled error.
    with open_container(containers["kimi-linear"]) as c:
        report = check_against_oracle(c, _prompt(12, c.config.vocab_size), 2)
    assert report.tolerance == 1e-5 and report.modelled_error is None and report.passed, report.format()


def test_clear_margin_scales_with_the_tolerance():
    vocab = 100
    logits = np.tile(np.where(np.arange(vocab) % 2, 0.1, -0.1), (3, 1))  # runner-up 0.1
    logits[:, 0] = [1.0, 0.5, 0.15]  # margins 0.9, 0.4, 0.05 against row RMS 0.14, 0.11, 0.10
    threshold = 2 * np.sqrt(2 * np.log(vocab))  # in units of tolerance x RMS(row)
    rms = np.sqrt(np.mean(logits**2, axis=-1))
    tol = 0.99 * (logits[1, 0] - 0.1) / (threshold * rms[1])  # row 1 just clear
    np.testing.assert_array_equal(clear_margin(logits, tol), [True, True, False])
    np.testing.assert_array_equal(clear_margin(logits, tol * 1.02), [True, False, False])


@pytest.mark.parametrize("quant", ["f32", "q4"])
def test_logits_do_not_depend_on_the_thread_count(tmp_path, quant):
    """Prefill and decode give the same bits on 1 and 2 Numba threads: no kernel splits a sum by
    the thread count (MLA decode once did, and decoded logits differed by about 3e-6)."""
    path = tiny_container(tmp_path / quant, quant=quant)
    runs = []
    before = numba.get_num_threads()
    try:
        with open_container(path) as c:
            model = Model(c)
            prompt = _prompt(40, c.config.vocab_size, seed=5)
            for threads in (1, 2):
                numba.set_num_threads(threads)
                session = model.new_session()
                logits = [model.prefill(session, prompt, chunk=16)]
                logits += [model.decode(session, t)[None] for t in (3, 9, 27)]
                runs.append(np.concatenate(logits))
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(runs[0], runs[1])


@pytest.mark.parametrize(("preset", "quant"), [("tiny", "q4"), ("tiny", "q8"), ("tiny", "f32"), ("tiny", "bf16"),
                                             ("k3-tiny", "q8")])
def test_decode_through_expert_tables_equals_the_store_path(tmp_path_factory, monkeypatch, preset, quant):
    """A memory-mapped store's decode routes and runs a layer's experts from its ExpertTables in
    one call; a store that does not say it maps every expert takes the path through `fetch`.
    Logits bit for bit and the store's counters the same, step after step (the tables fill as
    experts first show). The tables' kernel is called with arguments of one type throughout, so
    it compiles once: a read-only table once cost a second compilation (5-7 s) in the middle of
    a decode. (Only kernels called from Python are recorded: a stand-in for one that compiled
    code calls would break that code's compilation.)"""
    from waste.engine.expert_store import MmapExpertStore
    from waste.kernels import moe_step

    class Unmapped(MmapExpertStore):
        maps_every_expert = False

    argument_types: dict[str, set[tuple]] = {}

    def recording(name: str):  # noqa: ANN202 - the kernel's stand-in
        kernel = getattr(moe_step, name)

        def record(*args):  # noqa: ANN002, ANN202
            argument_types.setdefault(name, set()).add(tuple(numba.typeof(a) for a in args))
            return kernel(*args)
        return record

    for kernel_name in ("_moe_one_token", "_dense_moe_one_token"):
        monkeypatch.setattr(moe_step, kernel_name, recording(kernel_name))

    path = tiny_container(tmp_path_factory.mktemp("tables"), preset=preset, quant=quant)
    with open_container(path) as c:
        runs = {}
        for name, store in (("tables", MmapExpertStore(c)), ("fetch", Unmapped(c))):
            model = Model(c, store=store)
            session = model.new_session(64)
            model.prefill(session, _prompt(5, c.config.vocab_size))
            steps = [model.decode(session, t) for t in _prompt(12, c.config.vocab_size, seed=1)]
            tables = [f._tables for f in model.ffn if hasattr(f, "_tables")]
            runs[name] = (np.stack(steps), store.stats.total.as_dict(), tables)
    assert all(t is None for t in runs["fetch"][2])  # the unmapped run built none
    assert all(t is not None and t.usable and t.known.sum() > 1 for t in runs["tables"][2])  # rows were used
    np.testing.assert_array_equal(runs["tables"][0], runs["fetch"][0])
    assert runs["tables"][1] == runs["fetch"][1]
    assert len(argument_types) == 1 and all(len(types) == 1 for types in argument_types.values()), argument_types


@pytest.mark.parametrize("quant", ["q8", "bf16"])
def test_a_prefill_through_the_map_fills_the_decode_tables(tmp_path_factory, monkeypatch, quant):
    """The experts a prefill ran through the memory map are in their layers' decode tables when
    it ends, so a decode step whose experts the prompt used runs each MoE layer in one call, not
    through the path that adds an expert at its first decode (`MoELayer._one_token`)."""
    from waste.engine.expert_store import MmapExpertStore
    from waste.engine.moe_layer import MoELayer

    path = tiny_container(tmp_path_factory.mktemp("prefill-tables"), quant=quant)
    with open_container(path) as c:
        store = MmapExpertStore(c)
        model = Model(c, store=store)
        session = model.new_session(64)
        model.prefill(session, _prompt(40, c.config.vocab_size))
        moe = [f for f in model.ffn if isinstance(f, MoELayer)]
        experts = c.config.num_experts
        assert moe
        for f in moe:
            handed_out = {e for e, view in enumerate(store._views[f.layer_index]) if view is not None}
            assert len(handed_out) == experts  # 40 tokens route to every one of tiny's experts
            assert f._tables is not None and f._tables.usable
            assert set(np.flatnonzero(f._tables.known[:experts])) == handed_out
        slow = []
        monkeypatch.setattr(MoELayer, "_one_token", lambda *a, **k: slow.append(1))
        model.decode(session, 3)
        assert not slow


class _Routing:
    """Every prefill request's token-expert pairs and unique experts, as the observer sees them."""

    def __init__(self):
        self.pairs = self.unique = 0

    def on_layer(self, layer, positions, hidden):
        pass

    def on_routing(self, layer, positions, phase, routing, hits):
        if phase == "prefill":
            self.pairs += routing.ids.size
            self.unique += len(routing.unique)


def test_prefill_dedup_ratio_counts_prefill_passes_only(containers, capsys):
    """The dedup ratio `waste run` prints: token-expert pairs over unique experts fetched, summed
    over every prefill request (two prompts here), whatever the decode steps after them (each
    one token: pairs = unique, which would pull a mean of ratios towards 1)."""
    path = containers["kimi-linear"]
    with open_container(path) as c:
        model = Model(c)
        seen = _Routing()
        session = model.new_session(128)
        model.prefill(session, _prompt(40, c.config.vocab_size), observer=seen)
        model.prefill(session, _prompt(9, c.config.vocab_size, seed=1), observer=seen)
        want = seen.pairs / seen.unique
        assert want > 1.5  # 49 tokens over the tiny model's few experts share them
        assert model.times.prefill_dedup == pytest.approx(want, rel=1e-12)
        for t in range(20):
            model.decode(session, t)
        assert model.times.prefill_dedup == pytest.approx(want, rel=1e-12)
    with open_container(path) as c:
        assert Model(c).times.prefill_dedup is None
    printed = []
    for new in ("1", "12"):
        assert main(["run", str(path), "--prompt-ids", "5,6,7,8,9,10,11,12,13,14", "--max-new", new]) == 0
        printed.append([line for line in capsys.readouterr().out.splitlines() if "dedup ratio" in line])
    assert printed[0] == printed[1] and len(printed[0]) == 1


def test_a_tiny_temperature_samples_the_largest_logits():
    """A positive temperature small enough that logits / T overflows still samples, among the
    largest logits only (it once turned every logit into inf and the probabilities into NaN)."""
    logits = np.array([0.5, 2.0, -1.0, 2.0, 1.9], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for temperature in (1e-310, 5e-324, 1e-30):
            sampler = Sampler(temperature, seed=3)
            picks = {sampler(logits) for _ in range(40)}
            assert picks == {1, 3}, (temperature, picks)
