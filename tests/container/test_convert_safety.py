"""Convert and synth never lose data: refusing their own source, atomic no-replace, rollback, stale temps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from waste import fileio
from waste.cli import main
from waste.container import open_container
from waste.container.convert import convert
from waste.container.writer import ContainerWriter
from waste.errors import WasteError
from waste.testing import tiny_checkpoint, tiny_container


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tiny_container(tmp_path_factory))


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_convert_onto_its_own_source_refused(checkpoint: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    files = sorted(p.name for p in checkpoint.iterdir())
    for out in (checkpoint, checkpoint.parent):
        code = main(["convert", str(checkpoint), str(out), "--quant", "f32", "--quiet", "--force"])
        err = capsys.readouterr().err
        assert code == 2 and "is or contains the checkpoint" in err
    assert sorted(p.name for p in checkpoint.iterdir()) == files


def test_force_rolls_back_when_the_final_rename_fails(checkpoint: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    out = convert(checkpoint, tmp_path / "o.waste", quant="f32", progress=False)
    before = (out / "manifest.json").read_bytes()
    real = fileio._rename

    def fail_installing(src: Path, dst: Path) -> None:
        if Path(src).name.startswith(".o.waste.tmp-"):
            raise OSError(28, "No space left on device", str(dst))
        real(src, dst)

    monkeypatch.setattr(fileio, "_rename", fail_installing)
    with pytest.raises(OSError, match="No space left"):
        convert(checkpoint, out, quant="q8", force=True, progress=False)
    assert (out / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.waste"]
    open_container(out).close()


def test_exists_check_is_repeated_at_the_final_rename(checkpoint: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "new.waste"
    real_finish = ContainerWriter.finish

    def a_rival_finishes_first(self: ContainerWriter) -> Path:
        # Another convert to the same new path lands while this one is still writing.
        monkeypatch.setattr(ContainerWriter, "finish", real_finish)
        convert(checkpoint, out, quant="f32", progress=False)
        return real_finish(self)

    monkeypatch.setattr(ContainerWriter, "finish", a_rival_finishes_first)
    rival = None
    with pytest.raises(WasteError, match="exists; pass --force"):
        convert(checkpoint, out, quant="q8", progress=False)
    with open_container(out) as c:
        rival = c.scheme
    assert rival == "f32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.waste"]


def test_stale_temporaries_of_killed_runs_are_cleaned(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.waste"
    pid = _dead_pid()
    (tmp_path / f".o.waste.tmp-{pid}").mkdir()
    (tmp_path / f".o.waste.tmp-{pid}" / "trunk.bin").write_bytes(b"x")
    convert(checkpoint, out, quant="f32", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.waste"]
    # Killed between moving the old container aside and renaming the new one in: restored.
    out.rename(tmp_path / f".o.waste.old-{pid}")
    with pytest.raises(WasteError, match="exists; pass --force"):
        convert(checkpoint, out, quant="f32", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.waste"]
    open_container(out).close()


def test_a_file_too_large_for_the_file_system_leaves_nothing(checkpoint: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizing experts.bin can fail (EFBIG on FAT32, `ulimit -f`): one WasteError naming the file, and
    neither the temporary directory nor its open descriptors are left behind."""
    import errno
    import os

    real = os.ftruncate

    def too_large(fd: int, size: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("experts.bin"):
            raise OSError(errno.EFBIG, "File too large")
        real(fd, size)

    monkeypatch.setattr(os, "ftruncate", too_large)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(WasteError, match=r"o\.waste: cannot write experts\.bin: File too large"):
        convert(checkpoint, tmp_path / "o.waste", quant="f32", progress=False)
    assert list(tmp_path.iterdir()) == []
    assert len(os.listdir("/proc/self/fd")) == fds


@pytest.mark.parametrize("command", [
    ["synth", "tiny", "{out}"],
    ["synth", "tiny", "{out}.waste", "--quant", "q8", "--quiet"],
    ["convert", "{checkpoint}", "{out}.waste", "--quant", "q8", "--quiet"],
])
def test_an_output_the_disk_has_no_room_for_is_refused_before_writing(
        command: list[str], checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Free space below the output's size: one line naming both sizes, exit 2, nothing left behind
    (the files would otherwise be written until the disk filled, part-way through)."""
    import shutil

    out = tmp_path / "out"
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=4096))
    argv = [a.format(out=out, checkpoint=checkpoint) for a in command]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"waste: error: {out}") and "needs" in err and "4 KiB free" in err, err
    assert list(tmp_path.iterdir()) == []
