"""The CRC checks of streamed expert blobs run after the blob is handed out (off the critical
path), and still stop the step: a damaged blob fails the run as a ContainerError naming
experts.bin (never a token, never a NaN in some layer), and never stays in the cache."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from waste.cli import main
from waste.container import open_container
from waste.container.format import ContainerError
from waste.container.reader import Container
from waste.engine.experts import MmapExpertStore, StreamingExpertStore
from waste.engine.model import Model
from waste.testing import tiny_container


@pytest.fixture
def container(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    """A fresh copy of the tiny f32 container that the test may damage."""
    dst = tmp_path / "c.waste"
    shutil.copytree(tiny_container(tmp_path_factory), dst)
    return dst


def _damage(container: Path, keys: list[tuple[int, int]] | None = None, *, nan: bool = False) -> None:
    """Flip one byte of each blob in `keys` (all of them when None), or with `nan` fill its w1 with NaN:
    the bytes the kernels then compute with make the layer's output NaN."""
    with open_container(container, verify=False) as c:
        ex = c._manifest.experts
        if keys is None:
            keys = [(layer, e) for layer in c.config.moe_layers for e in range(c.config.num_experts)]
        w1 = next(p for p in ex.parts if p.name == "w1")
        assert w1.storage == "f32"
        spans = [c.expert_span(layer, e)[0] for layer, e in keys]
    with open(container / "experts.bin", "r+b") as f:
        for offset in spans:
            if nan:
                f.seek(offset + w1.offset)
                f.write(np.full(w1.nbytes // 4, np.nan, np.float32).tobytes())
            else:
                f.seek(offset + 40)
                byte = f.read(1)[0]
                f.seek(offset + 40)
                f.write(bytes([byte ^ 0x04]))


class GatedCheck:
    """Replaces a container's check_expert: each check waits until `gate` opens, then runs the real one."""

    def __init__(self, c: Container):
        self.gate = threading.Event()
        self.finished: list[tuple[int, int]] = []
        self._check = c.check_expert
        c.check_expert = self  # type: ignore[method-assign]

    def __call__(self, layer: int, expert: int, blob: np.ndarray) -> None:
        assert self.gate.wait(30), "the gate was never opened"
        try:
            self._check(layer, expert, blob)
        finally:
            self.finished.append((layer, expert))


def _open_gate_later(check: GatedCheck, seconds: float = 0.2) -> threading.Timer:
    timer = threading.Timer(seconds, check.gate.set)
    timer.start()
    return timer


@pytest.mark.parametrize("ids", [[1, 5], [5]], ids=["pooled reads", "one read in the caller"])
def test_blob_handed_out_before_its_check_and_failure_raised_after(container: Path, ids: list[int]) -> None:
    with open_container(container) as c:
        layer = c.config.moe_layers[0]
    _damage(container, [(layer, 5)])
    with open_container(container) as c, StreamingExpertStore(c, 1 << 30, read_threads=2) as store:
        check = GatedCheck(c)
        handed = list(store.fetch(layer, ids))  # would wait forever if hand-out waited for the checks
        assert sorted(i for i, _ in handed) == list(range(len(ids))) and not check.finished
        timer = _open_gate_later(check)
        named = rf"experts.bin: CRC mismatch in model\.layers\.{layer}\.[a-z_.]*experts\.5\."
        with pytest.raises(ContainerError, match=named):
            store.verify_pending()
        timer.join()
        # The damaged blob is not kept as good; the sound one is.
        assert (layer, 5) not in store.cached_keys()
        assert ((layer, 1) in store.cached_keys()) == (1 in ids)
        store.verify_pending()  # the failure is reported once
        with pytest.raises(ContainerError, match="CRC mismatch"):
            store.get(layer, [5])  # read and checked again: still damaged
        assert (layer, 5) not in store.cached_keys()


def test_cached_blob_not_handed_out_again_before_its_check_passes(container: Path) -> None:
    with open_container(container) as c:
        layer = c.config.moe_layers[0]
    _damage(container, [(layer, 2)])
    with open_container(container) as c, StreamingExpertStore(c, 1 << 30, read_threads=2) as store:
        check = GatedCheck(c)
        list(store.fetch(layer, [2, 3]))
        assert (layer, 2) in store.cached_keys() and not check.finished  # cached while its check waits
        timer = _open_gate_later(check)
        # A caller that never called verify_pending asks again: the hit waits for its check.
        with pytest.raises(ContainerError, match="CRC mismatch"):
            store.fetch(layer, [2])
        timer.join()
        assert (layer, 2) not in store.cached_keys() and (layer, 3) in store.cached_keys()


def test_close_waits_for_running_checks(container: Path) -> None:
    with open_container(container) as c:
        layer = c.config.moe_layers[0]
        store = StreamingExpertStore(c, 1 << 30, read_threads=3)  # a thread for each read: checks wait
        check = GatedCheck(c)
        list(store.fetch(layer, [0, 4, 6]))
        timer = _open_gate_later(check)
        store.close()
        assert sorted(check.finished) == [(layer, 0), (layer, 4), (layer, 6)]
        timer.join()


@pytest.mark.parametrize("nan", [False, True], ids=["flipped byte", "NaN weights"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_step_fails_on_a_blob_used_before_its_check_finished(container: Path, nan: bool, phase: str) -> None:
    """The kernels compute with the damaged blobs while their checks are held back; the step still
    raises the CRC mismatch, before the NaN those blobs put in the MoE output is reported."""
    with open_container(container) as c, StreamingExpertStore(c, 1 << 30, read_threads=2) as store:
        # Also loads every kernel, prefill's and decode's, so the damaged run below computes at once
        # (on a cold Numba cache, compiling the decode kernels outlasted the held-back checks).
        model = Model(c, store=store)
        warm = model.new_session(8)
        model.prefill(warm, [1, 2, 3])
        model.decode(model.new_session(8), 5)
    tokens = list(warm.tokens) if phase == "decode" else []
    _damage(container, nan=nan)
    with open_container(container) as c, StreamingExpertStore(c, 0, read_threads=2) as store:
        model = Model(c, store=store)
        session = warm if phase == "decode" else model.new_session(8)
        check = GatedCheck(c)
        checks_done_at_use: list[int] = []  # how many checks had finished when each blob was handed out
        decode_expert = c.decode_expert

        def counted(layer: int, buf: np.ndarray):  # noqa: ANN202
            checks_done_at_use.append(len(check.finished))
            return decode_expert(layer, buf)

        c.decode_expert = counted  # type: ignore[method-assign]
        timer = _open_gate_later(check, 1.0)
        with pytest.raises(ContainerError, match="experts.bin: CRC mismatch"):
            if phase == "prefill":
                model.prefill(session, [1, 2, 3])
            else:
                model.decode(session, 7)
        timer.join()
        assert checks_done_at_use and checks_done_at_use[0] == 0  # used before any check had finished
        assert session.tokens == tokens


def test_cli_fails_on_nan_blobs_used_before_their_check(container: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _damage(container, nan=True)
    check = Container.check_expert

    def slow_check(self: Container, layer: int, expert: int, blob: np.ndarray) -> None:
        time.sleep(0.02)  # the MoE layer computes with the blob meanwhile
        check(self, layer, expert, blob)

    monkeypatch.setattr(Container, "check_expert", slow_check)
    run = ["run", str(container), "--prompt-ids", "1,2,3", "--max-new", "2", "--expert-cache", "1M",
           "--read-threads", "2"]
    code = main(run)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "experts.bin: CRC mismatch in model.layers." in err and "\n" not in err, err
    assert main([*run, "--no-verify"]) == 1  # unchecked, the NaN is what stops the run
    assert "NaN or infinite values first appeared in layer" in capsys.readouterr().err


def test_no_verify_checks_nothing(container: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _damage(container)

    def refuse(*args: object) -> None:
        raise AssertionError("checked with --no-verify")

    monkeypatch.setattr(Container, "check_expert", refuse)
    for store in (["--expert-cache", "1M", "--read-threads", "2"], ["--expert-cache", "0", "--read-threads", "1"], []):
        assert main(["run", str(container), "--prompt-ids", "1,2,3", "--max-new", "2", "--no-verify", *store]) == 0
    capsys.readouterr()


def test_mmap_store_never_keeps_a_damaged_expert(container: Path) -> None:
    with open_container(container) as c:
        layer = c.config.moe_layers[0]
    _damage(container, [(layer, 3)])
    with open_container(container) as c:
        store = MmapExpertStore(c)
        for _ in range(2):  # checked again on the second touch: a failed check marks nothing as good
            with pytest.raises(ContainerError, match=r"experts.bin: CRC mismatch"):
                store.get(layer, [0, 3])
        store.get(layer, [0, 1])
