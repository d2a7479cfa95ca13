"""Routed expert weights for the MoE layers: served from the container's memory map, or
streamed from experts.bin with positional reads into a cache with a byte budget.

The MoE layer asks for the unique expert ids of one step (a prefill chunk or a decode
token), sorted, with one `get` per layer per step. A streaming store answers in two
phases whose semantics docs/TRACE.md fixes and `waste.analysis.cache_sim` replays exactly:

1. lookup: every id is looked up; the outcome (hit or miss) is decided for all ids before
   anything changes. Misses are read, one read per blob (`io`: `waste.expert_io`), issued in
   disk-offset order and spread over a small thread pool, then decoded.
2. touch, in the order asked: a cached id is marked used (LRU: most recent; LFU: count + 1
   and most recent); an id not cached is inserted, evicting least-recently-used entries
   (LFU: lowest count, ties to the least recent) until it fits. A blob larger than the
   whole budget is never cached, so a budget of 0 caches nothing.

`fetch` is `get` for a caller that computes while the misses arrive: it hands out the hits
at once, then the misses read ahead whose reads have finished (`Arrivals.ready` counts both),
then each other miss as soon as its read finishes, and runs the touch phase when the last one
has been handed out, so the cache ends in the state `get` leaves.

Read-ahead (`read_ahead`, for a prefill pass long enough that every expert of every MoE layer
will be routed): while one layer's request is served, the next layer's uncached experts are
read as well, so the disk keeps reading while the next layer's attention and routing compute.
They are read only into room the budget has beyond the cache's entries and the reads under way,
evict nothing, and count as misses when asked for, so hits, evictions and the cache's final
state are those of a run without it; a blob read ahead and not asked for is dropped (its bytes
count as read, and as `unused_bytes`).

Guesses (`guess`, for decode): a decode step cannot know a MoE layer's experts before that
layer routes, so each miss would cost a read's latency inside the step. The model guesses the
experts of the next GUESS_LAYERS MoE layers from the current residual stream
(`waste.engine.model`) and the store reads the uncached ones ahead, exactly as a read-ahead:
nothing is evicted, a guessed blob asked for counts as a miss whose read was issued early
(`ahead_used`), the others are dropped when their layer asks. Guesses may also use room beyond
the budget: GUESS_LAYERS + 1 times the bytes of one guess, the working memory of a decode step
(its own misses under way and the guesses of the layers after it), which the memory plan counts
(`waste.engine.memory`). The memory-mapped store passes a guess on to the kernel
(POSIX_FADV_WILLNEED), which reads the blobs into the page cache for the map's faults.

Integrity (issue 14): each blob read is checked against its CRC32C, in the reader thread right
after the read (a blob read ahead: once its layer asks for it, so a wrong guess is never checked),
but off the critical path: `fetch` hands the blob out as soon as its read
finishes and the check runs meanwhile. The caller waits for the checks with `verify_pending`
before it gives out anything computed from the blobs (the model does at the end of every step,
and before it reports any other error of the step), which
raises the ContainerError of a blob that failed and drops that blob from the cache. A cached
blob whose check has not finished is never handed out again before it passes: `fetch` waits for
it first. `get` returns checked experts only. With one read thread (no pool) the check runs in
the caller, before the blob is handed out.

MXFP4 experts (K3) are checked as soon as they are read, read ahead or not, and then repacked
into the kernels' interleave in a buffer of the blob's size, whose views the products read; the
blob's own buffer goes back to the spares. Left as stored, a cached expert would be held twice
(the blob and the copy its products read) and the model's thread would repack every miss.

Two budgets (`prefilling`): a prefill pass holds a whole MoE layer's routed experts besides the
cache, a decode step only a few, so a store may be given a smaller `prefill_budget_bytes` for
the duration of a prompt: entering `prefilling` evicts down to it (by the policy), leaving it
lets the cache grow back to `budget_bytes` as the decode reads. The memory plan sizes both
(`waste.engine.memory`). Within a prompt and within a decode the cache behaves as above with
the budget in force; a routing trace replayed at one capacity (`waste.analysis.cache_sim`)
matches a run with one budget.

The cache (`waste.engine.expert_cache`) charges each entry its blob's size in experts.bin
(padding included), the size of the buffer the decoded views live in; the charge never exceeds
the budget. Experts handed out stay valid after eviction: they hold their own buffer, read into
again (`waste.engine.read_buffers`) only once nothing refers to it; or, read into the page cache
(io "page-cache"), they are views of the container's map, whose unmapped pages the kernel reads
back from experts.bin if they are touched again.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

import numpy as np

from waste.container.format import EXPERTS
from waste.engine.expert_cache import POLICIES, Entry, ExpertCache
from waste.engine.expert_store import Arrivals, Expert, ExpertStore, MmapExpertStore
from waste.engine.read_buffers import PageCacheReads, SpareBuffers
from waste.errors import WasteError
from waste.expert_io import DEFAULT_IO, IO_MODES
from waste.fileio import pread_into

# The fewest evicted read buffers kept for reuse (`StreamingExpertStore`): a decode step's
# misses and dropped guesses of a layer.
SPARE_BUFFERS = 16
# MoE layers a decode step guesses ahead. On the 48B q4 container from disk (2026-12-01, Xeon,
# 18 GiB cache, 1.9 GB/s disk) a steady decode step took 259-298 ms unguessed, 253 guessing
# one layer ahead, 199 two and 204 three (85-88% of the misses guessed at each depth).
GUESS_LAYERS = 2
# The names of the reader threads (Python numbers them: waste-expert-read_0, ...), by which a
# benchmark tells their CPU time from the model's.
READER_THREAD_PREFIX = "waste-expert-read"


class StreamingExpertStore(ExpertStore):
    """Reads missing experts from experts.bin into a cache of `budget_bytes` (see module doc).

    `io` is one of IO_MODES; `io_mode` is what is in use: "direct" falls back to "buffered", and
    `io_note` says why (open refused, or a read returned EINVAL).
    """

    def __init__(
        self,
        container: Any,
        budget_bytes: int,
        policy: str = "lru",
        read_threads: int = 4,
        io: str = DEFAULT_IO,
        prefill_budget_bytes: int | None = None,
    ):
        super().__init__(container)
        if io not in IO_MODES:
            raise WasteError(f"expert io {io!r}: expected one of {', '.join(IO_MODES)}")
        if budget_bytes < 0:
            raise WasteError(f"expert cache budget must not be negative, got {budget_bytes}")
        if policy not in POLICIES:
            raise WasteError(f"expert cache policy {policy!r}: expected one of {', '.join(POLICIES)}")
        if read_threads < 1:
            raise WasteError(f"read threads must be at least 1, got {read_threads}")
        self.budget_bytes = int(budget_bytes)
        self.prefill_budget_bytes = self.budget_bytes if prefill_budget_bytes is None else int(prefill_budget_bytes)
        if not 0 <= self.prefill_budget_bytes <= self.budget_bytes:
            raise WasteError(f"prefill cache budget {self.prefill_budget_bytes} must be between 0 and the cache "
                             f"budget {self.budget_bytes}")
        self.policy = policy
        self.read_threads = int(read_threads)
        self.io_note = ""
        self._path = container.experts_path
        self._expert_bytes = sum(int(container.expert_span(layer, e)[1]) for layer in self._moe_layers
                                 for e in range(self._num_experts))
        self._verify = bool(container.verify_data)
        # MXFP4 blobs are checked and repacked for the kernels as they arrive (`_interleaved`).
        self._interleave = bool(container.experts_interleaved_when_read)
        # Evicted buffers wait for reuse, as many as two layers have experts: a prefill pass's touch
        # phase evicts as many blobs as it inserts, up to a whole layer's, after its reads took as
        # many buffers, and once the cache is full its read-ahead makes room at once for the layer
        # being read and the next one's reads (`_read_layer_ahead`). Kept, they serve the next
        # reads; 16 kept (until 2026-12-03) let the rest go, and the next layer faulted in fresh
        # ones (a `mini` prefill at half the experts cached: 400 fresh buffers for 448 reads into
        # a cache of 224). The spares beyond the reads ahead that take them are at most a layer's
        # experts, which the memory plan counts as a prefill's working memory.
        self._spare = SpareBuffers(max(SPARE_BUFFERS, 2 * self._num_experts))
        self._page_cache = PageCacheReads(container) if io == "page-cache" else None
        self._cache = ExpertCache(self.budget_bytes, policy, self._evicted)
        self._lock = threading.Lock()
        # (layer, expert, its entry, its check) of blobs handed out whose checks nobody waited for yet
        self._pending: list[tuple[int, int, Entry | None, Future[None]]] = []
        # Read-ahead (see the module doc): the MoE layers of the pass in order, the reads issued
        # ahead ((layer, expert) -> (blob arrived, read-then-check task, bytes)) and their (start,
        # end) times by layer; the bytes of a request's misses until its touch phase inserts them.
        self._schedule: list[int] = []
        self._ahead: dict[tuple[int, int], tuple[Future[np.ndarray], Future[None], int]] = {}
        self._ahead_times: dict[int, list[tuple[float, float]]] = {}
        self._ahead_bytes = 0
        self._ahead_peak = 0
        self._missing_bytes = 0
        self._retired_fds: list[int] = []
        self._fd: int | None = self._open(io == "direct")
        if self._page_cache is not None:
            self.io_mode = "page-cache"
        self._pool = ThreadPoolExecutor(self.read_threads, READER_THREAD_PREFIX) if self.read_threads > 1 else None

    @property
    def cached_bytes(self) -> int:
        """Bytes the cache holds now (the sum of its entries' blob sizes)."""
        return self._cache.held

    def cached_keys(self) -> list[tuple[int, int]]:
        """(layer, expert) of every cached entry, least recently used first."""
        return list(self._cache.entries)

    def get(self, layer: int, expert_ids: Sequence[int]) -> list[Expert]:
        out: list[Expert | None] = [None] * len(expert_ids)
        for i, expert in self.fetch(layer, expert_ids):
            out[i] = expert
        self.verify_pending()
        return out  # type: ignore[return-value]

    def fetch(self, layer: int, expert_ids: Sequence[int]) -> Arrivals:
        if self._fd is None:
            raise WasteError("expert store is closed")
        ids = self._check(layer, expert_ids)
        self._forget_passed()
        looked_up = [self._cache.lookup((layer, e)) for e in ids]
        if any(entry is not None and entry.checking is not None for entry in looked_up):
            self.verify_pending()  # a hit whose check still runs or failed (the caller did not wait)
        hits = np.array([f is not None for f in looked_up], bool)
        found: dict[int, Entry] = {i: f for i, f in enumerate(looked_up) if f is not None}
        missing = [i for i, f in enumerate(looked_up) if f is None]
        self._last_hits = hits
        st = self.stats.layer(layer)
        spans = {i: self.container.expert_span(layer, ids[i]) for i in missing}
        # Disk-offset order: the pool takes work first in, first out.
        order = sorted(missing, key=lambda i: spans[i][0])
        # (start, end) of every read of this request; reads issued ahead fill theirs in already.
        times = self._ahead_times.pop(layer, [])
        checks: dict[int, Future[None]] = {}  # index -> its blob's check, running in a reader thread
        queued: list[Future[None]] = []  # tasks that read, then check: cancelled before their read if the caller stops
        ahead = {i: self._ahead.pop((layer, ids[i])) for i in order if (layer, ids[i]) in self._ahead}
        st.ahead_used += len(ahead)
        self._drop_ahead([key for key in self._ahead if key[0] == layer])  # read ahead, not asked for
        self._ahead_bytes -= sum(nbytes for *_, nbytes in ahead.values())
        missing_bytes = sum(spans[i][1] for i in missing)
        self._missing_bytes += missing_bytes

        # The reads are issued now, before the caller computes with the hits.
        if self._pool is not None and (len(order) > 1 or ahead):
            read: dict[Future[np.ndarray], int] = {}
            for i in order:
                if i in ahead:
                    arrived, task, _ = ahead[i]
                    checks[i] = (self._check_when_read(layer, ids[i], task, arrived)
                                 if self._verify and not self._interleave else task)
                else:
                    arrived = Future()
                    task = checks[i] = self._pool.submit(self._read_then_check, layer, ids[i], *spans[i], times,
                                                         arrived)
                queued.append(task)
                read[arrived] = i
            arrivals: Iterator[tuple[int, np.ndarray]] = _as_completed(read)
            # Blobs read ahead that have arrived come out of _as_completed first, without waiting:
            # ready with the hits, so the MoE layer computes them in one call with those.
            arrived_already = sum(f.done() for f in read)
        else:
            arrivals = ((i, self._read_inline(layer, ids[i], *spans[i], times, checks, i)) for i in order)
            arrived_already = 0
        self._read_next(layer)

        def hand_out() -> Iterator[tuple[int, Expert]]:
            complete = False
            try:
                for i in sorted(found):
                    yield i, found[i].expert
                for i, buf in arrivals:
                    found[i] = Entry(self.container.decode_expert(layer, buf), buf, checking=checks.get(i))
                    st.bytes_read += int(buf.nbytes)
                    yield i, found[i].expert
                complete = True
            finally:
                if not complete:
                    # A caller that stops early (an error) leaves no read running into its buffers;
                    # the checks of blobs handed out still count.
                    for f in queued:
                        f.cancel()
                    wait(list(checks.values()))
                self._pending.extend((layer, ids[i], found.get(i), f) for i, f in checks.items() if not f.cancelled())
                self._missing_bytes -= missing_bytes
            if order:
                st.read_seconds += max(end for _, end in times) - min(start for start, _ in times)
            for i, e in enumerate(ids):
                self._cache.touch((layer, e), found[i])
            st.calls += 1
            st.requests += len(ids)
            st.hits += int(hits.sum())
            st.misses += len(missing)

        return Arrivals(hand_out(), len(found) + arrived_already)

    @contextmanager
    def read_ahead(self, layers: Sequence[int]) -> Iterator[None]:
        """Within the block, while MoE layer `layers[i]` is asked for, the uncached experts of
        `layers[i + 1]` are read ahead (those of `layers[0]` at once), into the room the budget has
        beyond the cache's entries and the reads under way (see the module doc). Needs reader
        threads (`read_threads` > 1). What was read ahead and not asked for is dropped at the end."""
        self._schedule = [int(layer) for layer in layers]
        try:
            if self._schedule:
                self._read_layer_ahead(self._schedule[0])
            yield
        finally:
            self._schedule = []
            self._drop_ahead(list(self._ahead))
            self._ahead_times.clear()

    @contextmanager
    def prefilling(self) -> Iterator[None]:
        """Within the block (a prompt being read) the cache holds at most `prefill_budget_bytes`:
        entering evicts down to it; leaving restores `budget_bytes`, which the decode then fills."""
        self._cache.resize(self.prefill_budget_bytes)
        try:
            yield
        finally:
            self._cache.resize(self.budget_bytes)

    @property
    def read_ahead_peak(self) -> int:
        """The most bytes the cache's entries, the reads under way and the reads ahead took together
        just after a read ahead was issued (never more than the budget)."""
        return self._ahead_peak

    def _read_next(self, layer: int) -> None:
        """Read ahead the layer after `layer` in the read-ahead schedule, if any."""
        if layer in self._schedule:
            at = self._schedule.index(layer)
            if at + 1 < len(self._schedule):
                self._read_layer_ahead(self._schedule[at + 1])

    def _read_layer_ahead(self, layer: int) -> None:
        """Issue reads (and checks) of `layer`'s uncached experts, in disk order, while the budget
        has room beyond the cache's entries, the reads under way and those already ahead.

        A pass asks for each layer once, so the entries of the layers it has passed (before the
        one being asked for) first make way for these, least recently used first, as the cache
        would evict them when these were asked for: once a prompt's first layers had filled the
        cache, its last layers were read on demand, their reads no longer under the compute (on
        the 48B q4, the last 7 of 26 layers)."""
        at = self._schedule.index(layer) if layer in self._schedule else 0
        passed = set(self._schedule[:max(0, at - 1)])
        if passed:
            wanted = sum(self.container.expert_span(layer, e)[1] for e in range(self._num_experts)
                         if self._cache.lookup((layer, e)) is None and (layer, e) not in self._ahead)
            self._cache.make_room(wanted + self._missing_bytes + self._ahead_bytes, passed)
        if self._issue_ahead(layer, range(self._num_experts), 0):
            self._ahead_peak = max(self._ahead_peak, self._cache.held + self._missing_bytes + self._ahead_bytes)

    @property
    def takes_guesses(self) -> bool:
        """With reader threads and a budget smaller than the experts (once they all fit, the
        cache, warm, misses nothing)."""
        return self._pool is not None and self.budget_bytes < self._expert_bytes

    def guess(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Read ahead the uncached ones of `expert_ids`, which `layer` is expected to ask for (see
        the module doc), into the budget's free room plus GUESS_LAYERS + 1 times the bytes guessed,
        less the reads under way and those already ahead. Needs reader threads."""
        if self._fd is None:
            raise WasteError("expert store is closed")
        ids = self._check(layer, expert_ids)
        guessed = sum(self.container.expert_span(layer, e)[1] for e in ids)
        self._issue_ahead(layer, ids, (GUESS_LAYERS + 1) * guessed)

    def _issue_ahead(self, layer: int, expert_ids: Iterable[int], beyond_budget: int) -> bool:
        """Issue reads (and checks) of the uncached ones of `expert_ids`, in disk order, while they
        fit in the budget's room beyond the cache's entries, the reads under way and those already
        ahead, plus `beyond_budget` bytes; whether any was issued."""
        if self._pool is None:
            return False
        room = (max(0, self._cache.budget - self._cache.held) + beyond_budget - self._missing_bytes
                - self._ahead_bytes)
        spans = sorted((self.container.expert_span(layer, e), e) for e in expert_ids
                       if self._cache.lookup((layer, e)) is None and (layer, e) not in self._ahead)
        times = self._ahead_times.setdefault(layer, [])
        issued = False
        for (offset, nbytes), e in spans:
            if nbytes > room:
                break
            room -= nbytes
            arrived: Future[np.ndarray] = Future()
            # Read only: the check waits until the layer asks for the blob (`_check_when_read`).
            task = self._pool.submit(self._read_then_check, layer, e, offset, nbytes, times, arrived, False)
            self._ahead[(layer, e)] = (arrived, task, nbytes)
            self._ahead_bytes += nbytes
            issued = True
        return issued

    def _drop_ahead(self, keys: list[tuple[int, int]]) -> None:
        """Forget reads issued ahead: cancel those not started; the others, counted as read and
        unused, give their buffers to the spares once they finish (without waiting for them: a
        wrong guess still being read must not hold up the step). They are never checked: nothing
        used them (`_check_when_read`)."""
        for key in keys:
            arrived, task, nbytes = self._ahead.pop(key)
            self._ahead_bytes -= nbytes
            if not task.cancel():
                st = self.stats.layer(key[0])
                st.bytes_read += nbytes
                st.unused_bytes += nbytes
                task.add_done_callback(lambda _task, arrived=arrived: self._recycle(arrived))

    def _recycle(self, arrived: Future[np.ndarray]) -> None:
        """A dropped read's buffer, once read, goes to the spares (see `_evicted`)."""
        if arrived.done() and arrived.exception() is None:
            self._evicted(arrived.result())

    def _evicted(self, buf: np.ndarray) -> None:
        """An evicted entry's buffer goes to the spares (a view of the page cache: its pages are unmapped)."""
        if self._page_cache is not None and self._page_cache.holds(buf):
            self._page_cache.release(buf)
        else:
            self._spare.give(buf)

    def verify_pending(self) -> None:
        """Wait for the CRC checks of every blob handed out so far. A blob that failed leaves the
        cache, and the first failure of the earliest request is raised."""
        pending, self._pending = self._pending, []
        wait([f for *_, f in pending])
        failure: BaseException | None = None
        for layer, expert, entry, f in pending:
            error = f.exception()
            if entry is not None and entry.checking is f:
                entry.checking = None
                if error is not None:
                    self._cache.discard((layer, expert), entry)
            if failure is None:
                failure = error
        if failure is not None:
            raise failure

    def _forget_passed(self) -> None:
        """Drop the checks that finished and passed, so a caller that never waits holds no blobs."""
        still = []
        for item in self._pending:
            entry, f = item[2], item[3]
            if f.done() and f.exception() is None:
                if entry is not None and entry.checking is f:
                    entry.checking = None
            else:
                still.append(item)
        self._pending = still

    def close(self) -> None:
        """Waits for the reads and checks still running; a check nobody waited for is dropped with
        the cache."""
        self._drop_ahead(list(self._ahead))
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._pending.clear()
        with self._lock:
            for fd in [*self._retired_fds, *([self._fd] if self._fd is not None else [])]:
                os.close(fd)
            self._retired_fds.clear()
            self._fd = None
        self._cache.clear()

    def _open(self, direct_io: bool) -> int:
        if direct_io:
            flag = getattr(os, "O_DIRECT", None)
            if flag is None:
                self.io_note = "O_DIRECT is not available on this platform"
            else:
                try:
                    fd = _os_open(EXPERTS, os.O_RDONLY | flag, dir_fd=self.container.dir_fd)
                    self.io_mode = "direct"
                    return fd
                except OSError as e:
                    self.io_note = f"O_DIRECT open refused ({e.strerror})"
        try:
            fd = _os_open(EXPERTS, os.O_RDONLY, dir_fd=self.container.dir_fd)
        except OSError as e:
            raise WasteError(f"expert file {self._path}: {e.strerror}") from None
        self.io_mode = "buffered"
        return fd

    def _fall_back(self, failed_fd: int, note: str) -> None:
        """Switch to buffered reads after O_DIRECT failed on `failed_fd` (once, whichever
        reader thread gets here first). The old descriptor stays open until close(), since
        other readers may still be using it."""
        with self._lock:
            if self._fd != failed_fd or self._fd is None:
                return
            fd = self._open(False)
            self._retired_fds.append(failed_fd)
            self._fd = fd
            self.io_note = note

    def _read_then_check(self, layer: int, expert: int, offset: int, nbytes: int,
                         times: list[tuple[float, float]], arrived: Future[np.ndarray], check: bool = True) -> None:
        """In a reader thread: read one blob, hand it to `arrived` (appending the times the read
        started, its buffer included, and finished to `times`), then, with `check`, check its CRCs
        (the CRC releases the GIL). A 436 KiB `mini` blob checked at 14-16 GB/s right after its
        O_DIRECT read; read in 256 KiB pieces, each checked right after its read, 12-14 GB/s
        (shared machine). A failed check is this task's exception; a failed read is `arrived`'s."""
        start = time.perf_counter()
        try:
            buf = self._read(offset, nbytes)
            if self._interleave:
                buf = self._interleaved(layer, expert, buf)
        except BaseException as e:
            arrived.set_exception(e)
            return
        times.append((start, time.perf_counter()))
        arrived.set_result(buf)
        if check and self._verify and not self._interleave:
            self.container.check_expert(layer, expert, buf)

    def _interleaved(self, layer: int, expert: int, blob: np.ndarray) -> np.ndarray:
        """An MXFP4 blob just read, checked (its CRCs cover the stored bytes, so before anything
        else, read ahead or not), then repacked into a spare buffer of its size in the kernels'
        interleave; the blob's own buffer goes back to the spares. So the cache holds each expert
        once, at its blob's size, and the model's thread does not repack what it computes with."""
        if self._verify:
            self.container.check_expert(layer, expert, blob)
        out = self._spare.take(blob.nbytes)
        self.container.interleave_expert(blob, out)
        self._evicted(blob)
        return out

    def _check_when_read(self, layer: int, expert: int, read: Future[None],
                         arrived: Future[np.ndarray]) -> Future[None]:
        """The check of a blob read ahead, now that its layer asks for it: a reader thread runs it
        once the read (`read`) has finished. A blob read ahead and never asked for is never checked:
        on the 48B from disk about a sixth of what a decode step's guesses read went unused (and a
        blob's first touch after an O_DIRECT read costs about as much as the CRC itself, docs/MEASURED.md).
        The callback holds no reference to `read` (the future passes itself): a cycle through it
        would keep the blob's buffer from being reused until the garbage collector ran."""
        checked: Future[None] = Future()

        def queue(done: Future[None]) -> None:
            try:
                self._pool.submit(self._check_read_ahead, layer, expert, done, arrived, checked)  # type: ignore[union-attr]
            except RuntimeError:  # the pool is shutting down (close): check here
                self._check_read_ahead(layer, expert, done, arrived, checked)

        read.add_done_callback(queue)
        return checked

    def _check_read_ahead(self, layer: int, expert: int, read: Future[None], arrived: Future[np.ndarray],
                          checked: Future[None]) -> None:
        """`_check_when_read`'s check: passes at once when the read was cancelled or failed
        (`arrived` carries a failed read's error), else the blob's CRCs decide."""
        if read.cancelled() or not arrived.done() or arrived.exception() is not None:
            checked.set_result(None)
            return
        try:
            self.container.check_expert(layer, expert, arrived.result())
        except BaseException as e:
            checked.set_exception(e)
        else:
            checked.set_result(None)

    def _read_inline(self, layer: int, expert: int, offset: int, nbytes: int, times: list[tuple[float, float]],
                     checks: dict[int, Future[None]], index: int) -> np.ndarray:
        """A read in the caller (a single miss, or no pool); its check goes to a reader thread,
        or runs here when there is none."""
        start = time.perf_counter()
        buf = self._read(offset, nbytes)
        if self._interleave:
            buf = self._interleaved(layer, expert, buf)
        times.append((start, time.perf_counter()))
        if self._verify and not self._interleave:
            if self._pool is not None:
                checks[index] = self._pool.submit(self.container.check_expert, layer, expert, buf)
            else:
                self.container.check_expert(layer, expert, buf)
        return buf

    def _read(self, offset: int, nbytes: int) -> np.ndarray:
        if self._page_cache is not None:
            if self._fd is None:
                raise WasteError("expert store is closed")
            try:
                return self._page_cache.read(offset, nbytes)
            except OSError as e:
                raise WasteError(f"expert file {self._path}: reading {nbytes} B at {offset}: {e.strerror}") from None
        buf = self._spare.take(nbytes)
        while True:
            fd, direct = self._fd, self.io_mode == "direct"
            if fd is None:
                raise WasteError("expert store is closed")
            try:
                pread_into(fd, buf, offset)
                return buf
            except OSError as e:
                if direct and e.errno == errno.EINVAL:
                    self._fall_back(fd, f"O_DIRECT read refused ({e.strerror}); reading buffered")
                    continue
                raise WasteError(f"expert file {self._path}: reading {nbytes} B at {offset}: {e.strerror}") from None
            except EOFError:
                raise WasteError(
                    f"expert file {self._path}: truncated, blob of {nbytes} B at offset {offset} runs past the end"
                ) from None


def _as_completed(futures: dict[Future[np.ndarray], int]) -> Iterator[tuple[int, np.ndarray]]:
    """(index, blob) of each read as it finishes (reads that finish together in index order)."""
    pending = set(futures)
    while pending:
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        for f in sorted(done, key=futures.__getitem__):
            yield futures[f], f.result()


def open_expert_store(
    container: Any,
    budget_bytes: int | None,
    policy: str = "lru",
    read_threads: int = 4,
    io: str = DEFAULT_IO,
    prefill_budget_bytes: int | None = None,
) -> ExpertStore:
    """The store `waste run` uses: budget None maps the container, otherwise stream."""
    if budget_bytes is None:
        return MmapExpertStore(container)
    return StreamingExpertStore(container, budget_bytes, policy, read_threads, io, prefill_budget_bytes)


# A module-level hook so tests can force the O_DIRECT fallback at open.
_os_open = os.open
