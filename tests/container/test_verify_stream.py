"""`waste verify` reading at disk speed: spans across read blocks, the progress bar only on a
terminal, and the speed on the result line; the tokenizer under the container's CRC32C."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
import zlib
from pathlib import Path

import pytest

import waste.container.verify as verify_module
from waste.cli import main
from waste.container import open_container
from waste.container.manifest import CHECKSUM_KEY, manifest_checksum
from waste.testing import tiny_container


@pytest.fixture
def container(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    """A fresh copy of the tiny q4 container (with its tokenizer) that the test may damage."""
    dst = tmp_path / "c.waste"
    shutil.copytree(tiny_container(tmp_path_factory, quant="q4"), dst)
    return dst


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x04
    path.write_bytes(bytes(data))


def test_verify_reports_its_speed_and_nothing_on_a_pipe(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(container)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # stderr is not a terminal here: no progress bar
    assert captured.out.count("\n") == 1 and ": OK (" in captured.out and "GB/s" in captured.out


@pytest.mark.parametrize("block", [4096, 8192 + 4096])
def test_spans_across_read_blocks(container: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                  block: int) -> None:
    """Reads smaller than a tensor or an expert blob: CRCs carry over block boundaries, and one
    flipped byte still names its expert and part."""
    monkeypatch.setattr(verify_module, "VERIFY_BLOCK", block)
    assert main(["verify", str(container)]) == 0
    with open_container(container) as c:
        layer = c.config.moe_layers[-1]
        offset, nbytes = c.expert_span(layer, 5)
        w3 = c.manifest["experts"]["parts"][1]
        big = max(c.names(), key=lambda n: c.entry(n).nbytes)
        entry = c.entry(big)
    assert entry.nbytes > block  # the trunk check crosses blocks too
    _flip(container / "experts.bin", offset + w3["offset"] + w3["bytes"] - 1)
    _flip(container / "trunk.bin", entry.offset + entry.nbytes // 2)
    capsys.readouterr()
    assert main(["verify", str(container)]) == 2
    out, err = capsys.readouterr()
    # every problem on stdout, verify's report; stderr one line: the first, and how many more
    assert f"CRC mismatch in model.layers.{layer}.block_sparse_moe.experts.5.w3.weight (blob at byte {offset})" in out
    assert f"CRC mismatch in tensor {big!r}" in out and out.count("\n") == 2
    assert err.count("\n") == 1 and err.startswith("waste: error: ") and "(and 1 more problem, listed on stdout)" in err


def test_progress_bar_only_on_a_terminal(container: Path) -> None:
    argv = [sys.executable, "-m", "waste.cli", "verify", str(container)]
    piped = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and piped.stderr == "" and "OK" in piped.stdout
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # a new pty is 0 columns wide
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=follower, text=True, timeout=120)
        os.close(follower)
        follower = -1
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert proc.returncode == 0 and "OK" in proc.stdout
    assert b"verify" in shown  # the bar went to the terminal, not to stdout


def _tokenizer_record(container: Path) -> dict:
    return json.loads((container / "manifest.json").read_text())["source"]["tokenizer"]


def test_tokenizer_files_carry_crc32c_and_a_flip_is_one_line(container: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    record = _tokenizer_record(container)
    assert set(record["tiktoken.model"]) == {"bytes", "crc32c"}
    assert main(["run", str(container), "--prompt", "Hello", "--max-new", "1"]) == 0
    capsys.readouterr()
    _flip(container / "tokenizer" / "tiktoken.model", 10)
    assert main(["run", str(container), "--prompt", "Hello", "--max-new", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "tokenizer/tiktoken.model: does not match the manifest (CRC mismatch)" in err and "\n" not in err
    assert main(["run", str(container), "--prompt-ids", "1,2", "--max-new", "1"]) == 0  # ids need no tokenizer


def test_tokenizer_file_replaced_by_a_fifo_or_cut_short(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = container / "tokenizer" / "tokenizer_config.json"
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    assert main(["run", str(container), "--prompt", "Hi", "--max-new", "1"]) == 2
    assert f"{path}: {len(data) - 3} bytes, the manifest says {len(data)}" in capsys.readouterr().err
    path.unlink()
    os.mkfifo(path)
    assert main(["run", str(container), "--prompt", "Hi", "--max-new", "1"]) == 2
    assert "not a regular file" in capsys.readouterr().err


def test_containers_with_zlib_tokenizer_records_still_load(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Containers written before the tokenizer moved to CRC32C list zlib's CRC32 (the 48B one in
    /work/scale does); they are still checked, with zlib."""
    path = container / "manifest.json"
    doc = json.loads(path.read_text())
    for name, rec in doc["source"]["tokenizer"].items():
        data = (container / "tokenizer" / name).read_bytes()
        doc["source"]["tokenizer"][name] = {"bytes": rec["bytes"], "crc32": zlib.crc32(data)}
    doc[CHECKSUM_KEY] = manifest_checksum(doc)
    path.write_text(json.dumps(doc))
    assert main(["run", str(container), "--prompt", "Hello", "--max-new", "1"]) == 0
    capsys.readouterr()
    _flip(container / "tokenizer" / "tiktoken.model", 3)
    assert main(["run", str(container), "--prompt", "Hello", "--max-new", "1"]) == 2
    assert "CRC mismatch" in capsys.readouterr().err


def _write_with_fresh_crcs(container: Path, *, tensor: str | None = None, expert: tuple[int, int, int] | None = None,
                           buffer: str, data: bytes) -> str:
    """Overwrite the start of one buffer of a trunk tensor or of an expert part (layer, expert,
    part index) and recompute its CRC and the manifest's checksum: damage no CRC can see, as a
    faulty writer would leave. Returns the name verify should report."""
    from waste.container.format import crc32c

    path = container / "manifest.json"
    doc = json.loads(path.read_text())
    if tensor is not None:
        row = next(t for t in doc["tensors"] if t["name"] == tensor)
        file, start, name = container / "trunk.bin", row["offset"], f"tensor {tensor!r}"
    else:
        layer, e, p = expert
        ex = doc["experts"]
        li = ex["layers"].index(layer)
        row = ex["parts"][p]
        start = (li * ex["num_experts"] + e) * ex["blob_bytes"] + row["offset"]
        file = container / "experts.bin"
        name = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{row['name']}.weight"
    buf = next(b for b in row["buffers"] if b["name"] == buffer)
    with open(file, "r+b") as f:
        f.seek(start + buf["offset"])
        f.write(data)
        f.seek(start)
        crc = crc32c(f.read(row["bytes"]))
    if tensor is not None:
        row["crc32c"] = crc
    else:
        doc["experts"]["crc32c"][li][e][p] = crc
    doc[CHECKSUM_KEY] = manifest_checksum(doc)
    path.write_text(json.dumps(doc))
    return name


@pytest.mark.parametrize(("build", "where", "buffer", "data", "problem"), [
    ({"quant": "f32"}, "model.norm.weight", "w", struct.pack("<f", float("nan")), "NaN or infinite values"),
    ({"quant": "f32"}, (1, 3, 2), "w", struct.pack("<f", float("-inf")), "NaN or infinite values"),
    ({"quant": "bf16"}, "lm_head.weight", "w", struct.pack("<H", 0x7FC1), "NaN or infinite values"),
    ({"quant": "q4"}, (1, 5, 1), "scales", struct.pack("<e", float("inf")), "NaN or infinite values"),
    ({"quant": "q8"}, "model.embed_tokens.weight", "tscale", struct.pack("<f", float("nan")),
     "NaN or infinite values"),
    ({"quant": "q8", "preset": "k3-tiny"}, (2, 7, 0), "scales", b"\x7f\xff", "the E8M0 NaN scale byte 255"),
])
def test_verify_names_values_that_are_not_numbers(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str], build: dict,
                                                   where: str | tuple, buffer: str, data: bytes, problem: str) -> None:
    """A NaN, an infinity or MXFP4's NaN scale with CRCs that match (a faulty writer, not a flipped
    bit): verify names the tensor and buffer, where a run would only meet NaN logits."""
    container = tmp_path / "c.waste"
    shutil.copytree(tiny_container(tmp_path_factory, **build), container)
    assert main(["verify", str(container)]) == 0
    capsys.readouterr()
    name = _write_with_fresh_crcs(container, tensor=where if isinstance(where, str) else None,
                                  expert=where if isinstance(where, tuple) else None, buffer=buffer, data=data)
    assert main(["verify", str(container)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "CRC" not in err, err  # the one problem: stderr's line
    assert f"{name} holds {problem} (buffer {buffer!r}" in err, err


@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16", "e8m0"])
def test_non_numbers_are_found_by_their_bits(kind: str) -> None:
    """Every NaN and infinity of each kind is found, and no finite value is: all 2^16 float16 and
    bfloat16 patterns, every E8M0 byte, and float32's edges."""
    import ml_dtypes
    import numpy as np

    from waste.container.verify import holds_non_number

    if kind in ("float16", "bfloat16"):
        bits = np.arange(1 << 16, dtype=np.uint16)
        values = bits.view(np.float16 if kind == "float16" else ml_dtypes.bfloat16).astype(np.float32)
    elif kind == "e8m0":
        bits = np.arange(256, dtype=np.uint8)
        values = np.where(bits == 255, np.nan, 2.0 ** (bits.astype(np.float64) - 127))
    else:
        edges = np.array([0.0, -0.0, 1e-45, 3.4028235e38, -3.4028235e38, np.inf, -np.inf, np.nan], np.float32)
        bits = np.concatenate([edges.view(np.uint32), np.array([0x7F800001, 0xFFFFFFFF], np.uint32)])
        values = bits.view(np.float32)
    for b, v in zip(bits, values, strict=True):
        piece = np.frombuffer(b.tobytes(), np.uint8)
        assert holds_non_number(piece, kind) == (not np.isfinite(v)), (kind, hex(int(b)))
