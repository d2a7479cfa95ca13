"""Hostile or malformed safetensors files and indexes: each is one WasteError naming the file, never a
traceback, a hang or tensors silently read from the wrong bytes."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from waste.cli import main
from waste.config import preset_dict
from waste.container.convert import INDEX, checkpoint_files, read_header
from waste.errors import WasteError

F32_1 = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}


def write_safetensors(path: Path, header: bytes, data: bytes = b"") -> Path:
    """A safetensors file from raw header bytes (so that the header may be anything at all)."""
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def header_of(tensors: dict) -> bytes:
    return json.dumps(tensors).encode()


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        (header_of({"a": {**F32_1, "dtype": ["F32"]}}), bytes(4), "tensor 'a' has a malformed header entry"),
        (header_of({"a": {**F32_1, "dtype": {"F32": 1}}}), bytes(4), "tensor 'a' has a malformed header entry"),
        (header_of({"a": {**F32_1, "shape": [True]}}), bytes(4), "tensor 'a' has a malformed header entry"),
        (b"[" * 100_000 + b"]" * 100_000, b"", "header is not valid JSON"),
        (b'{"a": ' + header_of(F32_1) + b', "a": ' + header_of({**F32_1, "data_offsets": [4, 8]}) + b"}",
         bytes(8), "names 'a' twice"),
        (header_of({"a": F32_1, "b": F32_1}), bytes(4), "tensors 'a' and 'b' share bytes"),
        (header_of({"a": {**F32_1, "shape": [2], "data_offsets": [0, 8]}, "b": {**F32_1, "data_offsets": [4, 8]}}),
         bytes(8), "tensors 'a' and 'b' share bytes"),
        (json.dumps({"a": F32_1}).encode("utf-16"), bytes(4), "header is not valid JSON"),
        (header_of({"a": {**F32_1, "shape": [0], "data_offsets": [8, 0]}}), bytes(8),
         r"tensor 'a': data_offsets \[8, 0\] end before they start"),
    ],
    ids=["dtype-list", "dtype-dict", "bool-dim", "deep-nesting", "duplicate-name", "same-bytes", "overlap", "utf16",
         "reversed-offsets"],
)
def test_malformed_header_is_one_error(tmp_path: Path, header: bytes, data: bytes, message: str) -> None:
    path = write_safetensors(tmp_path / "model.safetensors", header, data)
    with pytest.raises(WasteError, match=f"{path}: .*{message}"):
        read_header(path)


def test_adjacent_and_empty_tensors_are_fine(tmp_path: Path) -> None:
    header = header_of({"a": F32_1, "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
                        "b": {**F32_1, "data_offsets": [4, 8]}})
    path = write_safetensors(tmp_path / "model.safetensors", header, bytes(8))
    assert [(t.name, t.nbytes) for t in read_header(path)] == [("a", 4), ("e", 0), ("b", 4)]


def test_header_longer_than_safetensors_allows(tmp_path: Path) -> None:
    """A header length past the cap (in a file large enough to hold it) is refused before it is read,
    and the message says why: not that it runs past the end of the file."""
    path = tmp_path / "model.safetensors"
    n = 200_000_000
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n))
        f.truncate(8 + 2 * n)  # sparse: nothing is written
    with pytest.raises(WasteError, match="header of 200000000 bytes is larger than"):
        read_header(path)


def test_deeply_nested_index(tmp_path: Path) -> None:
    (tmp_path / INDEX).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(WasteError, match=f"{INDEX}: not a safetensors index"):
        checkpoint_files(tmp_path)


@pytest.mark.parametrize(("index", "message"), [
    ({"weight_map": ["model.safetensors"]}, 'expected a "weight_map" object'),
    (["weight_map"], 'expected a "weight_map" object'),
    ({"metadata": {}}, 'expected a "weight_map" object'),
    ({"weight_map": {"a": ["model.safetensors"]}}, "its weight_map's values must be shard file names"),
])
def test_an_index_of_the_wrong_shape_says_what_it_expected(tmp_path: Path, index: object, message: str) -> None:
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(WasteError, match=f"{INDEX}: not a safetensors index .*{message}"):
        checkpoint_files(tmp_path)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors", "..", ""])
def test_an_index_naming_a_shard_elsewhere_is_refused(tmp_path: Path, shard: str) -> None:
    """A shard is a file beside its index: a path that leaves the checkpoint is not followed."""
    checkpoint = tmp_path / "ckpt"
    (checkpoint / "sub").mkdir(parents=True)
    (checkpoint / "sub" / "model.safetensors").write_bytes(b"")
    (tmp_path / "outside.safetensors").write_bytes(b"")
    (checkpoint / INDEX).write_text(json.dumps({"weight_map": {"a": shard}}))
    with pytest.raises(WasteError, match="which is not a file name beside the index"):
        checkpoint_files(checkpoint)


@pytest.mark.parametrize("name", ["model-00001-of-00002.safetensors", INDEX])
def test_fifo_in_the_checkpoint_is_refused_not_waited_on(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         name: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(preset_dict("tiny")))
    os.mkfifo(tmp_path / name)
    code = main(["convert", str(tmp_path), str(tmp_path.parent / "o.waste"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and f"{tmp_path / name}: not a regular file" in err and "\n" not in err, err
