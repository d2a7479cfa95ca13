"""Integrity at run time: the manifest's own checksum, CRC32C of trunk and expert data."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from waste.cli import main
from waste.container import open_container
from waste.container.format import crc32c
from waste.container.manifest import CHECKSUM_KEY, manifest_checksum


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


def _flip(path: Path, offsets: list[int]) -> None:
    data = bytearray(path.read_bytes())
    for off in offsets:
        data[off] ^= 0x04
    path.write_bytes(bytes(data))


def test_trunk_byte_flip_refused_at_run_time(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = "model.layers.1.self_attn.o_proj.weight"
    with open_container(container) as c:
        offset = c.entry(name).offset
    _flip(container / "trunk.bin", [offset + 12])
    run = ["run", str(container), "--prompt-ids", "1,2,3", "--max-new", "2"]
    code, err = run_cli(capsys, *run)
    assert code == 2 and f"trunk.bin: CRC mismatch in tensor {name!r}" in err and "\n" not in err
    code, err = run_cli(capsys, "check", str(container), "--prompt-len", "4", "--new", "1")
    assert code == 2 and "CRC mismatch" in err
    assert main([*run, "--no-verify"]) == 0  # the escape hatch: the bytes are read as they are


def _flip_every_expert(container: Path) -> None:
    with open_container(container, verify=False) as c:
        layers, num = c.config.moe_layers, c.config.num_experts
        offsets = [c.expert_span(layer, e)[0] + 40 for layer in layers for e in range(num)]
    _flip(container / "experts.bin", offsets)


@pytest.mark.parametrize("store", [[], ["--expert-cache", "0"], ["--expert-cache", "1M", "--read-threads", "2"]])
def test_expert_byte_flip_refused_at_run_time(container: Path, capsys: pytest.CaptureFixture[str],
                                              store: list[str]) -> None:
    _flip_every_expert(container)
    code, err = run_cli(capsys, "run", str(container), "--prompt-ids", "1,2,3", "--max-new", "2", *store)
    assert code == 2 and "experts.bin: CRC mismatch in model.layers." in err and "\n" not in err


def test_check_fails_on_damaged_experts(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _flip_every_expert(container)
    code, err = run_cli(capsys, "check", str(container), "--prompt-len", "4", "--new", "1")
    assert code == 2 and "CRC mismatch" in err
    assert "PASS" not in capsys.readouterr().out


def test_fifo_in_place_of_the_manifest_is_refused(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (container / "manifest.json").unlink()
    os.mkfifo(container / "manifest.json")
    code, err = run_cli(capsys, "info", str(container))
    assert code == 2 and "manifest.json: not a regular file" in err


def test_files_come_from_the_generation_that_was_opened(container: Path, tmp_path: Path,
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    from waste.engine.experts import StreamingExpertStore
    from waste.testing import tiny_container

    other = tiny_container(tmp_path_factory, seed=1)
    with open_container(container) as c:
        layer = c.config.moe_layers[0]
        before = c.expert(layer, 3)[0].dequantize().copy()
        # What `convert --force` does to the path while a reader has it open.
        os.rename(container, tmp_path / "old.waste")
        shutil.copytree(other, container)
        with StreamingExpertStore(c, 0, read_threads=1) as store:
            (w1, _, _), = store.get(layer, [3])
        assert np.array_equal(w1.dequantize(), before)
