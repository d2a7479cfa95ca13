"""A container's mapped files changed by another process while in use: one line, not "Bus error".

The reader maps trunk.bin and experts.bin. If another process truncates one of them, the next
touch of a page past the new end raises SIGBUS inside NumPy or a Numba kernel, where no Python
code can run; and if it rewrites the file in place, the run goes on with changed weights (the
trunk's CRCs are checked at open only). So the change is stopped before it happens. The reader
takes a Linux read lease (fcntl F_SETLEASE, F_RDLCK) on each mapped file. A process that then
opens the file for writing, or truncates it, blocks in the kernel while this process receives
SIGIO. The handler runs in the main thread between two Python instructions: no kernel is
running then (Numba's workers only run inside a call from it), so nothing has read the changed
file yet. It lets the broken lease go, and the writer goes ahead at once, then raises
`ContainerChanged` (a WasteError: one line, exit code 2), which stops the run. Unless the main
thread is inside Numba or llvmlite then (compiling or loading a kernel: an error raised in code
they call back is lost): the handler asks again 10 ms later, holding the lease meanwhile.

The lease was held until the container was closed before (2026-12-01): a writer waited until
this process let go of the container, up to the kernel's lease-break-time (45 s by default),
which a notebook that caught the error and kept the container open always reached. Measured
(truncate(2) during a decode of tiny q4, on a shared 2-core machine): against a decode that
caught the error and kept the container open, 46.2 and 46.9 s before, 3 and 28 ms now; against
`waste run`, which drops the container as the error unwinds, 8-12 ms before, under 1 ms now.
tests/container/test_lease.py holds a bound far below lease-break-time. Why keep the lease at all, now that
`waste.sigbus` turns a fault on a map into one line: an in-place rewrite causes no fault, the
lease names what happened before any byte changed, and it works in a process that keeps SIGBUS
for itself (`waste.sigbus.install_on_map(False)`).

What stays unguarded (`guard` returns False): a file this user does not own (leases need
ownership or CAP_LEASE), a file system without leases (NFS), a file already open for writing
somewhere, a container opened outside the main thread (only it runs signal handlers), a process
whose SIGIO already has another handler, and systems other than Linux. There a truncation
faults at the next touch (`waste.sigbus`: one line where the handler is installed) and the
reader checks experts.bin's size before each expert's first touch. While the main thread is
inside one long kernel call, the writer waits until the call returns (at most lease-break-time,
after which the kernel breaks the lease and the same holds as without one). After
`ContainerChanged`, close the container: what is still mapped is unguarded.
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
_COMPILERS = ("numba", "llvmlite")
_RETRY_SECONDS = 0.01


class ContainerChanged(ContainerError):
    """Another process opened a mapped container file for writing or truncated it."""


def _lease_broken(fd: int) -> bool:
    try:
        return fcntl.fcntl(fd, _F_GETLEASE) != fcntl.F_RDLCK
    except OSError:
        return True


def _inside_compiler(frame: FrameType | None) -> bool:
    """True when `frame` runs inside Numba or llvmlite (compiling or loading a kernel): Python code
    they call back from native code loses an error raised there (llvmlite then crashed with
    SIGSEGV when it happened), and errors raised while typing come out wrapped in Numba's own."""
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).split(".")[0] in _COMPILERS:
            return True
        frame = frame.f_back
    return False


def _on_sigio(signum: int, frame: FrameType | None) -> None:
    broken = [(fd, path) for fd, path in list(_guarded.items()) if _lease_broken(fd)]
    if broken and _inside_compiler(frame):
        # Ask again shortly, from outside: the lease stays held (the file unchanged) until then.
        retry = threading.Timer(_RETRY_SECONDS, signal.pthread_kill, (threading.main_thread().ident, signal.SIGIO))
        retry.daemon = True
        retry.start()
        return
    for fd, _ in broken:
        release(fd)  # the writer goes ahead now, not when the container is closed: this run stops here
    if broken:
        raise ContainerChanged(f"{broken[0][1]}: another process opened it for writing or truncated it while this "
                               "run used it; stopped before reading changed data")


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


def held(fd: int) -> bool:
    """True while `fd`'s lease guards its file (taken by `guard`, not yet broken or released)."""
    return fd in _guarded


def release(fd: int) -> None:
    """End `fd`'s lease. Explicitly: the memory map holds a duplicate of the descriptor (the same
    open file, which the lease belongs to) for as long as a view of it lives."""
    if _guarded.pop(fd, None) is not None:
        try:
            fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
        except OSError:
            pass  # broken and gone already
