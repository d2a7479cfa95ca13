"""waste.fileio: outputs get the modes a plain open or mkdir would give them under the umask."""

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
