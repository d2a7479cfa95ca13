"""Stepping one token at a time collects what the engine computed, and changes nothing."""

import numpy as np
import pytest

from waste.analysis.cache_sim import recorded, simulate
from waste.analysis.stepping import (
    Stepper,
    attn_res_candidates,
    engine_attn_res,
    notebook_container,
    notebook_workdir,
    prompt_ids,
    random_prompt,
    record_trace,
)
from waste.container.reader import open_container
from waste.engine.check import HiddenCapture
from waste.engine.model import Model
from waste.engine.runner import generate
from waste.engine.sampling import Sampler
from waste.errors import WasteError
from waste.testing import tiny_container


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_container(tmp_path_factory, quant="f32")


def test_notebook_container_builds_once_and_accepts_a_path(tmp_path, monkeypatch):
    monkeypatch.setenv("WASTE_NOTEBOOK_WORKDIR", str(tmp_path))
    built = notebook_container()
    assert built.parent == tmp_path and (built / "manifest.json").is_file()
    stamp = (built / "manifest.json").stat().st_mtime_ns
    assert notebook_container() == built and (built / "manifest.json").stat().st_mtime_ns == stamp
    assert notebook_container(built) == built
    with pytest.raises(WasteError, match="not a .waste container"):
        notebook_container(tmp_path)


def test_notebook_workdir_is_one_reused_cache_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("WASTE_NOTEBOOK_WORKDIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first, second = notebook_workdir(), notebook_workdir()
    assert first == second == tmp_path / "cache" / "waste" / "notebooks" and first.is_dir()


def test_prompt_box_takes_text_or_ids(tiny):
    from waste.tokenizer import container_tokenizer

    tok = container_tokenizer(tiny)
    assert prompt_ids("Hi <|im_end|>", tok, 512) == tok.encode("Hi <|im_end|>")
    assert prompt_ids("1, 2 3", None, 512) == [1, 2, 3]
    with pytest.raises(WasteError, match="no tokenizer: type the prompt as token ids"):
        prompt_ids("Hello", None, 512)
    with pytest.raises(WasteError, match="outside the vocabulary"):
        prompt_ids("1,600", None, 512)
    with pytest.raises(WasteError, match="empty"):
        prompt_ids("", tok, 512)


def test_recorded_trace_covers_every_token_and_layer(tiny):
    prompt = random_prompt(512, 20, seed=1)
    trace = record_trace(tiny, prompt, 5, chunk=8, cache_experts=16)
    with open_container(tiny) as c:
        cfg = c.config
    assert len(trace) == 25 * len(cfg.moe_layers)
    assert trace.top_k == cfg.num_experts_per_token and trace.num_experts == cfg.num_experts
    assert (trace.select_phase("decode").position >= 20).all()
    assert trace.metadata["cache_experts"] == 16 and 0 < trace.hit.mean() < 1
    # The store's hits are the ones its cache policy gives on this trace.
    assert (simulate(trace, "lru", 16).hit == recorded(trace).hit).all()


def test_stepping_matches_a_plain_run_and_the_session(tiny):
    prompt = random_prompt(512, 10, seed=2)
    with open_container(tiny) as c:
        cfg = c.config
        model = Model(c)
        plain = generate(model, model.new_session(16), prompt, 3, Sampler(), chunk=4)
        stepper = Stepper(model, prompt)
        records = [stepper.feed() for _ in range(len(prompt) + 3)]
        assert [r.token for r in records] == prompt + plain.generated
        assert [r.generated for r in records] == [False] * len(prompt) + [True] * 3
        # Token by token equals a chunked prefill then decode, to float32 rounding.
        np.testing.assert_allclose(records[-1].logits, plain.logits[-1], rtol=1e-4, atol=1e-4)
        last = records[-1]
        assert last.position == len(prompt) + 2
        for rec in last.layers:
            if rec.kind == "kda":
                H, K = cfg.kda_num_heads, cfg.kda_head_dim
                # inspect_decode ran on a copy with the same input: its state is the session's.
                np.testing.assert_array_equal(rec.state, stepper.session.kda[rec.layer].recurrent)
                assert rec.decay.shape == (H, K) and ((rec.decay > 0) & (rec.decay <= 1)).all()
                assert rec.beta.shape == (H,) and ((rec.beta > 0) & (rec.beta < 1)).all()
                assert rec.attention is None
            else:
                assert rec.attention.shape == (cfg.mla_num_heads, last.position + 1)
                np.testing.assert_allclose(rec.attention.sum(axis=1), 1.0, rtol=1e-5)
                assert rec.state is None
            if rec.layer in cfg.moe_layers:
                assert rec.expert_ids.shape == (cfg.num_experts_per_token,)
                np.testing.assert_allclose(rec.expert_weights.sum(), cfg.routed_scaling_factor, rtol=1e-5)
                # The chosen experts are the best by biased score among every expert's score.
                biased = rec.router_scores + model.ffn[rec.layer].score_bias
                assert set(rec.expert_ids) == set(np.argsort(-biased)[: cfg.num_experts_per_token])
        # Hidden-state norms and each layer's update agree with one prefill over the same tokens.
        ids = [r.token for r in records]
        capture = HiddenCapture(cfg.num_layers, cfg.hidden_size, len(ids), cfg.num_experts_per_token)
        model.prefill(model.new_session(len(ids)), ids, observer=capture)
        hidden = capture.hidden[:, -1].astype(np.float64)
        np.testing.assert_allclose(last.hidden_norms, np.linalg.norm(hidden, axis=-1), rtol=1e-5)
        embedding = model.embed.take_rows(np.array([ids[-1]]))[0].astype(np.float64)
        inputs = np.concatenate([embedding[None], hidden[:-1]])
        np.testing.assert_allclose(last.update_norms, np.linalg.norm(hidden - inputs, axis=-1), rtol=1e-4)
        top = last.top_k(3)
        assert top[0][0] == last.next_token and top[0][1] >= top[1][1] >= top[2][1]


def test_cursor_walks_layers_and_positions(tiny):
    with open_container(tiny) as c:
        stepper = Stepper(Model(c), [5, 6])
        L = stepper.num_layers
        with pytest.raises(WasteError, match="step forward first"):
            stepper.current  # noqa: B018
        stepper.forward()
        assert (stepper.position, stepper.layer, len(stepper.records)) == (0, 0, 1)
        for _ in range(L):
            stepper.forward()
        assert (stepper.position, stepper.layer, len(stepper.records)) == (1, 0, 2)
        for _ in range(L + 5):
            stepper.back()
        assert (stepper.position, stepper.layer) == (0, 0)
        stepper.goto(4, L - 1)
        assert len(stepper.records) == 5 and stepper.records[4].generated
        with pytest.raises(WasteError):
            stepper.goto(0, L)


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """k3-tiny as K3 ships: MXFP4 routed experts (f32 trunk), AttnRes blocks of 2 over 5 layers."""
    return tiny_container(tmp_path_factory, preset="k3-tiny", quant="f32")


def test_attn_res_candidates_follow_the_block_structure():
    # k3-tiny: 5 layers in blocks of 2 (tests/engine/test_k3.py spells out every mix's candidates).
    assert attn_res_candidates(0, "attn", 2) == ["emb"]
    assert attn_res_candidates(0, "ffn", 2) == ["emb", "p L0"]
    assert attn_res_candidates(1, "attn", 2) == ["emb", "p L0"]
    assert attn_res_candidates(2, "attn", 2) == ["emb", "p L0-1"]
    assert attn_res_candidates(3, "attn", 2) == ["emb", "L0-1", "p L2"]
    assert attn_res_candidates(4, "ffn", 2) == ["emb", "L0-1", "L2-3", "p L4"]
    assert attn_res_candidates(5, "output", 2) == ["emb", "L0-1", "L2-3", "p L4"]
    assert attn_res_candidates(9, "output", 4) == ["emb", "L0-3", "L4-7", "p L8"]


def test_stepping_k3_reads_the_attn_res_mixes(k3):
    """On K3 every layer reads an AttnRes mix: the stepper inspects each attention and router on
    that mix, so its KDA states are the session's, its router scores give the engine's routing
    weights, its logits are the engine's decode bit for bit, and the AttnRes weights it keeps are
    the ones the engine computes for the same tokens without a stepper."""
    prompt = random_prompt(512, 6, seed=3)
    with open_container(k3) as c:
        cfg = c.config
        model = Model(c)
        stepper = Stepper(model, prompt)
        records = [stepper.feed() for _ in range(len(prompt) + 3)]
        tokens = [r.token for r in records]
        plain = generate(model, model.new_session(16), prompt, 3, Sampler(), chunk=4)
        assert tokens == prompt + plain.generated
        # The engine's decode over the same tokens, one at a time, with no stepper: the same bits.
        session = model.new_session(len(tokens))
        decoded = [model.decode(session, t) for t in tokens]
        for r, logits in zip(records, decoded, strict=True):
            np.testing.assert_array_equal(r.logits, logits)
        for layer in cfg.kda_layers:
            np.testing.assert_array_equal(records[-1].layers[layer].state, session.kda[layer].recurrent)
        engine = engine_attn_res(model, tokens)
    S = cfg.attn_res_block_size
    for r, seen in zip(records, engine, strict=True):
        assert set(seen) == {(i, site) for i in range(cfg.num_layers) for site in ("attn", "ffn")} | {
            (cfg.num_layers, "output")}
        for x in r.layers:
            for site in ("attn", "ffn"):
                w = x.attn_res[site]
                assert w.size == len(attn_res_candidates(x.layer, site, S))
                where = f"position {r.position}, layer {x.layer}, {site}"
                np.testing.assert_array_equal(w, seen[(x.layer, site)], err_msg=where)
                np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-6, err_msg=where)
            if x.layer in cfg.moe_layers:
                # The engine's routing weights follow from the router scores of the FFN mix the stepper saw.
                s = x.router_scores[x.expert_ids]
                np.testing.assert_allclose(x.expert_weights, cfg.routed_scaling_factor * s / s.sum(), rtol=1e-5)
        np.testing.assert_array_equal(r.output_attn_res, seen[(cfg.num_layers, "output")])
