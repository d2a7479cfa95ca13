"""NaN or infinity in hidden states or logits stops a run and names where it first appeared."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from waste.cli import main
from waste.container import open_container
from waste.testing import tiny_container


@pytest.fixture
def container(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    dst = tmp_path / "c.waste"
    shutil.copytree(tiny_container(tmp_path_factory), dst)
    return dst


def _poison(container: Path, name: str) -> None:
    """Write NaN into one float32 tensor (the CRCs then disagree: runs need --no-verify)."""
    with open_container(container, verify=False) as c:
        offset = c.entry(name).offset
    with open(container / "trunk.bin", "r+b") as f:
        f.seek(offset + 8)
        f.write(np.float32(np.nan).tobytes())


@pytest.mark.parametrize(("tensor", "where"), [
    ("model.layers.1.input_layernorm.weight", "layer 1 ("),
    ("model.layers.2.post_attention_layernorm.weight", "layer 2 ("),
    ("model.norm.weight", "the logits"),
])
def test_nan_stops_the_run_naming_the_layer(container: Path, capsys: pytest.CaptureFixture[str], tensor: str,
                                            where: str) -> None:
    _poison(container, tensor)
    code = main(["run", str(container), "--prompt-ids", "1,2,3", "--max-new", "2", "--no-verify"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "NaN or infinite values first appeared in " + where in err, err
    assert "\n" not in err


def test_check_finite_is_exact() -> None:
    from waste.engine.model import check_finite
    from waste.errors import NonFiniteError

    big = np.full((2, 8), 3e38, np.float32)  # a sum would overflow; every value is finite
    check_finite(big, "x", np.arange(2))
    bad = np.zeros((3, 4), np.float32)
    bad[2, 1] = -np.inf
    with pytest.raises(NonFiniteError, match="in x at position 7"):
        check_finite(bad, "x", np.arange(5, 8))
