"""A tied-embedding model (no lm_head.weight, docs/CONTAINER.md) runs in the engine, check and the oracle."""

from __future__ import annotations

import numpy as np
import pytest

from waste.cli import main
from waste.container import open_container
from waste.engine.model import Model
from waste.reference.model import ReferenceModel
from waste.testing import tiny_container


@pytest.mark.parametrize("quant", ["f32", "q8"])
def test_tied_embeddings_round_trip(tmp_path_factory: pytest.TempPathFactory, quant: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tiny_container(tmp_path_factory, quant=quant, overrides={"tie_word_embeddings": True})
    with open_container(path) as c:
        assert not c.has("lm_head.weight")
        model = Model(c)
        session = model.new_session()
        logits = model.prefill(session, [1, 2, 3])
        expected = ReferenceModel(c).forward([1, 2, 3]).logits
        tol = 1e-5 if quant == "f32" else 3e-2
        assert np.linalg.norm(logits - expected) <= tol * np.linalg.norm(expected)
    assert main(["run", str(path), "--prompt-ids", "1,2,3", "--max-new", "2"]) == 0
    assert main(["check", str(path), "--prompt-len", "6", "--new", "2"]) == 0
    assert "PASS" in capsys.readouterr().out
