"""Rows of a trunk matrix read from trunk.bin as they are asked for (`waste.container.rows`): the
untied embedding, left out of the trunk's copy in memory and counted so by the memory plan."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from waste.container import open_container
from waste.engine.memory import mapped_rss, resident_trunk
from waste.errors import WasteError
from waste.plan import container_weight_bytes
from waste.testing import tiny_container


@pytest.mark.parametrize("quant", ["f32", "bf16", "q8", "q4all"])
def test_an_untied_embedding_is_read_from_the_file(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
                                                  quant: str) -> None:
    """A token reads one row of an untied embedding: `rows` reads its rows from trunk.bin as asked
    for, bit for bit the matrix's, without mapping any page of it into the process;
    hold_trunk_in_memory leaves the huge pages wholly inside it out of the copy (views of it read
    the map), and the memory plan counts the trunk so; a file cut short is named."""
    # 32768 rows of 64: an 8 MiB embedding in f32, 4 MiB or more of it in whole huge pages
    out = tiny_container(tmp_path_factory, quant=quant, dtype="bf16" if quant == "bf16" else "f32",
                         overrides={"vocab_size": 32768})
    name = "model.embed_tokens.weight"
    with open_container(out) as c:
        e = c.entry(name)
        expected = np.array(c.matrix(name).take_rows(np.arange(c.config.vocab_size)))
        c.hold_trunk_in_memory()
        size = (out / "trunk.bin").stat().st_size
        huge = 2 << 20
        hole = max(0, (e.offset + e.nbytes) // huge * huge - -(-e.offset // huge) * huge)
        assert c.trunk_in_memory == size - hole and (hole >= 4 << 20 or quant != "f32")
        trunk_fd = c.data_fds()[0]
        rows = c.rows(name)
        ids = np.array([32767, 0, 7, 20000, 7, 15, 16, 32767])
        assert np.array_equal(rows.take_rows(ids), expected[ids])
        assert rows.take_rows(np.zeros(0, np.int64)).shape == (0, 64)
        assert mapped_rss([trunk_fd]) == 0
        assert np.array_equal(c.matrix(name).take_rows(ids), expected[ids])  # the oracle's view: the map
        with pytest.raises(WasteError, match="out of range"):
            rows.take_rows(np.array([32768]))
        weights = container_weight_bytes(c)
        planned = resident_trunk(c.config, weights, 8)
        assert c.trunk_in_memory <= planned <= weights.trunk and (planned < weights.trunk or quant != "f32")
    cut = tmp_path / "cut.waste"
    shutil.copytree(out, cut)
    writer = os.open(cut / "trunk.bin", os.O_WRONLY)  # open for writing: no lease is taken (lease.py)
    try:
        with open_container(cut) as c:
            rows = c.rows(name)
            os.ftruncate(writer, e.offset)
            with pytest.raises(WasteError, match="trunk.bin: cut short"):
                rows.take_rows(np.array([5]))
    finally:
        os.close(writer)


def test_a_tied_embedding_is_held_as_the_lm_head(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A tied embedding is the lm_head as well, read whole every token: copied with the trunk and
    counted whole by the memory plan."""
    out = tiny_container(tmp_path_factory, overrides={"vocab_size": 32768, "tie_word_embeddings": True})
    with open_container(out) as c:
        c.hold_trunk_in_memory()
        assert c.trunk_in_memory == (out / "trunk.bin").stat().st_size
        weights = container_weight_bytes(c)
        assert resident_trunk(c.config, weights, 8) == weights.trunk
