"""Page-aligned read buffers for the streaming expert store: fresh ones populated by the map
call, evicted ones reused once nothing refers to them; and the positional read that fills one."""

from __future__ import annotations

import mmap
import os
import sys
import threading
from collections import deque

import numpy as np

from waste.errors import WasteError

# Pages of the map faulted in by the mmap call itself rather than one by one by the read: on
# this 2-core VM a fresh 4 MB blob buffer cost 8 ms of page faults, 2.8 ms populated (a 4 MB
# read takes about 4 ms), CPU time the reader threads take from the kernels.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


# Spare read buffers kept for reuse: a decode step misses a few experts per layer, and evicts as
# many. At most this many wait, fewer than the routed experts of one layer that the memory plan
# counts as working memory (`waste.engine.memory`), so they fit in the plan.
SPARE_BUFFERS = 16


class SpareBuffers:
    """Evicted read buffers, reused for reads of the same size once unreferenced.

    A fresh 4 MB buffer costs 2.8 ms of CPU to fault in even populated (see _POPULATE), most of
    what its read takes, and the reader threads take that CPU from the kernels. A buffer is reused
    only when nothing but this pool refers to its memory: every array over it (the cache entry's,
    the expert views handed out, their views) holds a reference to the map through the array
    `frombuffer` made, so the map's reference count tells. Buffers still referenced wait; past
    `limit` the oldest is dropped (freed when its last user lets go).
    """

    # References to a free map while `take` looks at it: the deque's, the loop variable's and
    # sys.getrefcount's own argument.
    FREE_REFS = 3

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
    size is a multiple of the page size, as container blobs are."""
    if nbytes <= 0:
        raise WasteError(f"expert blob size must be positive, got {nbytes}")
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0) | _POPULATE
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes), dtype=np.uint8)


def _os_pread_copy(fd: int, buffers: list[memoryview], offset: int) -> int:
    """preadv for platforms without it: one pread, then a copy."""
    data = os.pread(fd, len(buffers[0]), offset)
    buffers[0][: len(data)] = data
    return len(data)


# A module-level hook so tests can force the O_DIRECT fallback of a read.
_preadv = getattr(os, "preadv", _os_pread_copy)


def pread_into(fd: int, buf: np.ndarray, offset: int) -> None:
    """Fill `buf` from `offset`, one positional read (more only if the kernel returns short)."""
    view = memoryview(buf)
    done = 0
    while done < len(view):
        got = _preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise EOFError
        done += got
