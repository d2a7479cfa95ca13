"""Integrity at run time: the manifest's own checksum, CRC32C of trunk and expert data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from waste.cli import main
from waste.container.format import CHECKSUM_KEY, crc32c, manifest_checksum


@pytest.fixture
def container(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    """A fresh copy of the tiny f32 container that the test may damage."""
    from waste.testing import tiny_container

    dst = tmp_path / "c.waste"
    shutil.copytree(tiny_container(tmp_path_factory), dst)
    return dst


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err.strip()


def test_crc32c_is_castagnoli() -> None:
    # The check value of CRC-32C (RFC 3720) and its continuation over two pieces.
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"56789", crc32c(b"1234")) == 0xE3069283


def test_manifest_checksum_survives_reformatting(container: Path) -> None:
    doc = json.loads((container / "manifest.json").read_text())
    assert doc[CHECKSUM_KEY] == manifest_checksum(doc)
    (container / "manifest.json").write_text(json.dumps(doc, indent=4, sort_keys=True))
    assert main(["info", str(container)]) == 0


@pytest.mark.parametrize(("key", "value"), [("num_experts_per_token", 3), ("rms_norm_eps", 1e-3),
                                            ("routed_scaling_factor", 2.0)])
def test_manifest_config_edits_refused(container: Path, capsys: pytest.CaptureFixture[str], key: str,
                                       value: object) -> None:
    path = container / "manifest.json"
    doc = json.loads(path.read_text())
    doc["config"][key] = value
    path.write_text(json.dumps(doc, indent=1))
    for command in ("info", "verify", "run"):
        extra = ["--prompt-ids", "1,2", "--max-new", "1"] if command == "run" else []
        code, err = run_cli(capsys, command, str(container), *extra)
        assert code == 2 and "manifest.json: checksum mismatch" in err, (command, err)
        assert "\n" not in err


def test_manifest_without_checksum_refused(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = container / "manifest.json"
    doc = json.loads(path.read_text())
    del doc[CHECKSUM_KEY]
    path.write_text(json.dumps(doc))
    code, err = run_cli(capsys, "info", str(container))
    assert code == 2 and "key 'checksum' is missing" in err


def test_version_1_refused_with_reconvert_hint(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = container / "manifest.json"
    doc = json.loads(path.read_text())
    doc["format_version"] = 1
    path.write_text(json.dumps(doc))
    code, err = run_cli(capsys, "run", str(container), "--prompt-ids", "1")
    assert code == 2 and "format version 1" in err and "convert the checkpoint again" in err
    assert "\n" not in err
