"""Replaying routing traces through expert caches: LRU, LFU and Belady's optimum.

The replay follows the expert store's semantics exactly (docs/TRACE.md, "Cache
semantics"): requests are the trace's (step, layer) groups in recorded order, each the
unique ids sorted; all ids of a request are looked up before anything changes; then they
are touched in the order asked. One cache is shared by all layers (keys are (layer,
expert)) unless `per_layer_capacity`, which gives every layer its own cache of that size.
With every blob the same size, `simulate(trace, "lru", budget // blob_bytes)` reproduces the
hit counts of `StreamingExpertStore(budget, "lru")` on the same requests.

Shapes: R requests, M lookups (unique ids summed over requests).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from waste.engine.trace import Requests, Trace
from waste.errors import WasteError

SIM_POLICIES = ("lru", "lfu", "belady")


@dataclass(frozen=True)
class SimResult:
    """Outcome of one replay. `hit` [M] is parallel to `trace.requests().ids`."""

    policy: str
    capacity: int
    per_layer_capacity: bool
    hit: np.ndarray  # [M] bool
    lookup_layer: np.ndarray  # [M] int64
    requests: int

    @property
    def lookups(self) -> int:
        return len(self.hit)

    @property
    def hits(self) -> int:
        return int(self.hit.sum())

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else float("nan")

    @property
    def per_layer(self) -> dict[int, tuple[int, int]]:
        """layer -> (hits, lookups)."""
        out = {}
        for layer in np.unique(self.lookup_layer):
            sel = self.lookup_layer == layer
            out[int(layer)] = (int(self.hit[sel].sum()), int(sel.sum()))
        return out


def capacity_for_budget(budget_bytes: int, blob_bytes: int) -> int:
    """How many experts a byte budget holds when every blob is `blob_bytes` long."""
    if blob_bytes <= 0 or budget_bytes < 0:
        raise WasteError(f"capacity_for_budget: need blob_bytes > 0 and budget >= 0, got {blob_bytes}, {budget_bytes}")
    return budget_bytes // blob_bytes


def simulate(
    trace: Trace, policy: str, capacity_experts: int, *, per_layer_capacity: bool = False
) -> SimResult:
    """Replay `trace` through a cache of `capacity_experts` entries under `policy`."""
    if policy not in SIM_POLICIES:
        raise WasteError(f"cache policy {policy!r}: expected one of {', '.join(SIM_POLICIES)}")
    if capacity_experts < 0:
        raise WasteError(f"cache capacity must not be negative, got {capacity_experts}")
    req = trace.requests()
    hit = np.zeros(len(req.ids), bool)
    for rows, keys, start in _streams(req, trace.num_experts, per_layer_capacity):
        hit[rows] = _REPLAY[policy](start, keys, capacity_experts)
    return SimResult(policy, capacity_experts, per_layer_capacity, hit, req.lookup_layer, len(req))


def recorded(trace: Trace) -> SimResult:
    """The hits the engine recorded, counted the way `simulate` counts them (per lookup)."""
    req = trace.requests()
    return SimResult("recorded", -1, False, req.hit.copy(), req.lookup_layer, len(req))


def sweep(
    trace: Trace,
    capacities: Iterable[int],
    policies: Sequence[str] = SIM_POLICIES,
    *,
    per_layer_capacity: bool = False,
) -> dict[str, dict[int, SimResult]]:
    """policy -> capacity -> SimResult for every pair."""
    caps = [int(c) for c in capacities]
    return {p: {c: simulate(trace, p, c, per_layer_capacity=per_layer_capacity) for c in caps} for p in policies}


def format_sweep(table: Mapping[str, Mapping[int, SimResult]]) -> str:
    """Hit rates as fractions of lookups (the hit-rate plots' unit): one row per capacity in
    experts, one column per policy."""
    policies = list(table)
    caps = sorted({c for p in policies for c in table[p]})
    rows = [f"{'capacity':>9} " + " ".join(f"{p:>8}" for p in policies)]
    for c in caps:
        cells = [f"{table[p][c].hit_rate:8.3f}" if c in table[p] else f"{'-':>8}" for p in policies]
        rows.append(f"{c:>9} " + " ".join(cells))
    return "\n".join(rows)


@dataclass(frozen=True)
class ReuseHistogram:
    """Reuse (LRU stack) distances of every lookup, see `reuse_distances`."""

    distance: np.ndarray  # [M] int64, -1 for a first use
    lookup_layer: np.ndarray  # [M] int64
    per_layer_capacity: bool

    @property
    def counts(self) -> np.ndarray:
        """[D] lookups at each distance 0..D-1 (first uses left out)."""
        d = self.distance[self.distance >= 0]
        return np.bincount(d) if len(d) else np.zeros(0, np.int64)

    @property
    def cold(self) -> int:
        """Lookups of an expert never used before."""
        return int((self.distance < 0).sum())

    def layer_counts(self, layer: int) -> np.ndarray:
        d = self.distance[(self.lookup_layer == layer) & (self.distance >= 0)]
        return np.bincount(d) if len(d) else np.zeros(0, np.int64)

    def lru_hits(self, capacity: int) -> int:
        """LRU hits at this capacity: the lookups whose distance is below it."""
        return int(((self.distance >= 0) & (self.distance < capacity)).sum())


def reuse_distances(trace: Trace, *, per_layer_capacity: bool = False) -> ReuseHistogram:
    """For each lookup, how many distinct experts were touched since this expert's last
    touch (in the store's touch order), or -1 if it was never touched before.

    In a shared cache the count runs over all layers' experts, with per_layer_capacity over
    the layer's own. LRU at capacity c hits exactly the lookups with distance < c.
    """
    req = trace.requests()
    dist = np.full(len(req.ids), -1, np.int64)
    for rows, keys, start in _streams(req, trace.num_experts, per_layer_capacity):
        dist[rows] = _stack_distances(start, keys)
    return ReuseHistogram(dist, req.lookup_layer, per_layer_capacity)


def prefill_dedup_ratio(
    source: Trace | Mapping[int, np.ndarray] | np.ndarray, chunk_sizes: Iterable[int], *, phase: str = "prefill"
) -> dict[int, float]:
    """chunk size -> expert lookups per expert load when tokens are prefilled in chunks.

    Each chunk loads every distinct expert its tokens chose once, so the ratio is
    (tokens * k) / (sum over chunks and layers of distinct experts); 1 means no sharing.
    `source` is a trace (its `phase` rows, "prefill" or "all", by position), a dict layer
    -> ids [T, k], or one layer's ids [T, k].
    """
    per_layer = _dedup_counts(source, chunk_sizes, phase)
    return {c: sum(n for n, _ in v.values()) / sum(u for _, u in v.values()) for c, v in per_layer.items()}


def prefill_dedup_per_layer(
    source: Trace | Mapping[int, np.ndarray] | np.ndarray, chunk_sizes: Iterable[int], *, phase: str = "prefill"
) -> dict[int, dict[int, float]]:
    """chunk size -> layer -> dedup ratio (see `prefill_dedup_ratio`)."""
    per_layer = _dedup_counts(source, chunk_sizes, phase)
    return {c: {lay: n / u for lay, (n, u) in v.items()} for c, v in per_layer.items()}


def _dedup_counts(
    source: Trace | Mapping[int, np.ndarray] | np.ndarray, chunk_sizes: Iterable[int], phase: str
) -> dict[int, dict[int, tuple[int, int]]]:
    """chunk size -> layer -> (lookups, loads)."""
    layers = _ids_by_layer(source, phase)
    out: dict[int, dict[int, tuple[int, int]]] = {}
    for c in chunk_sizes:
        if int(c) < 1:
            raise WasteError(f"prefill chunk size must be at least 1, got {c}")
        out[int(c)] = {}
        for lay, ids in layers.items():
            t, k = ids.shape
            key = (np.arange(t, dtype=np.int64)[:, None] // int(c)) * (int(ids.max()) + 1) + ids
            out[int(c)][lay] = (t * k, len(np.unique(key)))
    return out


def _ids_by_layer(source: Trace | Mapping[int, np.ndarray] | np.ndarray, phase: str) -> dict[int, np.ndarray]:
    if isinstance(source, Trace):
        if phase not in ("prefill", "all"):
            raise WasteError(f"dedup phase {phase!r}: expected 'prefill' or 'all'")
        rows = source if phase == "all" else source.select_phase("prefill")
        layers = {}
        for lay in rows.moe_layers:
            sel = rows.layer == lay
            order = np.argsort(rows.position[sel], kind="stable")
            if sel.any():
                layers[lay] = rows.ids[sel][order]
    elif isinstance(source, Mapping):
        layers = {int(k): np.asarray(v, np.int64) for k, v in source.items()}
    else:
        layers = {0: np.asarray(source, np.int64)}
    layers = {k: (v[:, None] if v.ndim == 1 else v) for k, v in layers.items()}
    if not layers or all(len(v) == 0 for v in layers.values()):
        raise WasteError(f"prefill dedup: no {phase} rows to chunk")
    if any(v.ndim != 2 or (len(v) and v.min() < 0) for v in layers.values()):
        raise WasteError("prefill dedup: ids must be [T, k] non-negative expert ids")
    return {k: v for k, v in layers.items() if len(v)}


def _streams(
    req: Requests, num_experts: int, per_layer_capacity: bool
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The independent caches to replay: (lookup rows [m], keys [m], request starts)."""
    if not per_layer_capacity:
        keys = req.lookup_layer * num_experts + req.ids
        return [(np.arange(len(req.ids)), keys, req.start)]
    out = []
    for layer in np.unique(req.layer):
        rs = np.flatnonzero(req.layer == layer)
        rows = np.concatenate([np.arange(req.start[r], req.start[r + 1]) for r in rs])
        sizes = req.start[rs + 1] - req.start[rs]
        out.append((rows, req.ids[rows], np.concatenate([[0], np.cumsum(sizes)])))
    return out


def _replay_lru(start: np.ndarray, keys: np.ndarray, cap: int) -> np.ndarray:
    ks = keys.tolist()
    bounds = start.tolist()
    hit = np.zeros(len(ks), bool)
    cache: OrderedDict[int, None] = OrderedDict()  # least recent first
    for r in range(len(bounds) - 1):
        a, b = bounds[r], bounds[r + 1]
        for j in range(a, b):
            hit[j] = ks[j] in cache
        if cap == 0:
            continue
        for j in range(a, b):
            k = ks[j]
            if k in cache:
                cache.move_to_end(k)
            else:
                cache[k] = None
                if len(cache) > cap:
                    cache.popitem(last=False)
    return hit


def _replay_lfu(start: np.ndarray, keys: np.ndarray, cap: int) -> np.ndarray:
    ks = keys.tolist()
    bounds = start.tolist()
    hit = np.zeros(len(ks), bool)
    state: dict[int, tuple[int, int]] = {}  # key -> (count while cached, last touch)
    heap: list[tuple[int, int, int]] = []  # (count, last touch, key); stale items skipped
    tick = 0
    for r in range(len(bounds) - 1):
        a, b = bounds[r], bounds[r + 1]
        for j in range(a, b):
            hit[j] = ks[j] in state
        if cap == 0:
            continue
        for j in range(a, b):
            k = ks[j]
            tick += 1
            if k in state:
                state[k] = (state[k][0] + 1, tick)
            else:
                if len(state) >= cap:
                    while True:
                        f, t, victim = heapq.heappop(heap)
                        if state.get(victim) == (f, t):
                            break
                    del state[victim]
                state[k] = (1, tick)
            heapq.heappush(heap, (*state[k], k))
            if len(heap) > 4 * len(state) + 64:
                heap = [(f, t, kk) for kk, (f, t) in state.items()]
                heapq.heapify(heap)
    return hit


def _replay_belady(start: np.ndarray, keys: np.ndarray, cap: int) -> np.ndarray:
    """Keep, after each request, the experts whose next request comes soonest (an expert
    never requested again goes first). An incoming miss is not cached at all when its own
    next use is no sooner than every cached one's, so this is the optimum over all caches
    that choose, after each request, any `cap` of (cached before) + (requested now)."""
    nxt = _next_use(start, keys).tolist()
    ks = keys.tolist()
    bounds = start.tolist()
    hit = np.zeros(len(ks), bool)
    cached: dict[int, int] = {}  # key -> request index of its next use
    heap: list[tuple[int, int]] = []  # (-next use, key); stale items skipped
    for r in range(len(bounds) - 1):
        a, b = bounds[r], bounds[r + 1]
        for j in range(a, b):
            hit[j] = ks[j] in cached
        if cap == 0:
            continue
        # Hits first: their next use moves past this request before any miss competes.
        for j in range(a, b):
            if hit[j]:
                cached[ks[j]] = nxt[j]
                heapq.heappush(heap, (-nxt[j], ks[j]))
        for j in range(a, b):
            if hit[j]:
                continue
            k, n = ks[j], nxt[j]
            if len(cached) >= cap:
                while cached.get(heap[0][1]) != -heap[0][0]:
                    heapq.heappop(heap)
                if n >= -heap[0][0]:
                    continue
                del cached[heapq.heappop(heap)[1]]
            cached[k] = n
            heapq.heappush(heap, (-n, k))
        if len(heap) > 4 * len(cached) + 64:
            heap = [(-n, k) for k, n in cached.items()]
            heapq.heapify(heap)
    return hit


_REPLAY = {"lru": _replay_lru, "lfu": _replay_lfu, "belady": _replay_belady}


def _next_use(start: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """[m] the request index at which each lookup's key is next looked up (R if never)."""
    nreq = len(start) - 1
    req = np.repeat(np.arange(nreq, dtype=np.int64), np.diff(start))
    order = np.lexsort((req, keys))
    nxt = np.full(len(keys), nreq, np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = req[order[1:][same]]
    return nxt


def _stack_distances(start: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Distinct keys touched between each lookup's previous touch of its key and the start
    of its request (touches run in lookup order). A Fenwick tree over touch times holds a
    1 at each key's latest touch."""
    ks = keys.tolist()
    bounds = start.tolist()
    m = len(ks)
    tree = [0] * (m + 1)

    def add(i: int, v: int) -> None:
        i += 1
        while i <= m:
            tree[i] += v
            i += i & -i

    def prefix(i: int) -> int:
        """Sum over touch times 0..i-1."""
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    dist = np.full(m, -1, np.int64)
    last: dict[int, int] = {}
    for r in range(len(bounds) - 1):
        a, b = bounds[r], bounds[r + 1]
        before = prefix(a)
        for j in range(a, b):
            p = last.get(ks[j])
            if p is not None:
                dist[j] = before - prefix(p + 1)
        for j in range(a, b):
            p = last.get(ks[j])
            if p is not None:
                add(p, -1)
            add(j, 1)
            last[ks[j]] = j
    return dist
