"""A fault on a memory-mapped container file: one line and exit code 2, never a bare "Bus error".

The reader maps trunk.bin and experts.bin. When such a file is truncated by another process
(where no read lease stops that first: `waste.container.lease`), or a page cannot be read
from storage, the next touch of the page raises SIGBUS, usually inside a Numba kernel that
holds no GIL, on whichever thread touched it (Numba's workers included). No Python code can
run then: a Python signal handler only sets a flag, and returning from a synchronous SIGBUS
repeats the faulting load forever. So the handler is native code that only calls
async-signal-safe functions. If the faulting address lies in a mapped container file, it
`write(2)`s one prepared line naming that file to stderr and `_exit(2)`s; threads that fault
at the same time wait in `pause()` for that exit, so the line comes once. Any other SIGBUS
(and one sent with kill) goes to the handler that was there before, as faulthandler does: it
restores that disposition and raises the signal again.

The handler is 40 lines of LLVM IR compiled by llvmlite (Numba's own backend, already a
dependency) once per process: `install` took 14 ms here with Numba loaded, 54 ms without
(llvmlite's import). It is not a kernel, so it is not compiled through `waste.jit`: a Numba
cfunc could be cached, but it would import Numba (~0.3 s) into `waste info` and `waste
verify`, which load no kernels otherwise, and the addresses of the tables below, which change
in every process, could not be constants in cached code. The tables are ctypes memory allocated at
import and never freed: up to `SLOTS` address ranges, each with its message.

Who installs it. The reader does, when it maps the first non-empty file of the process
(`watch`), for the command line and library users alike: a process that maps no container pays
nothing, one that does pays llvmlite's import and the compile once, and the process dies of a
fault on a container's map with a line naming the file rather than a bare "Bus error" (in a
notebook the kernel dies either way; the line goes to the kernel's log). Other faults reach the
handler found at install, so nothing else changes. The automatic install happens once per
process: a handler installed later keeps SIGBUS, even when more containers are opened; calling
`install()` takes it back. A host that handles SIGBUS itself calls `install_on_map(False)`
before opening a container; its maps are registered either way, so a later `install()` covers
them.

Limits: Linux on x86-64 and aarch64 only (the `struct sigaction` and `siginfo_t` layouts
below); elsewhere `install` returns False and nothing changes. A handler installed after
this one (`signal.signal(SIGBUS, ...)`, `faulthandler.enable()` later) comes first; calling
`install()` again takes SIGBUS back. Views of a map still used after `Container.close()` are
no longer registered. The message says what happened but not which tensor: a truncation and
a storage error give the same signal.
"""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line imports this module, which needs no NumPy of its own
    import numpy as np

SLOTS = 64  # mapped files registered at once (two per open container)
MESSAGE_BYTES = 1024  # per slot; one write(2) of at most PIPE_BUF bytes is never interleaved
_SA_SIGINFO = 0x4
_SA_ONSTACK = 0x08000000
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _Sigaction(ctypes.Structure):
    """glibc's struct sigaction on 64-bit Linux (x86-64 and aarch64 share it)."""

    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_uint64 * 16), ("flags", ctypes.c_int),
                ("restorer", ctypes.c_void_p)]


# slot i: [start, end, message length]; an empty slot has start == end == 0
_ranges = (ctypes.c_uint64 * (3 * SLOTS))()
_messages = ctypes.create_string_buffer(SLOTS * MESSAGE_BYTES)
_previous = _Sigaction()  # the disposition found at install, restored for a SIGBUS that is not ours
_reporting = ctypes.c_int(0)  # set by the first faulting thread: the others wait for its _exit(2)
_lock = threading.Lock()
_handler_address = 0
_engine: object = None  # llvmlite's execution engine owns the handler's code: kept for the process
_install_on_map = True  # install at the first map (`watch`): see "Who installs it"

# handler(sig, info, context): info->si_code at byte 8, info->si_addr at byte 16 (64-bit Linux)
_IR = """
declare i64 @write(i32, ptr, i64)
declare void @_exit(i32) noreturn
declare i32 @sigaction(i32, ptr, ptr)
declare i32 @raise(i32)
declare i32 @pause()

define void @waste_on_sigbus(i32 %sig, ptr %info, ptr %context) {{
entry:
  %code_at = getelementptr i8, ptr %info, i64 8
  %code = load i32, ptr %code_at
  %from_kernel = icmp sgt i32 %code, 0
  br i1 %from_kernel, label %scan, label %foreign
scan:
  %addr_at = getelementptr i8, ptr %info, i64 16
  %addr = load i64, ptr %addr_at
  br label %loop
loop:
  %i = phi i64 [0, %scan], [%next, %miss]
  %slot = mul i64 %i, 3
  %start_at = getelementptr i64, ptr inttoptr (i64 {ranges} to ptr), i64 %slot
  %start = load volatile i64, ptr %start_at
  %end_at = getelementptr i64, ptr %start_at, i64 1
  %end = load volatile i64, ptr %end_at
  %above = icmp uge i64 %addr, %start
  %below = icmp ult i64 %addr, %end
  %hit = and i1 %above, %below
  br i1 %hit, label %report, label %miss
miss:
  %next = add i64 %i, 1
  %more = icmp ult i64 %next, {slots}
  br i1 %more, label %loop, label %foreign
report:
  %before = atomicrmw xchg ptr inttoptr (i64 {reporting} to ptr), i32 1 seq_cst
  %first = icmp eq i32 %before, 0
  br i1 %first, label %say, label %wait
wait:
  %woken = call i32 @pause()
  br label %wait
say:
  %length_at = getelementptr i64, ptr %start_at, i64 2
  %length = load volatile i64, ptr %length_at
  %offset = mul i64 %i, {message_bytes}
  %message = getelementptr i8, ptr inttoptr (i64 {messages} to ptr), i64 %offset
  %written = call i64 @write(i32 2, ptr %message, i64 %length)
  call void @_exit(i32 2)
  unreachable
foreign:
  %restored = call i32 @sigaction(i32 %sig, ptr inttoptr (i64 {previous} to ptr), ptr null)
  %raised = call i32 @raise(i32 %sig)
  ret void
}}
"""


def supported() -> bool:
    """True where the handler can be installed (64-bit Linux on x86-64 or aarch64)."""
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64") and sys.maxsize > 2**32


def _compile() -> int:
    """The handler's address (compiled once per process)."""
    global _engine, _handler_address
    if not _handler_address:
        import llvmlite.binding as llvm

        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        module = llvm.parse_assembly(_IR.format(
            ranges=ctypes.addressof(_ranges), messages=ctypes.addressof(_messages),
            previous=ctypes.addressof(_previous), reporting=ctypes.addressof(_reporting), slots=SLOTS,
            message_bytes=MESSAGE_BYTES))
        module.verify()
        machine = llvm.Target.from_default_triple().create_target_machine()
        engine = llvm.create_mcjit_compiler(module, machine)
        engine.finalize_object()
        _engine = engine
        _handler_address = engine.get_function_address("waste_on_sigbus")
    return _handler_address


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sigaction.argtypes = [ctypes.c_int, ctypes.POINTER(_Sigaction), ctypes.POINTER(_Sigaction)]
    return libc


def installed() -> bool:
    """True while SIGBUS goes to this module's handler."""
    if not _handler_address:
        return False
    current = _Sigaction()
    _libc().sigaction(signal.SIGBUS, None, ctypes.byref(current))
    return current.handler == _handler_address


def install() -> bool:
    """Take SIGBUS for the whole process (see the module doc); False where that is not supported.

    Idempotent; called again after another handler took SIGBUS, it takes it back (and passes
    faults that are not a container's on to that handler)."""
    if not supported():
        return False
    with _lock:
        address = _compile()
        libc = _libc()
        current = _Sigaction()
        if libc.sigaction(signal.SIGBUS, None, ctypes.byref(current)) != 0:
            return False
        if current.handler == address:
            return True
        ours = _Sigaction()
        ours.handler = address
        ours.flags = _SA_SIGINFO | _SA_ONSTACK  # the alternate stack, where faulthandler set one up
        # `_previous` is what the handler restores: filled before the handler can run.
        ctypes.memmove(ctypes.addressof(_previous), ctypes.addressof(current), ctypes.sizeof(_Sigaction))
        if libc.sigaction(signal.SIGBUS, ctypes.byref(ours), None) != 0:
            return False
    return True


def install_on_map(enabled: bool = True) -> None:
    """Whether the first container map of the process installs the handler (the default). With
    `enabled` and a file already mapped, install now."""
    global _install_on_map
    _install_on_map = enabled
    if enabled and any(_ranges[3 * i + 1] for i in range(SLOTS)):
        install()


def _message(path: Path) -> bytes:
    text = (f"waste: error: {path}: a memory-mapped container file changed size or could not be read during the "
            "run (SIGBUS: truncated by another process, or a storage error); check it with 'waste verify'")
    line = os.fsencode(text.replace("\n", "?"))
    if len(line) > MESSAGE_BYTES - 1:
        line = line[:MESSAGE_BYTES - 5] + b"..."
    return line + b"\n"


def watch(mapped: np.ndarray, path: Path) -> int:
    """Register a memory-mapped file (the array over the whole map) under its path; a slot number for
    `unwatch`, or -1 when every slot is taken (that file then faults as before)."""
    start = mapped.__array_interface__["data"][0]
    end = start + -(-mapped.nbytes // _PAGE) * _PAGE
    line = _message(path)
    with _lock:
        for slot in range(SLOTS):
            if _ranges[3 * slot + 1] == 0:
                ctypes.memmove(ctypes.addressof(_messages) + slot * MESSAGE_BYTES, line, len(line))
                _ranges[3 * slot + 2] = len(line)
                _ranges[3 * slot] = start
                _ranges[3 * slot + 1] = end  # last: the slot counts once it is complete
                break
        else:
            return -1
    if _install_on_map and not _handler_address:
        install()
    return slot


def unwatch(slot: int) -> None:
    """Forget a registered map (before it is unmapped: its addresses may be reused)."""
    if slot >= 0:
        with _lock:
            _ranges[3 * slot + 1] = 0
            _ranges[3 * slot] = 0
