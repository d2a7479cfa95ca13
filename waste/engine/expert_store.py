"""What every expert store offers the MoE layers (`ExpertStore`, `Arrivals`), and the store that
reads nothing itself: views over the container's memory map (`MmapExpertStore`). The store that
reads from disk into a cache, and the semantics of fetch, read-ahead, guesses and checks that
both follow, are in `waste.engine.experts`."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np

from waste.engine.expert_cache import Expert
from waste.engine.expert_stats import ExpertStats
from waste.errors import WasteError


class Arrivals(Iterator[tuple[int, Expert]]):
    """What `fetch` returns: (index, expert) pairs in the order they become available, the first
    `ready` of them without waiting (a MoE layer computes those together)."""

    def __init__(self, pairs: Iterator[tuple[int, Expert]], ready: int):
        self._pairs = pairs
        self.ready = ready

    def __next__(self) -> tuple[int, Expert]:
        return next(self._pairs)

    def close(self) -> None:
        """Stop early: a store that reads cancels its queued reads and waits for the running ones."""
        close = getattr(self._pairs, "close", None)
        if close is not None:
            close()


class ExpertStore(ABC):
    """Hands out the routed experts of one container, layer by layer."""

    io_mode = "none"
    # Whether every expert stays where `get` first handed it out, for as long as the store is
    # open (a memory map): a MoE layer may then keep them in tables of its own and ask only
    # `count_request` (MmapExpertStore).
    maps_every_expert = False

    def __init__(self, container: Any):
        self.container = container
        self.stats = ExpertStats()
        self._last_hits = np.zeros(0, bool)
        self._num_experts = int(container.config.num_experts)
        self._moe_layers = frozenset(container.config.moe_layers)

    @abstractmethod
    def get(self, layer: int, expert_ids: Sequence[int]) -> list[Expert]:
        """The (w1, w3, w2) of each expert asked for, in the order asked."""

    def fetch(self, layer: int, expert_ids: Sequence[int]) -> Arrivals:
        """An iterator of (index into expert_ids, expert), one for every id asked for, in the order
        they become available; a store that reads from disk issues the reads at the call and hands
        out first its hits, then the experts it read ahead that have arrived (`ready` of them in
        all). Once exhausted, the counters and the cache are as
        `get` leaves them. The data checks of what it handed out may still be running: call
        `verify_pending` before using any result computed from them."""
        experts = self.get(layer, expert_ids)
        return Arrivals(enumerate(experts), len(experts))

    @abstractmethod
    def verify_pending(self) -> None:
        """Wait for the integrity checks of every expert handed out so far; raise the
        ContainerError of a blob that failed."""

    def read_ahead(self, layers: Sequence[int]) -> AbstractContextManager[None]:
        """Within the block, a store that reads from disk reads ahead the experts of the MoE layer
        after the one asked for, in the order `layers` gives (see `waste.engine.experts`); here, nothing."""
        return nullcontext()

    def prefilling(self) -> AbstractContextManager[None]:
        """Within the block a prompt is read: a store with a smaller cache budget for prefill
        passes keeps to it (see `waste.engine.experts`); here, nothing."""
        return nullcontext()

    @property
    def takes_guesses(self) -> bool:
        """Whether `guess` can help: False when every expert is at hand, so a decode step does not
        spend its time guessing."""
        return False

    def guess(self, layer: int, expert_ids: Sequence[int]) -> None:
        """The experts `layer` is expected to ask for next: a store that reads from disk reads the
        uncached ones ahead (see `waste.engine.experts`); here, nothing."""
        return None

    @property
    def last_hits(self) -> np.ndarray:
        """[n] bool: which ids of the last `get` were cache hits, parallel to the request."""
        return self._last_hits

    @abstractmethod
    def close(self) -> None:
        """Release files and threads; experts already handed out stay valid."""

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, layer: int, expert_ids: Sequence[int]) -> list[int]:
        if layer not in self._moe_layers:
            raise WasteError(f"expert store: layer {layer} is not a MoE layer")
        ids = [int(e) for e in expert_ids]
        if any(not 0 <= e < self._num_experts for e in ids):
            raise WasteError(f"expert store: expert ids {ids} outside 0..{self._num_experts - 1}")
        if len(set(ids)) != len(ids):
            raise WasteError(f"expert store: expert ids {ids} repeat within one request")
        return ids


class MmapExpertStore(ExpertStore):
    """No cache and no reads of its own: views over the container's memory map.

    Every lookup counts as a miss and its blob size is counted in `bytes_read` (what the
    page cache or the disk will serve when the views are touched); read time is not
    measured, since the map faults pages in lazily, so `read_seconds` stays 0.
    """

    io_mode = "mmap"

    def __init__(self, container: Any, *, advise_guesses: bool = False):
        """`advise_guesses`: pass the decode's guesses on to the kernel (worth it only when the
        experts do not all fit in the page cache; `waste run` maps them only when they fit)."""
        super().__init__(container)
        self.advise_guesses = advise_guesses
        # Views hold no memory of their own (they point into the map), so each expert's are
        # built once, on its first request (which checks its CRCs), instead of on every request
        # (17 us an expert, ~9% of a `mini` decode step): by layer, a list by expert id (None
        # until asked for), and the blobs' bytes.
        self._views: dict[int, list[Expert | None]] = {}
        self._blob_bytes: dict[int, np.ndarray] = {}  # int64 [experts]

    maps_every_expert = True

    def get(self, layer: int, expert_ids: Sequence[int]) -> list[Expert]:
        ids = self._check(layer, expert_ids)
        if layer not in self._views:
            self._views[layer] = [None] * self._num_experts
            self._blob_bytes[layer] = np.array([self.container.expert_span(layer, e)[1]
                                                for e in range(self._num_experts)], np.int64)
        views = self._views[layer]
        out = []
        for e in ids:
            view = views[e]
            if view is None:
                view = views[e] = self._open(layer, e)
            out.append(view)
        self.count_request(layer, ids)
        return out

    def _open(self, layer: int, expert: int) -> Expert:
        """The views of one expert, its CRCs checked."""
        return self.container.expert(layer, expert)

    def handed_out(self, layer: int, expert: int) -> Expert:
        """The view of an expert `get` has handed out before (without counting a request)."""
        view = self._views[layer][expert] if layer in self._views else None
        if view is None:
            raise WasteError(f"expert store: expert {expert} of layer {layer} was never handed out")
        return view

    def count_request(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Count a request of experts already handed out once, as `get` counts it (the views a
        caller kept stay valid while the container is open): a decode step that holds a layer's
        experts in its own tables asks the store only for this."""
        blob_bytes = self._blob_bytes[layer]
        st = self.stats.layer(layer)
        st.calls += 1
        st.requests += len(expert_ids)
        st.misses += len(expert_ids)
        st.bytes_read += int(blob_bytes[expert_ids].sum())
        self._last_hits = np.zeros(len(expert_ids), bool)

    @property
    def takes_guesses(self) -> bool:
        return self.advise_guesses

    def guess(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Asks the kernel to read the guessed blobs into the page cache now (POSIX_FADV_WILLNEED),
        where the map's page faults find them when the layer asks; nothing is counted."""
        fd = self.container.experts_fd
        for e in self._check(layer, expert_ids):
            offset, nbytes = self.container.expert_span(layer, e)
            try:
                os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
            except OSError:
                return  # advice only: a file system that refuses it reads on the faults, as before

    def verify_pending(self) -> None:
        """Nothing pending: the container checks each expert's CRCs when `get` first touches it."""

    def close(self) -> None:
        """Nothing to release: the container owns the map."""


class PooledExpertStore(MmapExpertStore):
    """Every expert of a MoE layer served by one of that layer's first `pool` experts (expert e by
    expert e mod pool): a decode step's arithmetic and memory traffic with every expert it asks for
    in RAM, on a machine that cannot hold them all. For timing what a step computes
    (`waste.analysis.compute`); the outputs are not the model's.

    Requests are counted as the map counts them (misses of the ids asked for); nothing is read
    beyond the pool's blobs. It takes a decode step's guesses, as a streaming store does (so the
    step routes them too), and counts those its layer then did not ask for (`unused_guesses`):
    a streaming store reads such an expert for nothing when it is not cached."""

    def __init__(self, container: Any, pool: int):
        super().__init__(container)
        if pool < 1:
            raise WasteError(f"expert pool of {pool}: expected at least one expert a layer")
        self.pool = min(int(pool), self._num_experts)
        self._slots: dict[int, list[Expert | None]] = {}
        self._guessed: dict[int, set[int]] = {}  # by layer: the experts guessed since its last request
        self.guesses = 0  # distinct experts guessed for a layer before it asked, over all requests
        self.unused_guesses = 0  # of those, the ones the layer did not ask for

    @property
    def takes_guesses(self) -> bool:
        return True

    def guess(self, layer: int, expert_ids: Sequence[int]) -> None:
        self._guessed.setdefault(layer, set()).update(self._check(layer, expert_ids))

    def count_request(self, layer: int, expert_ids: Sequence[int]) -> None:
        guessed = self._guessed.pop(layer, set())
        self.guesses += len(guessed)
        self.unused_guesses += len(guessed.difference(int(e) for e in expert_ids))
        super().count_request(layer, expert_ids)

    def _open(self, layer: int, expert: int) -> Expert:
        slots = self._slots.setdefault(layer, [None] * self.pool)
        slot = expert % self.pool
        if slots[slot] is None:
            slots[slot] = super()._open(layer, slot)
        return slots[slot]
