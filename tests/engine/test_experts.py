"""Expert stores: weights served correctly under every budget and policy, the byte budget
never exceeded, the LRU/LFU stores agreeing hit for hit with the cache simulator, and the
O_DIRECT fallbacks."""

from __future__ import annotations

import errno
import json
import mmap
import os
import sys
from concurrent.futures import wait
from pathlib import Path

import numpy as np
import pytest

from waste import fileio, load_preset
from waste.analysis.cache_sim import recorded, simulate
from waste.container.reader import open_container
from waste.engine import experts as ex
from waste.engine import read_buffers
from waste.engine.experts import MmapExpertStore, StreamingExpertStore, open_expert_store
from waste.engine.trace import TraceRecorder, expand_hits
from waste.errors import WasteError
from waste.kernels.quant import from_buffers
from waste.testing import tiny_container

PAGE = 4096


class ExpertBlobContainer:
    """The container methods the stores use, over an experts.bin of f32 blobs written here.

    Blob of (layer, e): w1 [I, D], w3 [I, D], w2 [D, I] back to back, padded with pages;
    layer li's blobs take 1 + extra_pages[li] pages. Blobs sit in a shuffled disk order so
    request order and disk order differ.
    """

    def __init__(self, root: Path, *, seed: int, extra_pages: tuple[int, ...] = (0,), d: int = 16, i: int = 8):
        self.config = load_preset("tiny")
        self.d, self.i = d, i
        layers = self.config.moe_layers
        E = self.config.num_experts
        rng = np.random.default_rng(seed)
        self.weights = {}
        self.spans = {}
        keys = [(layer, e) for layer in layers for e in range(E)]
        offset = 0
        for idx in rng.permutation(len(keys)):
            layer, e = keys[idx]
            nbytes = PAGE * (1 + extra_pages[layers.index(layer) % len(extra_pages)])
            self.spans[(layer, e)] = (offset, nbytes)
            offset += nbytes
        self.experts_path = root / "experts.bin"
        blob = np.zeros(offset, np.uint8)
        for key, (off, _) in self.spans.items():
            w = [rng.standard_normal(s).astype(np.float32) for s in ((i, d), (i, d), (d, i))]
            self.weights[key] = w
            flat = np.concatenate([x.ravel() for x in w]).view(np.uint8)
            blob[off:off + len(flat)] = flat
        self.experts_path.write_bytes(blob.tobytes())
        self.experts_fd = os.open(self.experts_path, os.O_RDONLY)
        self._mmap = mmap.mmap(self.experts_fd, 0, access=mmap.ACCESS_READ)
        self._map = np.frombuffer(self._mmap, np.uint8)
        self.dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)  # what the store opens experts.bin in
        self.advised: list[tuple[int, int, int]] = []  # (offset, nbytes, advice) of every advise_experts
        self.verify_data = False  # no CRC table: the data checks belong to the real container
        self.experts_interleaved_when_read = False  # f32 blobs: handed out as read

    def expert_span(self, layer: int, e: int) -> tuple[int, int]:
        return self.spans[(layer, e)]

    def decode_expert(self, layer: int, buf: np.ndarray):
        f = buf.view(np.float32)
        n = self.i * self.d
        return (
            from_buffers("f32", (self.i, self.d), {"w": f[:n].reshape(self.i, self.d)}),
            from_buffers("f32", (self.i, self.d), {"w": f[n:2 * n].reshape(self.i, self.d)}),
            from_buffers("f32", (self.d, self.i), {"w": f[2 * n:3 * n].reshape(self.d, self.i)}),
        )

    def experts_view(self, offset: int, nbytes: int) -> np.ndarray:
        return self._map[offset:offset + nbytes]

    def advise_experts(self, offset: int, nbytes: int, advice: int) -> None:
        self.advised.append((offset, nbytes, advice))
        self._mmap.madvise(advice, offset, nbytes)

    def expert(self, layer: int, e: int):
        off, nbytes = self.spans[(layer, e)]
        return self.decode_expert(layer, self._map[off:off + nbytes])


def _assert_weights(c, layer: int, ids, got) -> None:
    assert len(got) == len(ids)
    for e, (w1, w3, w2) in zip(ids, got, strict=True):
        want = c.weights[(layer, e)]
        for q, w in zip((w1, w3, w2), want, strict=True):
            np.testing.assert_array_equal(q.dequantize(), w)


def _random_requests(rng, c, n: int, max_size: int = 5):
    layers = c.config.moe_layers
    E = c.config.num_experts
    out = []
    for _ in range(n):
        size = int(rng.integers(1, max_size + 1))
        out.append((int(rng.choice(layers)), sorted(rng.choice(E, size, replace=False).tolist())))
    return out


def _held_bytes(store: StreamingExpertStore) -> int:
    """Bytes of the buffers the cache holds, counted from its entries, not its counter."""
    return sum(int(entry.buf.nbytes) for entry in store._cache.entries.values())


@pytest.mark.parametrize("io", ex.IO_MODES)
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("budget_blobs", [0, 3, 1000])
def test_streaming_serves_the_right_weights(tmp_path, policy, budget_blobs, io):
    rng = np.random.default_rng(1)
    c = ExpertBlobContainer(tmp_path, seed=2)
    with StreamingExpertStore(c, budget_blobs * PAGE, policy, read_threads=3, io=io) as store:
        for layer, ids in _random_requests(rng, c, 60):
            _assert_weights(c, layer, ids, store.get(layer, ids))
            assert store.last_hits.shape == (len(ids),)
        tot = store.stats.total
        assert tot.requests == tot.hits + tot.misses
        assert tot.bytes_read == tot.misses * PAGE
        if budget_blobs == 0:
            assert tot.hits == 0 and store.cached_bytes == 0
        if budget_blobs == 1000:
            # Everything fits: each expert is read once.
            assert tot.misses == len({(lay, e) for lay, ids in _random_requests(np.random.default_rng(1), c, 60)
                                      for e in ids})


@pytest.mark.parametrize("read_threads", [1, 4])
def test_fetch_hands_out_hits_first_and_ends_as_get(tmp_path, read_threads):
    """fetch yields every id once, its hits before its misses, the right weights, and leaves the
    cache and the counters where get leaves them (same requests to a twin store)."""
    rng = np.random.default_rng(4)
    c = ExpertBlobContainer(tmp_path, seed=5)
    with StreamingExpertStore(c, 6 * PAGE, "lru", read_threads=read_threads) as by_get, \
            StreamingExpertStore(c, 6 * PAGE, "lru", read_threads=read_threads) as by_fetch:
        for layer, ids in _random_requests(rng, c, 40):
            by_get.get(layer, ids)
            handed = list(by_fetch.fetch(layer, ids))
            order = [i for i, _ in handed]
            assert sorted(order) == list(range(len(ids)))
            hits = by_fetch.last_hits
            np.testing.assert_array_equal(hits, by_get.last_hits)
            assert order[:int(hits.sum())] == list(np.flatnonzero(hits))
            got = dict(handed)
            _assert_weights(c, layer, ids, [got[i] for i in range(len(ids))])
            assert by_fetch.cached_keys() == by_get.cached_keys()
        a, b = by_get.stats.total.as_dict(), by_fetch.stats.total.as_dict()
        for d in (a, b):
            d.pop("read_seconds"), d.pop("gbps")
        assert a == b


def test_fetch_stopped_early_leaves_no_read_running(tmp_path):
    c = ExpertBlobContainer(tmp_path, seed=6)
    with StreamingExpertStore(c, 0, "lru", read_threads=4) as store:
        arrivals = store.fetch(4, [0, 1, 2, 3, 4, 5])
        next(arrivals)
        arrivals.close()
        # Nothing was touched and nothing counted: the request did not complete.
        assert store.cached_keys() == [] and store.stats.total.calls == 0
        _assert_weights(c, 4, [6, 7], store.get(4, [6, 7]))


def test_mmap_store_counts_every_lookup_as_a_miss(tmp_path):
    c = ExpertBlobContainer(tmp_path, seed=3)
    store = open_expert_store(c, None)
    assert isinstance(store, MmapExpertStore) and store.io_mode == "mmap"
    got = store.get(2, [1, 4, 7])
    _assert_weights(c, 2, [1, 4, 7], got)
    assert not store.last_hits.any() and store.last_hits.shape == (3,)
    s = store.stats.layer(2)
    assert (s.calls, s.requests, s.hits, s.misses, s.bytes_read, s.read_seconds) == (1, 3, 0, 3, 3 * PAGE, 0.0)
    store.close()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_budget_never_exceeded(tmp_path, policy):
    rng = np.random.default_rng(4)
    # Layers' blobs are 1, 3 and 2 pages, so byte fits and entry counts disagree.
    c = ExpertBlobContainer(tmp_path, seed=5, extra_pages=(0, 2, 1))
    for budget in (0, PAGE - 1, 2 * PAGE + 100, 5 * PAGE, 11 * PAGE + 7):
        with StreamingExpertStore(c, budget, policy, read_threads=2) as store:
            for layer, ids in _random_requests(rng, c, 80, max_size=6):
                got = store.get(layer, ids)
                held = _held_bytes(store)
                assert held <= budget
                assert held == store.cached_bytes
                assert all(store._cache.entries[k].buf.nbytes <= budget for k in store.cached_keys())
                _assert_weights(c, layer, ids, got)


def test_experts_stay_valid_after_eviction(tmp_path):
    c = ExpertBlobContainer(tmp_path, seed=6)
    with StreamingExpertStore(c, PAGE, "lru", read_threads=1) as store:
        first = store.get(1, [0, 1, 2])
        for e in range(8):
            store.get(3, [e])
        assert store.cached_keys() == [(3, 7)]
        _assert_weights(c, 1, [0, 1, 2], first)


def test_evicted_buffers_are_reused_only_when_unreferenced(tmp_path):
    """A read takes an evicted entry's buffer when nothing refers to it any more, never while an
    expert handed out earlier still points into it (its weights must not change under it)."""
    c = ExpertBlobContainer(tmp_path, seed=8)
    with StreamingExpertStore(c, PAGE, "lru", read_threads=1) as store:
        store.get(3, [0])
        store.get(3, [1])  # evicts (3, 0), whose experts nobody holds
        store.get(3, [2])  # reads into (3, 0)'s buffer
        assert store._spare.reused == 1
        held = store.get(3, [3])
        store.get(3, [4])  # evicts (3, 3) while `held` points into its buffer
        store.get(3, [5])  # must not read into it: evicted (3, 2)'s spare buffer serves instead
        store.get(3, [6])
        _assert_weights(c, 3, [3], held)
        reused = store._spare.reused
        del held
        for e in (7, 0, 1, 2, 3):  # each evicts the one before
            got = store.get(3, [e])
            _assert_weights(c, 3, [e], got)
        assert store._spare.reused == reused + 5


def test_hand_worked_lru_and_lfu(tmp_path):
    c = ExpertBlobContainer(tmp_path, seed=7)
    # At 2 entries (A, B, C = experts 0, 1, 2 of layer 1), A A B C A:
    # LRU: A miss, A hit, B miss [A B], C miss evicts A [B C], A miss -> 1 hit.
    # LFU: A miss, A hit (A:2), B miss (B:1), C miss evicts B (count 1) -> {A, C}, A hit -> 2 hits.
    # A B A C A B tells LRU from first in, first out, which A A B C A does not:
    # LRU: A B miss, A hit [B A], C miss evicts B [A C], A hit [C A], B miss; FIFO's C would evict A.
    for policy, order, hits in (("lru", (0, 0, 1, 2, 0), [0, 1, 0, 0, 0]), ("lfu", (0, 0, 1, 2, 0), [0, 1, 0, 0, 1]),
                                ("lru", (0, 1, 0, 2, 0, 1), [0, 0, 1, 0, 1, 0])):
        with StreamingExpertStore(c, 2 * PAGE, policy, read_threads=1) as store:
            seen = []
            for e in order:
                store.get(1, [e])
                seen.append(int(store.last_hits[0]))
            assert seen == hits, policy


def test_request_larger_than_cache_reinserts_in_order_asked(tmp_path):
    c = ExpertBlobContainer(tmp_path, seed=8)
    with StreamingExpertStore(c, 2 * PAGE, "lru", read_threads=1) as store:
        store.get(1, [0, 1])
        # Lookup first: 0 and 1 are hits, 2 and 3 misses. Touches in order 0 1 2 3 leave [2 3].
        store.get(1, [0, 1, 2, 3])
        assert store.last_hits.tolist() == [True, True, False, False]
        assert store.cached_keys() == [(1, 2), (1, 3)]
        # 0 2: 0 was inserted-then-evicted, so a miss; 2 is cached. Touch 0 evicts 3 ([2 0]), touch 2 -> [0 2].
        store.get(1, [0, 2])
        assert store.last_hits.tolist() == [False, True]
        assert store.cached_keys() == [(1, 0), (1, 2)]


def test_misses_are_read_in_disk_offset_order(tmp_path, monkeypatch):
    c = ExpertBlobContainer(tmp_path, seed=9)
    offsets = []
    real = fileio._preadv

    def spy(fd, bufs, offset):
        offsets.append(offset)
        return real(fd, bufs, offset)

    monkeypatch.setattr(fileio, "_preadv", spy)
    with StreamingExpertStore(c, 0, "lru", read_threads=1) as store:
        ids = [0, 1, 2, 3, 4, 5, 6, 7]
        store.get(4, ids)
    assert offsets == sorted(c.expert_span(4, e)[0] for e in ids)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_store_agrees_with_simulator(tmp_path, policy):
    """Drive the store the way the MoE layer does (unique sorted ids per chunk and layer),
    record a trace, and replay it: the simulator must match the store lookup for lookup."""
    rng = np.random.default_rng(10)
    c = ExpertBlobContainer(tmp_path, seed=11)
    cfg = c.config
    k = cfg.num_experts_per_token
    rec = TraceRecorder(cfg.num_layers, cfg.moe_layers, k, num_experts=cfg.num_experts)
    capacity = 9
    # Skewed routing, so a 9-entry cache shared by 4 layers of 8 experts sees both hits and misses.
    prob = 1.0 / np.arange(1, cfg.num_experts + 1) ** 1.5
    prob /= prob.sum()
    with StreamingExpertStore(c, capacity * PAGE + PAGE // 2, policy, read_threads=2) as store:
        pos = 0
        for t in [7, 3, 5] + [1] * 25:
            phase = "prefill" if t > 1 else "decode"
            for layer in cfg.moe_layers:
                ids = np.stack([rng.choice(cfg.num_experts, k, replace=False, p=prob) for _ in range(t)])
                unique = np.unique(ids)
                store.get(layer, unique.tolist())
                hits = expand_hits(ids, unique, store.last_hits)
                rec.record(layer, np.arange(pos, pos + t), phase, ids, np.full((t, k), 0.5), hits)
            pos += t
        total = store.stats.total
    trace = rec.trace()
    sim = simulate(trace, policy, capacity)
    rec_hits = recorded(trace)
    np.testing.assert_array_equal(sim.hit, rec_hits.hit)
    assert sim.hits == total.hits and sim.lookups == total.requests
    assert 0 < total.hits < total.requests, total
    for layer, (h, n) in sim.per_layer.items():
        assert (h, n) == (store.stats.layers[layer].hits, store.stats.layers[layer].requests)


def test_direct_io_on_this_file_system(tmp_path):
    c = ExpertBlobContainer(tmp_path, seed=12)
    with StreamingExpertStore(c, 0, "lru", read_threads=2, io="direct") as store:
        assert store.io_mode in ("direct", "buffered")
        assert store.io_mode == "direct" or store.io_note
        _assert_weights(c, 1, [0, 3, 5], store.get(1, [0, 3, 5]))


def test_direct_io_open_refused_falls_back(tmp_path, monkeypatch):
    c = ExpertBlobContainer(tmp_path, seed=13)
    real_open = os.open

    def refuse_direct(path, flags, *a, **kw):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(ex, "_os_open", refuse_direct)
    monkeypatch.setattr(os, "O_DIRECT", getattr(os, "O_DIRECT", 0x4000), raising=False)
    with StreamingExpertStore(c, 0, "lru", io="direct") as store:
        assert store.io_mode == "buffered"
        assert "open refused" in store.io_note
        _assert_weights(c, 2, [1, 6], store.get(2, [1, 6]))


def test_direct_io_read_einval_falls_back(tmp_path, monkeypatch):
    c = ExpertBlobContainer(tmp_path, seed=14)
    real_open, real_preadv = os.open, fileio._preadv
    flag = getattr(os, "O_DIRECT", 0x4000)
    direct_fds = set()

    def fake_direct_open(path, flags, *a, **kw):
        # Open buffered whatever the file system allows, but remember the "direct" descriptor.
        fd = real_open(path, flags & ~flag, *a, **kw)
        if flags & flag:
            direct_fds.add(fd)
        return fd

    def einval_on_direct(fd, bufs, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(os, "O_DIRECT", flag, raising=False)
    monkeypatch.setattr(ex, "_os_open", fake_direct_open)
    monkeypatch.setattr(fileio, "_preadv", einval_on_direct)
    with StreamingExpertStore(c, 4 * PAGE, "lru", read_threads=4, io="direct") as store:
        assert store.io_mode == "direct"
        _assert_weights(c, 3, [0, 2, 4, 5, 7], store.get(3, [0, 2, 4, 5, 7]))
        assert store.io_mode == "buffered"
        assert "read refused" in store.io_note
        _assert_weights(c, 3, [1, 2], store.get(3, [1, 2]))


def test_bad_requests_and_damaged_files(tmp_path):
    c = ExpertBlobContainer(tmp_path, seed=15)
    with StreamingExpertStore(c, PAGE, "lru") as store:
        with pytest.raises(WasteError, match="not a MoE layer"):
            store.get(0, [1])
        with pytest.raises(WasteError, match="outside"):
            store.get(1, [8])
        with pytest.raises(WasteError, match="repeat"):
            store.get(1, [2, 2])
        assert store.get(1, []) == [] and store.last_hits.shape == (0,)
    with pytest.raises(WasteError, match="closed"):
        store.get(1, [0])
    for kwargs in ({"budget_bytes": -1}, {"budget_bytes": 0, "policy": "fifo"}, {"budget_bytes": 0, "read_threads": 0}):
        with pytest.raises(WasteError):
            StreamingExpertStore(c, **kwargs)
    last = max(c.spans, key=lambda key: c.spans[key][0])
    with open(c.experts_path, "r+b") as f:
        f.truncate(c.spans[last][0] + 100)
    with StreamingExpertStore(c, 0, "lru") as store, pytest.raises(WasteError, match="truncated"):
        store.get(last[0], [last[1]])
    c.experts_path.unlink()
    with pytest.raises(WasteError, match="experts.bin"):
        StreamingExpertStore(c, 0)


def test_stats_table_and_reset(tmp_path):
    c = ExpertBlobContainer(tmp_path, seed=16)
    with StreamingExpertStore(c, 8 * PAGE, "lru", read_threads=1) as store:
        store.get(1, [0, 1])
        store.get(1, [1, 2])
        store.get(2, [3])
        d = store.stats.as_dict()
        json.dumps(d)
        assert d["layers"]["1"]["hits"] == 1 and d["layers"]["1"]["misses"] == 3
        assert d["total"]["requests"] == 5 and d["total"]["bytes_read"] == 4 * PAGE
        table = store.stats.format_table()
        assert table.splitlines()[-1].split()[:4] == ["total", "5", "1", "4"]
        store.stats.reset()
        assert store.stats.total.requests == 0
        assert store.stats.format_table().splitlines()[-1].split()[:5] == ["total", "0", "0", "0", "-"]


@pytest.mark.parametrize("quant,fmt", [("f32", "f32"), ("q8", "q8g"), ("q4", "q4g")])
def test_real_container_budgets_agree(tmp_path_factory, quant, fmt):
    """Streamed experts equal the mapped ones under every budget and every io mode."""
    c = open_container(tiny_container(tmp_path_factory, quant=quant))
    cfg = c.config
    blob = c.expert_span(cfg.moe_layers[0], 0)[1]
    rng = np.random.default_rng(17)
    requests = _random_requests(rng, c, 40)
    mapped = MmapExpertStore(c)
    for budget in (0, 3 * blob, cfg.num_experts * len(cfg.moe_layers) * blob):
        for io in ex.IO_MODES:
            with StreamingExpertStore(c, budget, "lru", read_threads=2, io=io) as store:
                for layer, ids in requests:
                    got = store.get(layer, ids)
                    want = mapped.get(layer, ids)
                    for a, b in zip(got, want, strict=True):
                        for qa, qb in zip(a, b, strict=True):
                            assert qa.fmt == qb.fmt == fmt
                            for name, buf in qa.buffers.items():
                                np.testing.assert_array_equal(buf, qb.buffers[name])
                assert store.cached_bytes <= budget
    mapped.close()
    c.close()


def test_page_cache_reads_are_views_of_the_map_unmapped_on_eviction(tmp_path, monkeypatch):
    """io "page-cache": a blob is brought into the page cache over its exact range (WILLNEED, then
    MADV_POPULATE_READ on Linux) and handed out as a view of the container's map, no copy; an
    evicted blob is unmapped and left in the page cache, and a view handed out before its
    eviction still reads the right weights (its pages come back from the file)."""
    c = ExpertBlobContainer(tmp_path, seed=21)
    fadvised = []
    real_fadvise = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: fadvised.append((off, n, advice))
                        or real_fadvise(fd, off, n, advice))
    with StreamingExpertStore(c, 2 * PAGE, "lru", read_threads=1, io="page-cache") as store:
        assert store.io_mode == "page-cache"
        first = store.get(1, [0])
        off0 = c.expert_span(1, 0)[0]
        assert np.shares_memory(first[0][0].buffers["w"], c._map)
        assert fadvised == [(off0, PAGE, os.POSIX_FADV_WILLNEED)]
        if sys.platform.startswith("linux"):
            assert c.advised == [(off0, PAGE, read_buffers.MADV_POPULATE_READ)]
        store.get(1, [1])
        assert (off0, PAGE, mmap.MADV_DONTNEED) not in c.advised
        store.get(1, [2])  # evicts (1, 0)
        assert store.cached_keys() == [(1, 1), (1, 2)]
        assert (off0, PAGE, mmap.MADV_DONTNEED) in c.advised
        assert all(advice == os.POSIX_FADV_WILLNEED for *_, advice in fadvised)
        _assert_weights(c, 1, [0], first)


def test_page_cache_reads_without_populate_touch_the_pages(tmp_path, monkeypatch):
    """A kernel without MADV_POPULATE_READ (before Linux 5.14) refuses it with EINVAL: the store
    touches the pages instead, from then on, and serves the same weights."""
    c = ExpertBlobContainer(tmp_path, seed=22)
    advise = c.advise_experts
    refused = []

    def no_populate(offset, nbytes, advice):
        if advice == read_buffers.MADV_POPULATE_READ:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        advise(offset, nbytes, advice)

    monkeypatch.setattr(c, "advise_experts", no_populate)
    monkeypatch.setattr(sys, "platform", "linux")
    with StreamingExpertStore(c, PAGE, "lru", read_threads=1, io="page-cache") as store:
        _assert_weights(c, 2, [1, 3, 6], store.get(2, [1, 3, 6]))
        _assert_weights(c, 3, [0], store.get(3, [0]))
    assert len(refused) == 1


def test_page_cache_wrong_guesses_are_unmapped(tmp_path):
    """A guess read ahead into the page cache and never asked for is unmapped once read."""
    c = ExpertBlobContainer(tmp_path, seed=23)
    store = StreamingExpertStore(c, 8 * PAGE, "lru", read_threads=3, io="page-cache")
    store.guess(1, [2, 4])
    wait([task for _, task, _ in store._ahead.values()])  # both read (an unread guess is only cancelled)
    store.get(1, [4, 5])  # 2 was a wrong guess
    store.close()  # waits for the dropped read
    off2 = c.expert_span(1, 2)[0]
    assert (off2, PAGE, mmap.MADV_DONTNEED) in c.advised
    assert store.stats.layer(1).unused_bytes == PAGE


def test_unknown_io_mode_is_refused(tmp_path):
    c = ExpertBlobContainer(tmp_path, seed=24)
    with pytest.raises(WasteError, match="expert io 'fast'"):
        StreamingExpertStore(c, 0, io="fast")


@pytest.mark.parametrize("io", ex.IO_MODES)
def test_blobs_too_large_to_cache_are_let_go(tmp_path, io):
    """A blob the budget cannot hold is let go as an evicted one is once its request is served:
    unmapped (page-cache), or handed to the spares and read into again (direct, buffered), so a
    cache of 0 holds no more memory after a thousand reads than after one."""
    c = ExpertBlobContainer(tmp_path, seed=25)
    with StreamingExpertStore(c, PAGE - 1, "lru", read_threads=1, io=io) as store:
        first = store.get(1, [0, 1])
        del first
        store.get(1, [2, 3])
        assert store.cached_bytes == 0
        if io == "page-cache":
            released = {off for off, _, advice in c.advised if advice == mmap.MADV_DONTNEED}
            assert released == {c.expert_span(1, e)[0] for e in range(4)}
        else:
            assert store._spare.reused == 2


def test_aligned_buffer_is_page_aligned_zeroed_and_writable():
    """A fresh read buffer: page-aligned (O_DIRECT), writable, zero (its pages faulted in by
    whatever first touches them, the read); a size of 0 or less is refused."""
    buf = read_buffers.aligned_buffer(3 * mmap.PAGESIZE)
    assert buf.ctypes.data % mmap.PAGESIZE == 0 and buf.flags.writeable and buf.nbytes == 3 * mmap.PAGESIZE
    assert not buf.any()
    buf[:] = 7
    assert (buf == 7).all()
    with pytest.raises(WasteError, match="must be positive"):
        read_buffers.aligned_buffer(0)


def test_a_prefill_reuses_the_buffers_it_evicts(tmp_path_factory, monkeypatch):
    """A prefill pass's touch phase evicts a whole layer's blobs at once; they are kept and serve
    the next layer's reads, so the fresh buffers a prefill takes stay within the cache's blobs plus
    one layer's (keeping 16 let the rest go: at 48 experts a layer, most reads took a fresh one)."""
    from waste.engine.model import Model

    path = tiny_container(tmp_path_factory, quant="q4", overrides={"num_experts": 48})
    fresh = []
    real = read_buffers.aligned_buffer
    monkeypatch.setattr(read_buffers, "aligned_buffer", lambda n: fresh.append(n) or real(n))
    with open_container(path) as c:
        cfg = c.config
        blob = c.expert_span(cfg.moe_layers[0], 0)[1]
        cached = len(cfg.moe_layers) * cfg.num_experts // 2  # blobs the budget holds
        with StreamingExpertStore(c, cached * blob, "lru", read_threads=2) as store:
            model = Model(c, store=store)
            prompt = [int(t) for t in np.random.default_rng(3).integers(0, cfg.vocab_size, 200)]
            model.prefill(model.new_session(len(prompt)), prompt, all_logits=False)
            reads = store.stats.total.misses
    assert reads > cached + cfg.num_experts  # the pass evicted more than a layer's worth
    assert len(fresh) <= cached + cfg.num_experts, (len(fresh), reads)


def test_a_prompt_keeps_the_cache_to_the_prefill_budget(tmp_path):
    """`prefilling`: entering evicts the least recently used entries down to the prefill budget,
    within it the cache keeps to that budget, and after it grows back to the whole budget; once
    full again (LRU) it holds what a store with the whole budget throughout holds."""
    c = ExpertBlobContainer(tmp_path, seed=12)
    prompt = _random_requests(np.random.default_rng(11), c, 40, max_size=6)
    with (StreamingExpertStore(c, 6 * PAGE, "lru", read_threads=2, prefill_budget_bytes=3 * PAGE) as store,
          StreamingExpertStore(c, 6 * PAGE, "lru", read_threads=2) as whole):
        for e in range(8):
            store.get(1, [e])
            whole.get(1, [e])
        before = store.cached_keys()
        assert store.cached_bytes == 6 * PAGE and before == [(1, e) for e in range(2, 8)]
        with store.prefilling():
            assert store.cached_keys() == before[-3:] and _held_bytes(store) == 3 * PAGE
            for layer, ids in prompt:
                _assert_weights(c, layer, ids, store.get(layer, ids))
                whole.get(layer, ids)
                assert _held_bytes(store) <= 3 * PAGE
        assert store._cache.budget == 6 * PAGE
        for e in range(8):
            store.get(3, [e])
            whole.get(3, [e])
        assert _held_bytes(store) == 6 * PAGE and store.cached_keys() == whole.cached_keys()
    for budget, prefill in ((PAGE, 2 * PAGE), (PAGE, -1)):
        with pytest.raises(WasteError, match="prefill cache budget"):
            StreamingExpertStore(c, budget, prefill_budget_bytes=prefill)


def test_a_blob_truncated_between_check_and_read_is_named(tmp_path: Path) -> None:
    """PageCacheReads: experts.bin cut short after its view was checked makes MADV_POPULATE_READ
    fail with EFAULT ("Bad address"); the read checks the size again and says what happened."""
    from waste.container.lease import ContainerChanged

    class Truncated:  # a container whose experts.bin shrinks under the first read
        checks = 0

        def __init__(self, fd: int):
            self.experts_fd = fd

        def experts_view(self, offset: int, nbytes: int) -> np.ndarray:
            self.checks += 1
            if self.checks > 2:  # the one at construction and the read's own passed
                raise ContainerChanged(f"experts.bin: truncated to 0 bytes while in use (byte {offset + nbytes} "
                                       "is needed); another process changed the container")
            return np.zeros(nbytes, np.uint8)

        def advise_experts(self, offset: int, nbytes: int, advice: int) -> None:
            raise OSError(errno.EFAULT, "Bad address")

    with open(tmp_path / "experts.bin", "wb") as f:
        reads = read_buffers.PageCacheReads(Truncated(f.fileno()))
        reads._populate = True
        with pytest.raises(ContainerChanged, match="truncated"):
            reads.read(0, 4096)


def test_stats_hit_rate_and_read_speed(tmp_path_factory):
    """Hit rate counts lookups, not calls: 4 lookups over 2 calls with 1 hit is 25%, in the stats,
    their JSON and their table; the read speed is the bytes over the reads' time."""
    q4 = tiny_container(tmp_path_factory.mktemp("stats") / "q4", quant="q4")
    with open_container(q4) as c, StreamingExpertStore(c, 1 << 30, read_threads=1) as store:
        layer = c.config.moe_layers[0]
        store.get(layer, [0, 1])
        store.get(layer, [1, 2])
        s = store.stats.layer(layer)
        assert (s.calls, s.requests, s.hits) == (2, 4, 1)
        assert s.hit_rate == 0.25 and store.stats.as_dict()["layers"][str(layer)]["hit_rate"] == 0.25
        assert s.gbps == pytest.approx(s.bytes_read / s.read_seconds / 1e9)
        assert store.stats.format_table().splitlines()[-1].split()[4] == "25.0"
