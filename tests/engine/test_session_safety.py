"""Resumed sessions: sampling options given on the command line win; hand-edited files are refused."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from waste.cli import main
from waste.container import open_container
from waste.engine import session as session_module
from waste.engine.model import Model
from waste.engine.runner import generate
from waste.engine.sampling import Sampler
from waste.engine.session import read_session_file
from waste.errors import WasteError
from waste.testing import tiny_container


@pytest.fixture(scope="module")
def container(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_container(tmp_path_factory)


@pytest.fixture
def saved(container: Path, tmp_path: Path) -> Path:
    path = tmp_path / "s.npz"
    assert main(["run", str(container), "--prompt-ids", "5,6,7,8", "--max-new", "2",
                 "--session-out", str(path)]) == 0
    return path


def _generated(capsys: pytest.CaptureFixture[str]) -> list[int]:
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("generated:"))
    return [int(t) for t in line.split(":")[1].split(",") if t.strip()]


def test_sampling_options_override_the_saved_ones(container: Path, saved: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["run", str(container), "--session-in", str(saved), "--max-new", "8", "--temperature", "3",
                 "--top-p", "0.95", "--seed", "11"]) == 0
    sampled = _generated(capsys)
    with open_container(container) as c:
        model = Model(c)
        session = model.load_session(str(saved))
        expected = generate(model, session, [], 8, Sampler(3.0, 0.95, 11)).generated
        greedy = generate(model, model.load_session(str(saved)), [], 8, Sampler()).generated
    assert sampled == expected and sampled != greedy


def _rewrite(path: Path, edit) -> None:
    with np.load(path) as z:
        arrays = {n: z[n] for n in z.files}
    meta = json.loads(arrays.pop("meta").tobytes())
    edit(meta, arrays)
    meta["sha256"] = {n: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for n, a in arrays.items()}
    np.savez(path, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)


def _first(arrays: dict, prefix: str) -> str:
    return next(n for n in sorted(arrays) if n.startswith(prefix))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m, a: a["last_logits"].__setitem__(3, np.nan), "'last_logits' holds NaN"),
    (lambda m, a: a.update({(k := _first(a, "kda")): a[k][:1]}), "this model needs float32"),
    (lambda m, a: a.update({(k := _first(a, "mla")): a[k].astype(np.float64)}), "this model needs float32"),
    (lambda m, a: a["tokens"].__setitem__(0, 10**6), "outside the vocabulary"),
    (lambda m, a: m.update(position=99), "tokens must be int64 [position]"),
    (lambda m, a: m.update(container_hash=7), "container_hash"),
    (lambda m, a: m["sampler_state"].update(temperature=-1), "sampler_state is malformed"),
    (lambda m, a: a.pop(_first(a, "kda")), "does not match this model's layers"),
])
def test_hand_edited_sessions_refused(container: Path, saved: Path, edit, message: str) -> None:
    _rewrite(saved, edit)
    with open_container(container) as c, pytest.raises(WasteError, match=message.replace("[", r"\[")):
        Model(c).load_session(str(saved))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m, a: m["sampler_state"]["rng"]["state"].update(state=2**200), "sampler_state is malformed"),
    (lambda m, a: m["sampler_state"]["rng"]["state"].update(inc=-5), "sampler_state is malformed"),
    (lambda m, a: m["sampler_state"]["rng"].update(has_uint32=2**70), "sampler_state is malformed"),
    (lambda m, a: m["sampler_state"]["rng"].update(uinteger=2**70), "sampler_state is malformed"),
], ids=["state-too-large", "inc-negative", "has-uint32-too-large", "uinteger-too-large"])
def test_out_of_range_sampler_states_refused(container: Path, saved: Path, edit, message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A PCG64 state NumPy cannot take is refused in one line, not an OverflowError from the sampler."""
    _rewrite(saved, edit)
    capsys.readouterr()
    assert main(["run", str(container), "--session-in", str(saved), "--max-new", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def _archive(tmp_path: Path, kind: str) -> Path:
    """An archive np.load cannot read as a session: damaged deflate data, an encrypted member, a
    compression method zipfile lacks (Deflate64), a member that is not an .npy array, or metadata
    nested deeper than the JSON parser recurses; or a lone .npy array."""
    path = tmp_path / f"{kind}.npz"
    if kind == "npy":  # a --logits-out file given as --session-in
        path = tmp_path / "logits.npy"
        np.save(path, np.zeros((2, 3), np.float32))
        return path
    if kind == "deep-json":
        np.savez(path, meta=np.frombuffer(b"[" * 100_000 + b"]" * 100_000, np.uint8))
        return path
    if kind == "raw-member":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("meta", b"not an array")
        return path
    meta = np.frombuffer(json.dumps({"magic": "WASTE-SESSION", "version": 1}).encode(), np.uint8)
    np.savez_compressed(path, meta=meta)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        (info,) = z.infolist()
    local, central = info.header_offset, data.find(b"PK\x01\x02")
    if kind == "deflate-damaged":
        name_len, extra_len = (int.from_bytes(data[local + i:local + i + 2], "little") for i in (26, 28))
        data[local + 30 + name_len + extra_len] = 0xFF  # a deflate block of the reserved type 3
    elif kind == "encrypted":
        data[local + 6] |= 1
        data[central + 8] |= 1
    else:
        data[local + 8:local + 10] = data[central + 10:central + 12] = (9).to_bytes(2, "little")
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("kind", ["deflate-damaged", "encrypted", "deflate64", "raw-member", "deep-json", "npy"])
def test_foreign_and_damaged_archives_refused_in_one_line(tmp_path: Path, kind: str) -> None:
    """Whatever np.load makes of an archive, a session file it cannot read is a WasteError."""
    with pytest.raises(WasteError, match="session file"):
        read_session_file(_archive(tmp_path, kind))


def test_a_read_error_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO while a session is read says so (not just "damaged")."""
    path = tmp_path / "s.npz"
    np.savez(path, meta=np.zeros(3, np.uint8))

    class Failing(io.FileIO):
        def readinto(self, b):  # noqa: ANN001, ANN202 - io.FileIO's own signature
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(session_module, "_open_regular", lambda p: io.BufferedReader(Failing(p, "rb")))
    with pytest.raises(WasteError, match="Input/output error"):
        read_session_file(path)
