"""waste.analysis.goldens: the engine and the oracle against the stored goldens of other
implementations, as the token_exact notebook shows them (tests/reference/test_goldens.py holds
`waste run` itself to them)."""

import json
import shutil
from pathlib import Path

import pytest

from waste.analysis.goldens import (
    ENGINE_GOLDEN_RTOL,
    GOLDEN_DIR,
    GOLDENS,
    ORACLE_GOLDEN_RTOL,
    format_agreements,
    golden_agreements,
)
from waste.errors import WasteError


def test_engine_and_oracle_agree_with_every_golden(tmp_path: Path) -> None:
    rows = golden_agreements(tmp_path)
    assert [r.golden for r in rows] == [g for g, _, _ in GOLDENS]
    for r in rows:
        assert r.prompt_error <= ENGINE_GOLDEN_RTOL and r.oracle_error <= ORACLE_GOLDEN_RTOL, r
        assert r.prompt_error <= r.worst_position <= 4 * ENGINE_GOLDEN_RTOL, r
        if r.implementation.startswith("mlx-lm"):
            assert r.decoded == 8 and r.tokens_agreed == r.decoded and r.decode_error <= ENGINE_GOLDEN_RTOL, r
            assert {"mlx", "mlx-lm"} <= set(r.versions)
        else:
            assert r.decoded == 0 and r.decode_error is None and r.tokens_agreed is None
    table = format_agreements(rows).splitlines()
    assert len(table) == 2 + len(rows) and "mlx-lm kimi_k3" in table[-1] and "8/8" in table[-1]
    unchecked = golden_agreements(tmp_path, goldens=GOLDENS[2:3], oracle=False)[0]
    assert unchecked.oracle_error is None and unchecked.prompt_error == rows[2].prompt_error
    assert format_agreements([unchecked]).splitlines()[-1].split()[-3] == "-"  # the oracle's column
    # A second call reuses the converted containers; a changed checkpoint is converted afresh.
    converted = sorted(p.name for p in tmp_path.glob("*.waste"))
    assert len(converted) == len({c for _, c, _ in GOLDENS})
    assert golden_agreements(tmp_path, goldens=GOLDENS[:1])[0].prompt_error == rows[0].prompt_error
    assert sorted(p.name for p in tmp_path.glob("*.waste")) == converted
    changed = tmp_path / "changed"
    shutil.copytree(GOLDEN_DIR / "kimi_linear_tiny", changed / "kimi_linear_tiny")
    shutil.copy(GOLDEN_DIR / GOLDENS[0][0], changed / GOLDENS[0][0])
    config = json.loads((changed / "kimi_linear_tiny" / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3  # another model: the old conversion would still agree with the golden
    (changed / "kimi_linear_tiny" / "config.json").write_text(json.dumps(config))
    moved = golden_agreements(tmp_path, changed, goldens=GOLDENS[:1])[0]
    assert moved.prompt_error > ENGINE_GOLDEN_RTOL and len(list(tmp_path.glob("*.waste"))) == len(converted) + 1


def test_missing_goldens_are_named(tmp_path: Path) -> None:
    with pytest.raises(WasteError, match="k3_tiny_mlx.npz, k3_tiny .*make_goldens"):
        golden_agreements(tmp_path / "work", tmp_path, goldens=[g for g in GOLDENS if g[1] == "k3_tiny"])
