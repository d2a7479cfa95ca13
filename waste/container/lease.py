"""A container's mapped files changed by another process while in use: one line, not "Bus error".

The reader maps trunk.bin and experts.bin. If another process truncates one of them, the next
touch of a page past the new end raises SIGBUS inside NumPy or a Numba kernel, and Python dies
with a bare "Bus error": no Python code can run at that point. So the change is stopped before
it happens instead. The reader takes a Linux read lease (fcntl F_SETLEASE, F_RDLCK) on each
mapped file. A process that then opens the file for writing, or truncates it, blocks in the
kernel (up to /proc/sys/fs/lease-break-time, 45 s by default) while this process receives
SIGIO; the handler raises `ContainerChanged` (a WasteError: one line, exit code 2) in the main
thread, which stops the run before the file has changed. Closing the container, or the process
exiting, releases the lease, and the other process goes ahead (views of the maps still held
after `close()` are then unguarded).

What stays unguarded (`guard` returns False and the run behaves as before): a file this user
does not own (leases need ownership or CAP_LEASE), a file system without leases (NFS), a file
already open for writing somewhere, a container opened outside the main thread (only it runs
signal handlers), a process whose SIGIO already has another handler, and systems other than
Linux. And if the main thread stays inside one kernel call longer than lease-break-time, the
kernel breaks the lease anyway and a touch past the new end still dies with "Bus error".
"""

from __future__ import annotations

import fcntl
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from waste.container.format import ContainerError

_F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)  # Linux's values, for Pythons that lack the names
_F_GETLEASE = getattr(fcntl, "F_GETLEASE", 1025)
_guarded: dict[int, Path] = {}  # descriptor holding a lease -> the file's path


class ContainerChanged(ContainerError):
    """Another process opened a mapped container file for writing or truncated it."""


def _lease_broken(fd: int) -> bool:
    try:
        return fcntl.fcntl(fd, _F_GETLEASE) != fcntl.F_RDLCK
    except OSError:
        return True


def _on_sigio(signum: int, frame: FrameType | None) -> None:
    for fd, path in list(_guarded.items()):
        if _lease_broken(fd):
            raise ContainerChanged(f"{path}: another process opened it for writing or truncated it while this run "
                                   "used it; stopped before reading changed data")


def guard(fd: int, path: Path) -> bool:
    """Take a read lease on `fd` (a mapped container file); True when it is held (see the module doc)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return False
    handler: Any = signal.getsignal(signal.SIGIO)
    if handler not in (signal.SIG_DFL, _on_sigio):
        return False
    signal.signal(signal.SIGIO, _on_sigio)  # before the lease: SIGIO's default action ends the process
    try:
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
    except OSError:
        return False
    _guarded[fd] = path
    return True


def release(fd: int) -> None:
    """End `fd`'s lease. Explicitly: the memory map holds a duplicate of the descriptor (the same
    open file, which the lease belongs to) for as long as a view of it lives."""
    if _guarded.pop(fd, None) is not None:
        try:
            fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
        except OSError:
            pass  # broken and gone already
