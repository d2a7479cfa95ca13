"""A decode step's compute, timed with pooled experts (`waste.analysis.compute`), and the store
that pools them (`waste.engine.expert_store.PooledExpertStore`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from waste.analysis.compute import BLOB_LAYERS, DECODE_COMPUTE_STEPS, measure_decode_compute
from waste.container import open_container
from waste.engine.expert_store import MmapExpertStore, PooledExpertStore
from waste.engine.model import Model
from waste.errors import WasteError
from waste.testing import tiny_container


@pytest.fixture(scope="module")
def q4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_container(tmp_path_factory, quant="q4")


def test_pool_serves_each_expert_by_its_id_mod_the_pool(q4: Path) -> None:
    with open_container(q4) as c:
        layer = c.config.moe_layers[0]
        store = PooledExpertStore(c, 3)
        got = store.get(layer, [0, 4, 3, 7])  # slots 0, 1, 0, 1
        assert got[0] is got[2] and got[1] is got[3] and got[0] is not got[1]
        for expert, slot in zip(got, (0, 1, 0, 1), strict=True):
            for a, b in zip(expert, c.expert(layer, slot), strict=True):
                np.testing.assert_array_equal(a.dequantize(), b.dequantize())
        assert store.handed_out(layer, 7) is got[1]
        assert PooledExpertStore(c, 10 * c.config.num_experts).pool == c.config.num_experts
        with pytest.raises(WasteError, match="pool of 0"):
            PooledExpertStore(c, 0)


def test_measuring_the_step_leaves_the_model_as_it_was(q4: Path) -> None:
    """The step is timed with the pool and the model then decodes with its own experts again: the
    same logits, bit for bit, as a model that was never measured."""
    ids = [5, 9, 2, 7, 11]
    with open_container(q4) as c:
        measured = Model(c, store=MmapExpertStore(c))
        own = measured.store
        step = measure_decode_compute(measured)
        assert measured.store is own and not any(measured.times.seconds.values())
        cfg = c.config
        assert step.steps == DECODE_COMPUTE_STEPS and step.pool == cfg.num_experts_per_token + 1
        assert step.pool_bytes == sum(c.expert_span(layer, e)[1] for layer in cfg.moe_layers for e in range(step.pool))
        assert 0 < step.step_seconds < 10
        # The disk as a step reads it: BLOB_LAYERS requests of top-k random blobs.
        span = c.expert_span(cfg.moe_layers[0], 0)[1]
        assert step.blob_bytes == BLOB_LAYERS * cfg.num_experts_per_token * span and step.blob_gbps > 0
        fresh = Model(c, store=MmapExpertStore(c))
        outs = []
        for model in (measured, fresh):
            session = model.new_session(16)
            first = model.prefill(session, ids, all_logits=False)
            outs.append((first, model.decode(session, 3), model.decode(session, 4)))
        for a, b in zip(*outs, strict=True):
            np.testing.assert_array_equal(a, b)


def test_pool_counts_the_guesses_a_layer_did_not_ask_for(q4: Path) -> None:
    """A layer's guesses (from each layer before it) count once each at its request; those it did
    not ask for are the unused ones; a request with no guess before it counts nothing."""
    with open_container(q4) as c:
        layer = c.config.moe_layers[0]
        store = PooledExpertStore(c, 3)
        assert store.takes_guesses
        store.guess(layer, [1, 2, 3])
        store.guess(layer, [3, 4])
        store.get(layer, [2, 3, 5])
        assert (store.guesses, store.unused_guesses) == (4, 2)  # 1 and 4 unused
        store.count_request(layer, [1, 4])  # no guess since the last request
        assert (store.guesses, store.unused_guesses) == (4, 2)
        with pytest.raises(WasteError, match="outside"):
            store.guess(layer, [c.config.num_experts])


def test_the_measured_step_guesses_as_a_streaming_decode_does(q4: Path) -> None:
    """Each MoE layer after the first is guessed before it asks (the model's guesses run in the
    measured step); the unused ones per step are what the store counted over the timed steps."""
    with open_container(q4) as c:
        cfg = c.config
        assert len(cfg.moe_layers) >= 2
        model = Model(c, store=MmapExpertStore(c))
        store = PooledExpertStore(c, cfg.num_experts_per_token + 1)
        model.store = store
        session = model.new_session(8)
        model.prefill(session, [1, 2], all_logits=False)
        model.decode(session, 3)
        k = cfg.num_experts_per_token
        assert k * (len(cfg.moe_layers) - 1) <= store.guesses <= 2 * k * (len(cfg.moe_layers) - 1)
        assert 0 <= store.unused_guesses <= store.guesses
        step = measure_decode_compute(Model(c, store=MmapExpertStore(c)))
        assert 0 <= step.unused_guesses <= 2 * k * (len(cfg.moe_layers) - 1)
        assert step.as_dict()["unused_guesses"] == step.unused_guesses
