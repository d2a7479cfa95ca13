"""Where the streaming expert store reads blobs to: page-aligned anonymous buffers (fresh ones
faulted in by the read itself, evicted ones reused once nothing refers to them) filled by a
positional read, or the page cache under the container's own memory map (`PageCacheReads`)."""

from __future__ import annotations

import errno
import mmap
import os
import sys
import threading
from collections import deque
from typing import Any

import numpy as np

from waste.errors import WasteError


def _free_refs() -> int:
    """References a free map holds while `SpareBuffers.take` looks at it, counted the way `take`
    counts them: the deque's, the loop variable's and sys.getrefcount's own argument (3 on CPython
    3.11-3.13). Measured rather than written down, because newer interpreters may count borrowed
    references differently, and a figure too high would reuse a buffer still in use."""
    maps = deque([mmap.mmap(-1, mmap.PAGESIZE)])
    m = maps[0]
    return sys.getrefcount(m)


class SpareBuffers:
    """Evicted read buffers, reused for reads of the same size once unreferenced.

    A fresh 4 MB buffer costs 3-13 ms of CPU to fault in (see `aligned_buffer`), as much as its
    read takes or more, and the reader threads take that CPU from the kernels. A buffer is reused
    only when nothing but this pool refers to its memory: every array over it (the cache entry's,
    the expert views handed out, their views) holds a reference to the map through the array
    `frombuffer` made, so the map's reference count tells. Buffers still referenced wait; past
    `limit` the oldest is dropped (freed when its last user lets go).
    """

    FREE_REFS = _free_refs()

    def __init__(self, limit: int):
        self.limit = limit
        self.reused = 0
        self._maps: deque[mmap.mmap] = deque()
        self._lock = threading.Lock()

    def give(self, buf: np.ndarray) -> None:
        base = buf.base
        if not isinstance(base, memoryview) or not isinstance(base.obj, mmap.mmap):
            return
        with self._lock:
            self._maps.append(base.obj)
            if len(self._maps) > self.limit:
                self._maps.popleft()

    def take(self, nbytes: int) -> np.ndarray:
        """A page-aligned [nbytes] uint8 buffer: a spare one nobody refers to, else a new one."""
        with self._lock:
            for i in range(len(self._maps)):
                m = self._maps[i]
                if len(m) == nbytes and sys.getrefcount(m) <= self.FREE_REFS:
                    del self._maps[i]
                    self.reused += 1
                    return np.frombuffer(m, dtype=np.uint8)
        return aligned_buffer(nbytes)


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A writable [nbytes] uint8 buffer starting on a page boundary (O_DIRECT needs the
    address aligned); an anonymous map is page-aligned and wastes nothing when the blob
    size is a multiple of the page size, as container blobs are.

    Its pages are left to the read that fills it (an O_DIRECT read faults them in inside the
    kernel as it pins them). Populating them at the map call (MAP_POPULATE) was the default from
    2026-11-30 (a 2-core VM: a fresh 4 MB buffer 8 ms of faults one by one, 2.8 ms populated) to
    2026-12-03, when on the 2-core Zen 5 EPYC guest 3.2 GB read with O_DIRECT into fresh 3.75 MB
    buffers, three alternating rounds, cost 2.3-3.4 s of system CPU per GB populated against
    0.8-1.1 left to the read (9.7-12.9 s against 4.7-5.5 s of wall time); with huge pages
    (MADV_HUGEPAGE per buffer, or 2 MiB-aligned slabs of 16 buffers) 1.4-2.2; buffered reads
    from the page cache 0.7 against 0.8."""
    if nbytes <= 0:
        raise WasteError(f"expert blob size must be positive, got {nbytes}")
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes), dtype=np.uint8)


# madvise advice (Linux 5.14) that faults a range of a map in, reading what the page cache
# lacks, without touching the memory from user space; Python's mmap module does not name it.
MADV_POPULATE_READ = 22


class PageCacheReads:
    """Blobs read into the page cache and handed out as views of the container's memory map
    (the streaming store's io "page-cache").

    Each read brings in the blob's exact range: POSIX_FADV_WILLNEED, then MADV_POPULATE_READ (the
    fault's own read-ahead alone read twice the bytes of the blobs asked for). An evicted blob is
    only unmapped: its pages leave the process's RSS and stay in the page cache, which the kernel
    reclaims as it needs room. Dropping them from the page cache as well (POSIX_FADV_DONTNEED)
    was measured and not kept: on the 48B q4 container (2-core Firecracker VM, 2026-12-03) it
    decoded at 1.67 tok/s against 2.39 without the drop, its cold prefill 8.1 against 8.8 tok/s
    (freed memory goes back to the host; new memory costs this VM's CPUs 1-3 s per GB).

    A view stays correct whatever happens to its pages: they belong to experts.bin, so a page
    unmapped or reclaimed is read back on the next touch.
    """

    def __init__(self, container: Any):
        self._container = container
        self._fd = container.experts_fd
        self._populate = sys.platform.startswith("linux")
        self._start = container.experts_view(0, 0).ctypes.data  # the map's address: a view's offset

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        """The blob at [offset, offset + nbytes), its pages in the page cache and mapped."""
        view = self._container.experts_view(offset, nbytes)
        os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
        if self._populate:
            try:
                self._container.advise_experts(offset, nbytes, MADV_POPULATE_READ)
                return view
            except OSError as e:
                if e.errno == errno.EFAULT:  # pages past the file's end: truncated since the view was checked
                    self._container.experts_view(offset, nbytes)  # checks again and names the truncation
                if e.errno != errno.EINVAL:  # a kernel before 5.14 does not know the advice
                    raise
                self._populate = False
        int(view[:: mmap.PAGESIZE].max())  # a touch per page faults each in (reads what WILLNEED has not yet)
        return view

    def holds(self, buf: np.ndarray) -> bool:
        """Whether `buf` is a view of the container's map (an MXFP4 blob's repacked copy is not)."""
        return self._start <= buf.ctypes.data < self._start + len(self._container.experts_view(0, 0).base)

    def release(self, view: np.ndarray) -> None:
        """Unmap an evicted (or unused) blob's pages from this process; the page cache keeps them."""
        self._container.advise_experts(view.ctypes.data - self._start, view.nbytes, mmap.MADV_DONTNEED)
