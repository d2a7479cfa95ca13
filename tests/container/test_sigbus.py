"""A mapped container file truncated where no lease guards it: one line and exit 2, never "Bus error".

Each case runs in a child process (the handler ends the process) and truncates a file while the
child decodes, synchronised on the child's output, not on a guessed delay.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from waste import sigbus
from waste.testing import tiny_container

PROBLEM = "a memory-mapped container file changed size or could not be read during the run"


@pytest.fixture
def container(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    dst = tmp_path / "c.waste"
    shutil.copytree(tiny_container(tmp_path_factory, quant="q4"), dst)
    return dst


def _one_line(child: subprocess.Popen[bytes], path: Path) -> str:
    """The child's only stderr line, which names `path`, after it exited with code 2."""
    _, err = child.communicate(timeout=60)
    lines = err.decode(errors="replace").splitlines()
    assert child.returncode == 2, f"exit {child.returncode}, stderr: {lines}"
    assert len(lines) == 1 and lines[0].startswith("waste: error: ") and str(path) in lines[0], lines
    assert not any(w in lines[0] for w in ("Bus error", "Traceback", "Fatal Python error")), lines
    return lines[0]


def _run_and_cut(path: Path, options: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes],
                                                                                               bytes]:
    """`waste run` of path's container on "hello" with `options`, path cut to nothing once the
    reply's first byte is out (it decodes then) -> (the child, that byte). path is open for
    writing meanwhile, so no lease can be taken on it (lease.py)."""
    writer = os.open(path, os.O_WRONLY)
    try:
        child = subprocess.Popen([sys.executable, "-m", "waste.cli", "run", str(path.parent), "--prompt", "hello",
                                  *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        assert child.stdout is not None
        first = child.stdout.read(1)
        assert first, f"the run printed nothing: {child.communicate(timeout=60)[1].decode()}"
        os.ftruncate(writer, 0)
    finally:
        os.close(writer)
    return child, first


@pytest.mark.parametrize("faulthandler", [False, True], ids=["plain", "faulthandler-first"])
def test_cli_run_truncated_without_a_lease(container: Path, faulthandler: bool) -> None:
    """`waste run` on the memory-mapped store; experts.bin is open for writing here, so no lease
    can be taken on it (lease.py). The child streams the reply's text: its first byte means it
    decodes. A new expert's first touch is refused by the reader's size check (reader.py), one
    touched before faults: either way one line."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1" if faulthandler else ""}
    child, _ = _run_and_cut(container / "experts.bin", ["--max-new", "4000", "--expert-cache", "mmap"], env)
    line = _one_line(child, container / "experts.bin")
    assert PROBLEM in line or "while in use" in line, line


def test_cli_run_with_its_trunk_file_cut(container: Path) -> None:
    """The model copies the trunk into memory when it loads (Container.hold_trunk_in_memory), all
    but the embedding, whose rows it reads from trunk.bin as tokens come (Container.rows): trunk.bin
    cut to nothing while the run decodes is named in one line at the next token's read."""
    child, _ = _run_and_cut(container / "trunk.bin", ["--max-new", "4000", "--temperature", "0"])
    line = _one_line(child, container / "trunk.bin")
    assert "cut short" in line, line


LIBRARY_RUN = """
import sys, threading
from waste import sigbus
from waste.container import open_container
from waste.engine.model import Model

def decode():
    c = open_container(sys.argv[1])  # off the main thread: no lease is taken (lease.py)
    assert c.guarded == {"trunk.bin": False, "experts.bin": False}, c.guarded
    assert sigbus.installed()  # by the first map, without the library user asking
    model = Model(c)
    session = model.new_session(4096)
    logits = model.prefill(session, [1, 2, 3], all_logits=False)
    print("decoding", flush=True)
    for _ in range(4000):
        logits = model.decode(session, int(logits.argmax()))
    print("never cut", flush=True)

worker = threading.Thread(target=decode)
worker.start()
worker.join()
"""


def test_library_run_off_the_main_thread_truncated(container: Path, tmp_path: Path) -> None:
    """A library user who never calls sigbus.install(): opening the container installed it. (The
    experts' file: the trunk's is copied into memory when the model loads.)"""
    script = tmp_path / "decode.py"
    script.write_text(LIBRARY_RUN)
    child = subprocess.Popen([sys.executable, str(script), str(container)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line == b"decoding\n", child.communicate(timeout=60)[1].decode()
    os.truncate(container / "experts.bin", 0)
    line = _one_line(child, container / "experts.bin")
    assert line == (f"waste: error: {container / 'experts.bin'}: {PROBLEM} (SIGBUS: truncated by another process, "
                    "or a storage error); check it with 'waste verify'") or "while in use" in line, line


MANY_THREADS = """
import mmap, os, sys
import numpy as np
from pathlib import Path
from waste import sigbus
from waste.jit import parallel_kernel, prange

@parallel_kernel
def total(a):
    s = 0
    for i in prange(a.size):
        s += a[i]
    return s

path = Path(sys.argv[1])
path.write_bytes(bytes(1 << 22))
fd = os.open(path, os.O_RDONLY)
view = np.frombuffer(mmap.mmap(fd, 0, access=mmap.ACCESS_READ), np.uint8)
sigbus.watch(view, path)
assert sigbus.install()
total(view[:64])  # compiled before the cut
os.truncate(path, 4096)
print(total(view))  # each Numba worker faults in its share
"""


def test_faults_on_several_threads_give_one_line(tmp_path: Path) -> None:
    """Numba's workers fault (on 2 cores the first one's exit has always come before another's
    write here, so this cannot show that only one of two simultaneous faults writes)."""
    script = tmp_path / "threads.py"
    script.write_text(MANY_THREADS)
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path / "data.bin")], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env={**os.environ, "NUMBA_NUM_THREADS": "4"})
    assert PROBLEM in _one_line(child, tmp_path / "data.bin")


FOREIGN_FAULT = """
import mmap, os, sys
import numpy as np
from pathlib import Path
from waste import sigbus

path = Path(sys.argv[1])
path.write_bytes(bytes(8192))
fd = os.open(path, os.O_RDONLY)
view = np.frombuffer(mmap.mmap(fd, 0, access=mmap.ACCESS_READ), np.uint8)
assert sigbus.install()
os.truncate(path, 0)
print(int(view[5000]))  # a map that is not a container's: not this handler's business
"""


@pytest.mark.parametrize("faulthandler", [False, True], ids=["plain", "faulthandler-first"])
def test_a_fault_elsewhere_goes_to_the_previous_handler(tmp_path: Path, faulthandler: bool) -> None:
    script = tmp_path / "foreign.py"
    script.write_text(FOREIGN_FAULT)
    flags = ["-X", "faulthandler"] if faulthandler else []
    out = subprocess.run([sys.executable, *flags, str(script), str(tmp_path / "data.bin")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == -signal.SIGBUS, (out.returncode, out.stderr)
    assert PROBLEM not in out.stderr
    assert ("Fatal Python error: Bus error" in out.stderr) == faulthandler, out.stderr


def test_registered_maps_are_forgotten_on_close(container: Path) -> None:
    from waste.container import open_container

    def used() -> int:
        return sum(1 for slot in range(sigbus.SLOTS) if sigbus._ranges[3 * slot + 1])

    before = used()
    with open_container(container):
        assert used() == before + 2
    assert used() == before


OPTED_OUT = """
import signal, sys
from waste import sigbus
from waste.container import open_container

signal.signal(signal.SIGBUS, lambda *a: None)  # a host with a SIGBUS handler of its own
sigbus.install_on_map(False)
with open_container(sys.argv[1]) as c:
    assert not sigbus.installed()
    assert sigbus.install() and sigbus.installed()  # asked for: the maps already open are covered
    assert c._watched and all(slot >= 0 for slot in c._watched)
loaded = sorted(m for m in sys.modules if m == "numba" or m.startswith("numba."))
assert not loaded, loaded  # the handler is llvmlite's, not a Numba kernel
print("ok")
"""


def test_a_host_can_keep_sigbus(container: Path, tmp_path: Path) -> None:
    script = tmp_path / "host.py"
    script.write_text(OPTED_OUT)
    out = subprocess.run([sys.executable, str(script), str(container)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr
