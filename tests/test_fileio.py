"""waste.fileio: outputs get the modes a plain open or mkdir would give them under the umask; a
killed write leaves a temporary that the next write to the same path removes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from waste.fileio import temp_dir_for, write_atomic


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_outputs_follow_the_umask(tmp_path: Path, umask: int) -> None:
    before = os.umask(umask)
    try:
        out = tmp_path / "l.npy"
        write_atomic(out, lambda f: f.write(b"x"))
        directory = temp_dir_for(tmp_path / "c.waste")
    finally:
        os.umask(before)
    assert out.read_bytes() == b"x"
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(directory.stat().st_mode) == 0o777 & ~umask


def test_a_killed_writes_temporary_is_removed_by_the_next(tmp_path: Path) -> None:
    out = tmp_path / "s.npz"
    dead = _dead_pid()
    stale = tmp_path / f".s.npz.tmp-{dead}-abc123"  # what write_atomic leaves when killed mid-write
    stale.write_bytes(b"half")
    running = tmp_path / f".s.npz.tmp-{os.getpid()}-def456"  # this process's own: not stale
    running.write_bytes(b"mine")
    seen = []
    write_atomic(out, lambda f: seen.append(os.path.basename(os.readlink(f"/proc/self/fd/{f.fileno()}")))
                 or f.write(b"whole"))
    assert out.read_bytes() == b"whole" and not stale.exists() and running.exists()
    assert seen[0].startswith(f".s.npz.tmp-{os.getpid()}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, running.name])


def _dead_pid() -> int:
    """A process id no process holds now: a child that has been waited for."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid
