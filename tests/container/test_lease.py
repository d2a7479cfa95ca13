"""A container file truncated by another process during a run: one line (exit 2), never "Bus error"."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from waste.cli import main
from waste.container import open_container
from waste.container.lease import ContainerChanged
from waste.engine.experts import StreamingExpertStore
from waste.engine.model import Model
from waste.testing import tiny_container

LET_GO_SECONDS = 15  # milliseconds in practice; a writer held until lease-break-time waits 45 s


@pytest.fixture
def container(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    dst = tmp_path / "c.waste"
    shutil.copytree(tiny_container(tmp_path_factory, quant="q4"), dst)
    return dst


@pytest.mark.parametrize("name", ["experts.bin", "trunk.bin"])
def test_truncation_by_another_process_stops_the_run(container: Path, name: str) -> None:
    c = open_container(container)
    assert c.guarded == {"trunk.bin": True, "experts.bin": True}  # files this user owns, on ext4/tmpfs
    model = Model(c)  # the memory-mapped store: a truncation would be SIGBUS at the next touch
    session = model.new_session(4096)
    model.prefill(session, [1, 2, 3], all_logits=False)
    model.decode(session, 1)  # compiled before the clock starts: on a cold Numba cache that alone takes over 30 s
    # truncate(2) blocks in the kernel until this process lets go of its lease (lease.py).
    cutter = subprocess.Popen([sys.executable, "-c", f"import os; os.truncate({str(container / name)!r}, 0)"])
    try:
        with pytest.raises(ContainerChanged) as caught:
            deadline = time.monotonic() + 30
            token = 1
            while time.monotonic() < deadline:
                logits = model.decode(session, token)
                token = int(logits.argmax())
        assert str(container / name) in str(caught.value) and "\n" not in str(caught.value)
        # The lease went with the error: the truncation finishes while the container is still open,
        # instead of waiting for close() or the kernel's lease-break-time (45 s by default).
        assert cutter.wait(timeout=LET_GO_SECONDS) == 0
        assert os.path.getsize(container / name) == 0
        if name == "experts.bin":  # unguarded from now on: the size check before a first touch is back
            # An expert not touched yet (marked so: a slow run may have touched every one by now).
            c._expert_checked[-1, 0] = False
            with pytest.raises(ContainerChanged, match="truncated to 0 bytes while in use"):
                c.expert(c.config.moe_layers[-1], 0)
    finally:
        del model, session
        c.close()
        cutter.wait(timeout=60)


def test_truncation_without_a_lease_is_caught_before_the_first_touch(container: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no lease can be taken (another user's file, NFS), an expert first touched after the
    file was cut short is refused in one line instead of faulting."""
    from waste.container import lease

    monkeypatch.setattr(lease, "guard", lambda fd, path: False)
    with open_container(container) as c:
        assert c.guarded == {"trunk.bin": False, "experts.bin": False}
        layer = c.config.moe_layers[0]
        c.expert(layer, 0)
        os.truncate(container / "experts.bin", c.expert_span(layer, 1)[0])
        with pytest.raises(ContainerChanged, match="truncated to .* while in use"):
            c.expert(layer, 1)


def test_truncation_without_a_lease_is_caught_before_a_page_cache_read(container: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The streaming store reading into the page cache maps the blob before touching it: a file cut
    short is refused in one line there too."""
    from waste.container import lease

    monkeypatch.setattr(lease, "guard", lambda fd, path: False)
    with open_container(container) as c, StreamingExpertStore(c, 0, io="page-cache") as store:
        layer = c.config.moe_layers[0]
        store.get(layer, [0])
        os.truncate(container / "experts.bin", c.expert_span(layer, 1)[0])
        with pytest.raises(ContainerChanged, match="truncated to .* while in use"):
            store.get(layer, [1])


def test_cli_run_on_an_unchanged_container_is_unaffected(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(container), "--prompt-ids", "1,2,3", "--max-new", "2", "--expert-cache", "mmap"]) == 0
    assert "generated:" in capsys.readouterr().out


# Stands for Numba compiling a kernel: code running under a module named numba.* (lease.py).
FAKE_COMPILER = """
import time

def compile_until(done):
    while not done():
        time.sleep(0.001)
"""


def test_a_writer_arriving_while_a_kernel_compiles_stops_the_run_after_it(container: Path) -> None:
    from waste.container import lease

    compiler: dict[str, object] = {"__name__": "numba.core.fake_compiler"}
    exec(FAKE_COMPILER, compiler)
    c = open_container(container)
    fd = c.data_fds()[0]
    assert lease.held(fd)
    cutter = subprocess.Popen([sys.executable, "-c", f"import os; os.truncate({str(container / 'trunk.bin')!r}, 0)"])
    compiled = False
    try:
        with pytest.raises(ContainerChanged):
            # SIGIO comes while the "compiler" runs: no error inside it, the file stays as it was.
            compiler["compile_until"](lambda: lease._lease_broken(fd))  # type: ignore[operator]
            assert lease.held(fd) and os.path.getsize(container / "trunk.bin") > 0
            compiled = True
            time.sleep(LET_GO_SECONDS)  # the handler asks again 10 ms later and raises here
        assert compiled
        assert cutter.wait(timeout=LET_GO_SECONDS) == 0
    finally:
        c.close()
        cutter.wait(timeout=60)
