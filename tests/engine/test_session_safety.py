"""Resumed sessions: sampling options given on the command line win; hand-edited files are refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from waste.cli import main
from waste.container import open_container
from waste.engine.model import Model
from waste.engine.runner import generate
from waste.engine.sampling import Sampler
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
