"""The streaming store's cache (`waste.engine.experts`): expert blobs keyed by (layer, expert)
within a byte budget, evicted least recently used (LRU) or least frequently used (LFU, ties to
the least recent), the policies `waste.analysis.cache_sim` replays."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from waste.kernels.quant import QMatrix

POLICIES = ("lru", "lfu")
Expert = tuple[QMatrix, QMatrix, QMatrix]  # (w1 gate, w3 up, w2 down)


@dataclass
class Entry:
    expert: Expert
    buf: np.ndarray  # [nbytes] uint8, page-aligned; the decoded views point into it
    checking: Future[None] | None = None  # its CRC check until `verify_pending` saw it pass
    freq: int = 0
    tick: int = 0


class ExpertCache:
    """Entries keyed by (layer, expert) within a byte budget; LRU or LFU (ties to LRU).
    `on_evict(buf)` receives each evicted entry's buffer, and that of each entry too large to cache."""

    def __init__(self, budget_bytes: int, policy: str, on_evict: Callable[[np.ndarray], None] | None = None):
        self.budget = budget_bytes
        self.policy = policy
        self.on_evict = on_evict
        self.entries: OrderedDict[tuple[int, int], Entry] = OrderedDict()  # least recent first
        self.held = 0
        self._tick = 0
        self._heap: list[tuple[int, int, tuple[int, int]]] = []  # LFU: (freq, tick, key), lazily pruned

    def lookup(self, key: tuple[int, int]) -> Entry | None:
        return self.entries.get(key)

    def touch(self, key: tuple[int, int], entry: Entry) -> None:
        """Mark `key` used now, inserting `entry` if it is not cached."""
        self._tick += 1
        held = self.entries.get(key)
        if held is not None:
            held.freq += 1
            held.tick = self._tick
            self.entries.move_to_end(key)
            self._push(key, held)
            return
        nbytes = int(entry.buf.nbytes)
        if nbytes > self.budget:  # never cached: its buffer is let go as an evicted one is
            if self.on_evict is not None:
                self.on_evict(entry.buf)
            return
        while self.held + nbytes > self.budget:
            self._evict()
        entry.freq, entry.tick = 1, self._tick
        self.entries[key] = entry
        self.held += nbytes
        self._push(key, entry)

    def resize(self, budget_bytes: int) -> None:
        """Change the budget, evicting (by the policy) until the entries fit in it."""
        self.budget = budget_bytes
        while self.held > self.budget:
            self._evict()

    def make_room(self, nbytes: int, layers: set[int]) -> None:
        """Evict entries of `layers`, least recently used first, until `nbytes` more fit in the
        budget or none of theirs is left (LFU's heap skips what is gone, as after `discard`)."""
        for key in [k for k in self.entries if k[0] in layers]:
            if self.held + nbytes <= self.budget:
                return
            entry = self.entries.pop(key)
            self.held -= int(entry.buf.nbytes)
            if self.on_evict is not None:
                self.on_evict(entry.buf)

    def discard(self, key: tuple[int, int], entry: Entry) -> None:
        """Remove `key` if it holds `entry` (a blob that failed its check)."""
        if self.entries.get(key) is entry:
            del self.entries[key]
            self.held -= int(entry.buf.nbytes)
            if self.on_evict is not None:
                self.on_evict(entry.buf)

    def _push(self, key: tuple[int, int], entry: Entry) -> None:
        if self.policy != "lfu":
            return
        heapq.heappush(self._heap, (entry.freq, entry.tick, key))
        if len(self._heap) > 4 * len(self.entries) + 64:
            self._heap = [(e.freq, e.tick, k) for k, e in self.entries.items()]
            heapq.heapify(self._heap)

    def _evict(self) -> None:
        if self.policy == "lru":
            key, entry = self.entries.popitem(last=False)
        else:
            while True:
                freq, tick, key = heapq.heappop(self._heap)
                held = self.entries.get(key)
                if held is not None and held.freq == freq and held.tick == tick:
                    break
            entry = self.entries.pop(key)
        self.held -= int(entry.buf.nbytes)
        if self.on_evict is not None:
            self.on_evict(entry.buf)

    def clear(self) -> None:
        self.entries.clear()
        self._heap.clear()
        self.held = 0
