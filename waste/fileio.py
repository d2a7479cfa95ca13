"""Files the tools write and read: atomic replacement, safe directory installs, bounded reads,
positional reads into buffers (`pread_into`).

Every output is written to a temporary name beside its destination and renamed into place
(`write_atomic` for files, `install_dir` for a container or checkpoint directory), so a
reader sees the old content or the new, never a mix, and a killed run leaves at most a
hidden `.NAME.tmp-PID[-RANDOM]` behind, which the next write to the same destination removes.

`check_output(path, kind, force)` is the overwrite policy of files, `check_output_dir` that of
directories (only an earlier output of the same kind or an empty directory is replaced), applied
before any work starts:
a new path is always fine; an existing file is replaced only with `--force`, or when it
already is an output of the same kind (a `.npy` where `--logits-out` writes one, a waste
session where `--session-out` writes one): rerunning a command must not need `--force`,
but nothing else (a container's manifest.json, a source file) is overwritten by mistake.
"""

from __future__ import annotations

import glob
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from waste.errors import WasteError
from waste.units import human_bytes

NPY_MAGIC = b"\x93NUMPY"  # the first bytes of every .npy file


def _umask() -> int:
    """The process's umask, read without changing it (os.umask would, for every thread at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def write_atomic(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Call write(f) on a temporary file beside `path` (`.NAME.tmp-PID-RANDOM`, which a later write
    to `path` removes if this process is killed), fsync it, rename it over `path`, then fsync the
    directory so the rename survives a crash. The file gets the mode a plain open would give it
    (mkstemp's is 0600, whatever the umask)."""
    path = Path(path)
    recover_stale(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """fsync a directory, so that a rename in it is on disk; best effort (some file systems refuse)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class NotRegularFile(OSError):
    """A FIFO, device or directory where a regular file was expected."""


def open_regular(path: str | Path, flags: int = os.O_RDONLY, *, dir_fd: int | None = None) -> int:
    """A descriptor of a regular file. O_NONBLOCK: a FIFO planted in its place must not block the
    open. Raises what os.open raises, or NotRegularFile."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegularFile(f"{path}: not a regular file")
    return fd


def read_bounded(path: str | Path, limit: int, what: str) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; FIFOs, devices and larger files are refused
    (a FIFO or /dev/zero would otherwise block or read without end)."""
    path = Path(path)
    try:
        fd = open_regular(path)
    except NotRegularFile:
        raise WasteError(f"{what} {path}: not a regular file") from None
    except OSError as e:
        raise WasteError(f"{what} {path}: {e.strerror}") from None
    st = os.fstat(fd)
    if st.st_size > limit:
        os.close(fd)
        raise WasteError(f"{what} {path}: {st.st_size} bytes, more than the {limit} this reads")
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise WasteError(f"{what} {path}: grew past {limit} bytes while being read")
    return data


def check_output(path: str | Path, what: str, force: bool, same_kind: Callable[[Path], bool]) -> Path:
    """Refuse an output path before any work: its directory must exist, and an existing entry
    must be a regular file that `--force` allows replacing or that `same_kind` recognises."""
    path = Path(path)
    if not path.parent.is_dir():
        raise WasteError(f"{what} {path}: directory {path.parent} does not exist")
    _probe_writable(path, what)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return path
    except OSError as e:
        raise WasteError(f"{what} {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise WasteError(f"{what} {path}: exists and is not a regular file")
    if not force and not same_kind(path):
        raise WasteError(f"{what} {path}: exists and is not an earlier {what} output; pass --force to replace it")
    return path


def _probe_writable(path: Path, what: str) -> None:
    """Create and remove a file beside `path`, as the output's temporary name will be: a directory
    the user cannot write, or a read-only file system, is refused before the work rather than
    after it (os.access says yes to root on a read-only mount)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.probe-", dir=path.parent)
    except OSError as e:
        raise WasteError(f"{what} {path}: cannot write in {path.parent}: {e.strerror}") from None
    os.close(fd)
    os.unlink(probe)


def file_starts_with(path: Path, magic: bytes) -> bool:
    """Whether the file's first bytes are `magic` (False if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(parent: Path, name: str, tag: str) -> list[Path]:
    """`.NAME.TAG-PID[-RANDOM]` entries beside a destination whose process no longer runs."""
    out = []
    prefix = f".{name}.{tag}-"
    for p in parent.glob(glob.escape(prefix) + "*"):
        pid = p.name[len(prefix):].split("-", 1)[0]
        if pid.isascii() and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            out.append(p)
    return out


def remove_tree(path: Path) -> None:
    """Remove a file or a directory tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def recover_stale(out: Path) -> None:
    """Clean up after runs killed while writing `out`: drop their temporary directories, and if one was
    killed between moving the old `out` aside and renaming the new one in, put the old one back."""
    for tmp in _stale(out.parent, out.name, "tmp"):
        remove_tree(tmp)
    for old in _stale(out.parent, out.name, "old"):
        if os.path.lexists(out):
            remove_tree(old)
        else:
            os.rename(old, out)


def temp_dir_for(out: Path) -> Path:
    """A fresh hidden working directory beside `out` (`.NAME.tmp-PID-RANDOM`: unique per writer)."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    except OSError as e:  # named as the output, not as the working directory it could not make
        raise WasteError(f"{out}: cannot write in {out.parent}: {e.strerror}") from None
    os.chmod(tmp, 0o777 & ~_umask())  # installed as the output: the mode mkdir would give, not mkdtemp's 0700
    return tmp


def check_free_space(out: Path, need: int, what: str) -> None:
    """Refuse before any work an output of `need` bytes (at least) that the file system holding
    its directory has no room for: a full disk found late costs the time spent until then."""
    try:
        free = shutil.disk_usage(out.parent).free
    except OSError:
        return  # the writes themselves will name the problem
    if need > free:
        raise WasteError(f"{out}: the {what} needs {human_bytes(need)} and {out.parent} has {human_bytes(free)} free")


def check_output_dir(out: Path, what: str, force: bool, same_kind: Callable[[Path], bool]) -> None:
    """The overwrite policy of a directory output (a container, a checkpoint), before any work:
    a new path is fine; an existing one needs `force`, and even then only an earlier output of
    the same kind (`same_kind`) or an empty directory is replaced: a mistyped OUT must not delete
    a directory of other files."""
    if not os.path.lexists(out):
        return
    if not force:
        raise WasteError(f"{out} exists; pass --force to replace it")
    a_dir = out.is_dir() and not out.is_symlink()
    if not (a_dir and (not any(out.iterdir()) or same_kind(out))):
        raise WasteError(f"{out} exists and is not a {what} nor an empty directory: not replaced, even with "
                         "--force; remove it yourself if that is what you mean")


# The steps of `install_dir`, named so a test can make one fail.
_rename = os.rename
_mkdir = os.mkdir


def install_dir(tmp: Path, out: Path, *, force: bool) -> None:
    """Rename the finished directory `tmp` to `out`.

    Without `force`, `out` must not exist, and that is decided atomically: the name is
    claimed with mkdir (which fails if anything holds it), then the rename replaces that
    empty directory, so two runs racing for one new path cannot both succeed. With
    `force`, the old `out` is first moved aside to `.NAME.old-PID`; if the install then
    fails, it is moved back, and only once the new one is in place is it deleted.
    """
    old = None
    if force and os.path.lexists(out):
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        remove_tree(old)
        _rename(out, old)
    try:
        try:
            _mkdir(out)
        except FileExistsError:
            raise WasteError(f"{out} exists; pass --force to replace it") from None
        try:
            _rename(tmp, out)
        except BaseException:
            os.rmdir(out)
            raise
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        remove_tree(old)


def _os_pread_copy(fd: int, buffers: list[memoryview], offset: int) -> int:
    """preadv for platforms without it: one pread, then a copy."""
    data = os.pread(fd, len(buffers[0]), offset)
    buffers[0][: len(data)] = data
    return len(data)


# A module-level hook so tests can force the O_DIRECT fallback of a read.
_preadv = getattr(os, "preadv", _os_pread_copy)


def pread_into(fd: int, buf: np.ndarray, offset: int) -> None:
    """Fill `buf` (a writable array) from `offset`, one positional read (more only if the kernel
    returns short); EOFError when the file ends first."""
    view = memoryview(buf)
    done = 0
    while done < len(view):
        got = _preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise EOFError
        done += got
