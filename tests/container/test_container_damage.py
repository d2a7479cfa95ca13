"""Damaged containers and checkpoints: each fails with its own clear message and exit code 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from waste.cli import main
from waste.container import ContainerError, open_container
from waste.container.convert import convert
from waste.synth import synthesize
from waste.testing import tiny_container

NAME = "model.layers.1.self_attn.kv_b_proj.weight"


@pytest.fixture
def container(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    """A fresh copy of the tiny f32 container that the test may damage."""
    src = tiny_container(tmp_path_factory)
    dst = tmp_path / "damaged.waste"
    shutil.copytree(src, dst)
    return dst


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


def test_sound_container_verifies(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", str(container)])
    assert code == 0 and "OK" in capsys.readouterr().out
    assert main(["info", str(container), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["scheme"] == "f32" and info["trunk_bytes"] == (container / "trunk.bin").stat().st_size
    assert main(["info", str(container)]) == 0
    text = capsys.readouterr().out
    assert "scheme f32" in text and "kimi_linear" in text and info["manifest_sha256"] in text


def test_closed_container(container: Path) -> None:
    c = open_container(container)
    view = c.tensor("model.norm.weight")
    c.close()
    assert view.shape == (64,) and np.isfinite(view).all()  # views taken before close stay valid
    with pytest.raises(ContainerError, match="closed"):
        c.tensor("model.norm.weight")


@pytest.mark.parametrize("fname", ["trunk.bin", "experts.bin", "manifest.json"])
def test_truncated_file(container: Path, capsys: pytest.CaptureFixture[str], fname: str) -> None:
    path = container / fname
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    code, err = run_cli(capsys, "verify", str(container))
    assert code == 2
    assert str(path) in err
    if fname == "manifest.json":
        assert "not valid JSON" in err
    else:
        assert f"truncated to {len(data) * 2 // 3} of {len(data)} bytes" in err
        assert ("tensor 'model." if fname == "trunk.bin" else "expert ") in err


def test_missing_file(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (container / "experts.bin").unlink()
    code, err = run_cli(capsys, "info", str(container))
    assert code == 2 and "experts.bin: missing" in err


def test_flipped_byte_in_a_tensor(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with open_container(container) as c:
        e = c.entry(NAME)
    path = container / "trunk.bin"
    data = bytearray(path.read_bytes())
    data[e.offset + 100] ^= 0x10
    path.write_bytes(bytes(data))
    open_container(container, verify=False).close()  # bounds are fine: only the CRC can tell
    with pytest.raises(ContainerError, match=f"CRC mismatch in tensor {NAME!r}"):
        open_container(container)  # which is checked on every open
    code, err = run_cli(capsys, "verify", str(container))
    assert code == 2
    assert f"trunk.bin: CRC mismatch in tensor {NAME!r}" in err


def _flip_expert_byte(container: Path, part: int, byte: int, mask: int) -> int:
    """XOR `mask` into byte `byte` of part `part` (0 w1, 1 w3, 2 w2) of expert 6 of the second MoE
    layer in experts.bin -> that layer."""
    with open_container(container) as c:
        layer = c.config.moe_layers[1]
        offset, _ = c.expert_span(layer, 6)
        part_offset = c.manifest["experts"]["parts"][part]["offset"]
    path = container / "experts.bin"
    data = bytearray(path.read_bytes())
    data[offset + part_offset + byte] ^= mask
    path.write_bytes(bytes(data))
    return layer


def test_flipped_byte_in_an_expert(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layer = _flip_expert_byte(container, 2, 8, 0x01)
    code, err = run_cli(capsys, "verify", str(container))
    assert code == 2
    assert f"experts.bin: CRC mismatch in model.layers.{layer}.block_sparse_moe.experts.6.w2.weight" in err


def test_flipped_byte_in_an_expert_held_in_memory(container: Path) -> None:
    """An expert copied into memory (hold_experts_in_memory) is checked on the copy, when first asked for."""
    layer = _flip_expert_byte(container, 0, 3, 0x10)
    with open_container(container) as c:
        c.hold_experts_in_memory()
        c.expert(layer, 5)
        with pytest.raises(ContainerError, match=f"CRC mismatch in model.layers.{layer}.block_sparse_moe.experts.6.w1"):
            c.expert(layer, 6)


def test_flipped_byte_in_padding(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with open_container(container) as c:
        gaps = [(c.entry(a).offset + c.entry(a).nbytes, c.entry(b).offset, b)
                for a, b in zip(c.names(), c.names()[1:], strict=False)]
    start, end, after = next(g for g in gaps if g[1] > g[0])
    path = container / "trunk.bin"
    data = bytearray(path.read_bytes())
    data[start] = 0xFF
    path.write_bytes(bytes(data))
    code, err = run_cli(capsys, "verify", str(container))
    assert code == 2 and f"nonzero padding in bytes {start}..{end} before tensor {after!r}" in err


def test_nonzero_padding_inside_an_expert_blob_and_after_the_trunk(tmp_path_factory: pytest.TempPathFactory,
                                                                    tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A q8 container has padding between an expert's parts, at the end of its blob and after the
    last trunk tensor (the f32 fixture has none of these): each nonzero byte there is named."""
    container = tmp_path / "q8.waste"
    shutil.copytree(tiny_container(tmp_path_factory, quant="q8"), container)
    with open_container(container) as c:
        parts, blob = c._manifest.experts.parts, c._manifest.experts.blob_bytes
        layer = c._manifest.experts.layers[0]
        last = max((c.entry(n) for n in c.names()), key=lambda e: e.offset)
        trunk_end = last.offset + last.nbytes
        trunk_size = c.byte_counts()["trunk_bytes"]
    between = parts[0].offset + parts[0].nbytes
    tail = parts[-1].offset + parts[-1].nbytes
    assert parts[1].offset > between and blob > tail and trunk_size > trunk_end
    for name, offset in (("experts.bin", between), ("experts.bin", tail), ("trunk.bin", trunk_end)):
        path = container / name
        data = bytearray(path.read_bytes())
        data[offset] = 0xFF
        path.write_bytes(bytes(data))
    assert main(["verify", str(container)]) == 2
    out = capsys.readouterr().out
    assert f"nonzero padding before w3 of expert 0, layer {layer}" in out
    assert f"nonzero padding at the end of expert 0, layer {layer}" in out
    assert f"nonzero padding after the last tensor (bytes {trunk_end}..{trunk_size})" in out
    assert out.count("\n") == 3


def test_verify_collects_every_problem(container: Path) -> None:
    with open_container(container) as c:
        offsets = [c.entry(n).offset for n in c.names()[:3]]
    path = container / "trunk.bin"
    data = bytearray(path.read_bytes())
    for off in offsets:
        data[off] ^= 0xFF
    path.write_bytes(bytes(data))
    with open_container(container, verify=False) as c:
        assert len(c.verify(collect=True)) == 3
        with pytest.raises(ContainerError, match="CRC mismatch"):
            c.verify()


def _edit_manifest(container: Path, edit) -> None:
    path = container / "manifest.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format_version=3), "unknown format version 3 (this reader knows 2)"),
        (lambda d: d.update(magic="SAFETENSORS"), "not a WASTE container"),
        (lambda d: d.update(scheme="q3"), "unknown quantisation scheme 'q3'"),
        (lambda d: d["tensors"][5].update(offset=10**9), "past the end of trunk.bin"),
        (lambda d: d["tensors"][5].update(offset=d["tensors"][5]["offset"] + 8), "is not 64-byte aligned"),
        (lambda d: d["tensors"][5].update(offset=d["tensors"][4]["offset"]), "overlap in trunk.bin"),
        (lambda d: d["tensors"].pop(7), "tensor(s) missing"),
        (lambda d: d["tensors"][3].update(shape=[7, 7]), "has shape [7, 7]"),
        (lambda d: d["tensors"][3].update(storage="q4g"), "is stored as matrix q4g"),
        (lambda d: d["files"]["trunk.bin"].update(bytes=1), "past the end of trunk.bin (1 bytes)"),
        (lambda d: d["experts"].update(blob_bytes=4096), "experts.blob_bytes"),
        (lambda d: d["experts"]["crc32c"].pop(), "experts.crc32c"),
        (lambda d: d["config"].update(num_hidden_layers=-1), "config: config key 'num_hidden_layers'"),
    ],
)
def test_bad_manifest(container: Path, capsys: pytest.CaptureFixture[str], edit, message: str) -> None:
    _edit_manifest(container, edit)
    code, err = run_cli(capsys, "info", str(container))
    assert code == 2
    assert message in err and "manifest.json" in err
    assert "\n" not in err and "Traceback" not in err


def test_not_a_container(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(capsys, "verify", str(tmp_path / "nothing.waste"))
    assert code == 2 and "not a container directory" in err
    code, err = run_cli(capsys, "verify", str(tmp_path))
    assert code == 2 and "manifest.json: missing" in err


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A tiny f32 checkpoint rewritten as one model.safetensors that tests may edit."""
    return synthesize("tiny", tmp_path / "hf", dtype="f32")


def _rewrite(hf: Path, edit) -> None:
    from safetensors.numpy import load_file

    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shard = hf / sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard))
    index["weight_map"] = {n: shard.name for n in tensors}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop(NAME), f"missing 1 tensor(s): {NAME}"),
        (lambda t: t.pop("model.layers.2.block_sparse_moe.experts.3.w3.weight"),
         "missing 1 tensor(s): model.layers.2.block_sparse_moe.experts.3.w3.weight"),
        (lambda t: t.update({NAME: np.zeros((5, 32), np.float32)}), f"misshapen 1 tensor(s): {NAME} [5, 32]"),
        (lambda t: t.update({"model.layers.9.extra.weight": np.zeros(3, np.float32)}),
         "unexpected 1 tensor(s): model.layers.9.extra.weight"),
        (lambda t: t.update({"model.layers.0.block_sparse_moe.up_proj.weight":
                             t["model.layers.0.mlp.up_proj.weight"]}),
         "'model.layers.0.mlp.up_proj.weight' appears twice"),
        (lambda t: t["model.norm.weight"].__setitem__(3, np.nan), "'model.norm.weight' holds NaN"),
        (lambda t: t.update({"model.layers.0.self_attn.A_log": np.ones(16, np.float32)}),
         "is not zero past the 4 heads"),
        # the first value past the heads alone: an off-by-one would not see it
        (lambda t: t.update({"model.layers.0.self_attn.A_log":
                             np.r_[np.ones(4), 0.5, np.zeros(11)].astype(np.float32)}),
         "is not zero past the 4 heads"),
    ],
)
def test_bad_checkpoint(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], edit,
                        message: str) -> None:
    _rewrite(checkpoint, edit)
    out = tmp_path / "out.waste"
    code, err = run_cli(capsys, "convert", str(checkpoint), str(out), "--quant", "f32", "--quiet")
    assert code == 2 and message in err, err
    assert not out.exists()
    assert not list(tmp_path.glob(".out.waste.tmp-*")), "the temporary directory must be removed"


def test_truncated_shard(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = next(checkpoint.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-1000])
    code, err = run_cli(capsys, "convert", str(checkpoint), str(tmp_path / "o.waste"), "--quiet")
    assert code == 2 and f"{shard}: truncated: tensor" in err


def test_refuses_to_overwrite_without_force(checkpoint: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = convert(checkpoint, tmp_path / "o.waste", quant="f32", progress=False)
    before = (out / "manifest.json").read_bytes()
    code, err = run_cli(capsys, "convert", str(checkpoint), str(out), "--quant", "f32", "--quiet")
    assert code == 2 and "exists; pass --force" in err
    code, _ = run_cli(capsys, "convert", str(checkpoint), str(out), "--quant", "f32", "--quiet", "--force")
    assert code == 0 and (out / "manifest.json").read_bytes() == before
    code, err = run_cli(capsys, "synth", "tiny", str(checkpoint))
    assert code == 2 and "exists; pass --force" in err


def test_force_replaces_only_an_earlier_output_or_an_empty_directory(checkpoint: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A mistyped OUT with --force must not delete a directory of other files (or a file)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    a_file = tmp_path / "thesis.pdf"
    a_file.write_bytes(b"%PDF")
    for out in (home, a_file):
        code, err = run_cli(capsys, "convert", str(checkpoint), str(out), "--quant", "f32", "--quiet", "--force")
        assert code == 2 and "is not a waste container nor an empty directory: not replaced" in err
        assert "\n" not in err.strip()
    code, err = run_cli(capsys, "synth", "tiny", str(home), "--force")
    assert code == 2 and "is not a checkpoint (a directory with config.json) nor an empty directory" in err
    assert (home / "notes.txt").read_text() == "mine" and a_file.read_bytes() == b"%PDF"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["home", "thesis.pdf", checkpoint.name])
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _ = run_cli(capsys, "convert", str(checkpoint), str(empty), "--quant", "f32", "--quiet", "--force")
    assert code == 0 and (empty / "manifest.json").is_file()



def test_a_failed_read_of_an_expert_held_in_memory(container: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An expert read into memory (hold_experts_in_memory) whose read fails is one ContainerError
    naming the file and the failure, not a half-filled copy."""
    import errno

    from waste import fileio

    def failing(fd, bufs, offset):
        raise OSError(errno.EIO, "Input/output error")

    with open_container(container) as c:
        c.hold_experts_in_memory()
        monkeypatch.setattr(fileio, "_preadv", failing)
        with pytest.raises(ContainerError, match=r"experts\.bin: reading \d+ B at \d+: Input/output error"):
            c.expert(c.config.moe_layers[0], 1)
