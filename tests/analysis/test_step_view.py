"""The step_through controls driven as a user would: buttons, head and layer pickers."""

import numpy as np
import pytest

from waste.analysis.step_view import StepThrough, layer_view, step_conclusion
from waste.testing import tiny_container
from waste.tokenizer import container_tokenizer


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path = tiny_container(tmp_path_factory, quant="f32")
    return StepThrough([str(path)], "Hi there", steps_ahead=2)


def test_load_feeds_prompt_text_and_generated_tokens(app):
    tok = container_tokenizer(app.container_box.value)
    s = app.stepper
    assert s.prompt == tok.encode("Hi there")
    assert len(s.records) == len(s.prompt) + 2 and [r.generated for r in s.records[-3:]] == [False, True, True]
    assert (s.position, s.layer) == (0, 0) and app.view.layer == 0
    assert app.figure is not None and "Hi there" not in app.status.value  # the status names the container


def test_one_layer_step_changes_only_that_layer(app):
    cfg = app.stepper.model.config
    app.goto(3, 0)
    for _ in range(2 * cfg.num_layers):
        before = {i: app.stepper.state_at(i).copy() for i in cfg.kda_layers}
        where = (app.stepper.position, app.stepper.layer)
        app.forward()
        s = app.stepper
        assert (s.position, s.layer) == ((where[0], where[1] + 1) if where[1] + 1 < cfg.num_layers
                                         else (where[0] + 1, 0))
        changed = [i for i in cfg.kda_layers if not np.array_equal(s.state_at(i), before[i])]
        # At a new position every layer the cursor is behind shows its state before the new token,
        # which is its state after the old one: unchanged. Only the layer just passed moves.
        assert changed == ([s.layer] if s.layer in cfg.kda_layers else [])
        assert app.view.layer == s.layer and app.layer_slider.value == s.layer
        if app.view.kind == "kda":
            np.testing.assert_array_equal(app.view.difference, app.view.after - app.view.before)
            assert np.abs(app.view.difference).max() > 0


def test_back_undoes_forward(app):
    app.goto(4, 2)
    shown = app.view.after.copy() if app.view.kind == "kda" else app.view.attention.copy()
    app.forward()
    app.back()
    assert (app.stepper.position, app.stepper.layer) == (4, 2)
    again = app.view.after if app.view.kind == "kda" else app.view.attention
    np.testing.assert_array_equal(again, shown)
    app.goto(1, 0)
    app.back()
    assert (app.stepper.position, app.stepper.layer) == (0, app.stepper.num_layers - 1)


def test_head_and_layer_pickers_change_the_view(app):
    cfg = app.stepper.model.config
    layer = cfg.kda_layers[0]
    app.layer_slider.value = layer
    assert app.stepper.layer == layer and app.view.kind == "kda"
    app.head_slider.value = 0
    first = app.view.after.copy()
    app.head_slider.value = 2
    assert app.view.head == 2
    np.testing.assert_array_equal(app.view.after, app.stepper.state_after(layer)[2])
    assert not np.array_equal(app.view.after, first)
    mla = cfg.mla_layers[0]
    app.layer_slider.value = mla
    view = app.view
    assert view.kind == "mla" and view.attention.shape == (app.stepper.position + 1,)
    np.testing.assert_allclose(view.attention.sum(), 1.0, rtol=1e-5)


def test_token_buttons_keep_the_layer_and_generate_past_the_end(app):
    s = app.stepper
    app.goto(len(s.records) - 1, 1)
    fed = len(s.records)
    app.next_token()
    assert (s.position, s.layer) == (fed, 1) and len(s.records) == fed + 1 and s.records[-1].generated
    app.prev_token()
    assert (s.position, s.layer) == (fed - 1, 1)


def test_router_view_shows_every_expert(app):
    cfg = app.stepper.model.config
    app.layer_slider.value = cfg.moe_layers[0]
    view = layer_view(app.stepper, 0)
    assert view.router_scores.shape == (cfg.num_experts,)
    assert ((view.router_scores > 0) & (view.router_scores < 1)).all()
    assert set(view.expert_ids) <= set(range(cfg.num_experts))
    np.testing.assert_allclose(view.expert_weights.sum(), cfg.routed_scaling_factor, rtol=1e-5)


def test_buttons_are_enabled_after_work_and_conclusion_quotes_numbers(app):
    assert not any(b.disabled for b in app.buttons)
    text = step_conclusion(app.stepper)
    assert text.startswith("**Conclusion.**") and f"{len(app.stepper.records)} positions" in text


def test_update_norms_add_up(app):
    for r in app.stepper.records:
        for x in r.layers:
            assert x.update_norm <= x.attn_update + x.ffn_update + 1e-9
            assert x.update_norm > 0


def test_attn_res_panel_draws_the_depth_weights(app):
    """K3's AttnRes weights get their own panel (drawn here from hand-made weights)."""
    from waste.analysis.step_view import plot_layer_view

    app.goto(2, 1)
    view = layer_view(app.stepper, 0)
    view.attn_res = {"attn": np.array([0.2, 0.5, 0.3]), "ffn": np.array([0.1, 0.1, 0.8])}
    fig = plot_layer_view(view, app.kinds)
    titles = [ax.get_title() for ax in fig.get_axes()]
    assert any(t.startswith("AttnRes") for t in titles)
    ax = next(a for a in fig.get_axes() if a.get_title().startswith("AttnRes"))
    assert [t.get_text() for t in ax.get_xticklabels()] == ["b0", "b1", "p"]
    assert sorted(round(p.get_height(), 3) for p in ax.patches) == sorted([0.2, 0.5, 0.3, 0.1, 0.1, 0.8])


def test_load_with_a_bad_path_or_prompt_says_so_and_keeps_the_view(app, tmp_path):
    good, stepper = app.container_box.value, app.stepper
    app.container_box.value = str(tmp_path / "missing.waste")
    app.load()
    assert "missing.waste" in app.status.value and app.stepper is stepper
    app.container_box.value = good
    app.prompt_box.value = ""
    app.load()
    assert "empty" in app.status.value and app.stepper is stepper
    app.prompt_box.value = "Hi there"
    assert not any(b.disabled for b in app.buttons)


@pytest.fixture(scope="module")
def k3_app(tmp_path_factory):
    path = tiny_container(tmp_path_factory, preset="k3-tiny", quant="f32")
    return StepThrough([str(path)], "Hi there", steps_ahead=1)


def test_k3_steps_show_the_engines_attn_res_weights(k3_app):
    """Stepping forward and back on K3 shows, at every layer, the depth-attention weights the
    engine computes for that token (decoded without the stepper), labelled by the blocks they weigh."""
    from waste.analysis.stepping import attn_res_candidates, engine_attn_res

    s = k3_app.stepper
    cfg = s.model.config
    k3_app.goto(len(s.records) - 1, 0)
    seen = []  # (position, layer, the view shown, the AttnRes panel's tick labels)

    def look():
        ax = next(a for a in k3_app.figure.get_axes() if a.get_title().startswith("AttnRes"))
        seen.append((s.position, s.layer, k3_app.view, [t.get_text() for t in ax.get_xticklabels()]))

    for _ in range(cfg.num_layers + 2):
        k3_app.forward()  # past the last layer of the last record: a new token
        look()
    for _ in range(3):
        k3_app.back()
        look()
    assert seen[-1][:2] == seen[-7][:2] and seen[-1][1] == cfg.num_layers - 1 and s.records[-1].generated
    engine = engine_attn_res(s.model, [r.token for r in s.records])
    for position, layer, view, labels in seen:
        for site in ("attn", "ffn"):
            np.testing.assert_array_equal(view.attn_res[site], engine[position][(layer, site)])
            assert view.attn_res_labels[site] == attn_res_candidates(layer, site, cfg.attn_res_block_size)
        # The overview's rows are every site so far, each weight under the block it weighs.
        assert view.depth_weights.shape == (2 * (layer + 1), -(-cfg.num_layers // cfg.attn_res_block_size) + 1)
        for i in range(layer + 1):
            for j, site in enumerate(("attn", "ffn")):
                w = engine[position][(i, site)]
                row = view.depth_weights[2 * i + j]
                np.testing.assert_array_equal(row[: w.size - 1], w[:-1])
                assert row[-1] == w[-1] and np.isnan(row[w.size - 1:-1]).all()
        assert labels[0] == "b0\nemb" and labels[-1].startswith("p\np L")


def test_k3_conclusion_reads_the_attn_res_weights(k3_app):
    text = step_conclusion(k3_app.stepper)
    assert "AttnRes:" in text and "running partial sum" in text
