"""Cache simulator: hand-worked traces, Belady against an exhaustive optimum, reuse
distances against a plain LRU stack, and prefill dedup ratios."""

from __future__ import annotations

from functools import cache
from itertools import combinations

import numpy as np
import pytest

from waste.analysis.cache_sim import (
    capacity_for_budget,
    format_sweep,
    prefill_dedup_per_layer,
    prefill_dedup_ratio,
    recorded,
    reuse_distances,
    simulate,
    sweep,
)
from waste.engine.trace import Trace
from waste.errors import WasteError


def _single(seq: str) -> Trace:
    """One decode token per letter, k = 1, one layer: A = expert 0, B = 1, ..."""
    return Trace.from_arrays([ord(ch) - ord("A") for ch in seq], layer=1)


def _grouped(requests: list[tuple[int, list[int]]]) -> Trace:
    """One step per request (layer, ids); each id one token row with k = 1."""
    ids, layer, step = [], [], []
    for s, (lay, req) in enumerate(requests):
        ids += req
        layer += [lay] * len(req)
        step += [s] * len(req)
    return Trace.from_arrays(np.array(ids), layer=np.array(layer), step=np.array(step), phase="prefill")


def _hits(trace: Trace, cap: int) -> dict[str, int]:
    return {p: simulate(trace, p, cap).hits for p in ("lru", "lfu", "belady")}


def test_hand_worked_abcabd():
    # A B C A B D, capacity 2.
    # LRU:  A-  B- [A B]  C- evicts A [B C]  A- evicts B [C A]  B- evicts C [A B]  D-   -> 0 hits
    # LFU (counts while cached, ties to the least recent): every count stays 1, so LFU
    #       evicts exactly like LRU                                                  -> 0 hits
    # Belady: A- B- {A B}; C- next use never, A's at 3, B's at 4: C is not kept; A+ B+ D- -> 2 hits
    assert _hits(_single("ABCABD"), 2) == {"lru": 0, "lfu": 0, "belady": 2}
    # Capacity 3 holds A B C: A+ B+, then D misses -> 2 hits for every policy.
    assert _hits(_single("ABCABD"), 3) == {"lru": 2, "lfu": 2, "belady": 2}
    assert _hits(_single("ABCABD"), 0) == {"lru": 0, "lfu": 0, "belady": 0}


def test_hand_worked_aabca():
    # A A B C A, capacity 2.
    # LRU: A- A+ B- [A B] C- evicts A [B C] A-                          -> 1 hit
    # LFU: A- A+ (A:2) B- (B:1) C- evicts B, the lower count {A C} A+    -> 2 hits
    # Belady: A- A+ B- {A B} C- (never used again: not kept) A+          -> 2 hits
    assert _hits(_single("AABCA"), 2) == {"lru": 1, "lfu": 2, "belady": 2}


def test_hand_worked_grouped_requests():
    # Requests [0 1], [2 3], [0 2] in one layer, capacity 2.
    # LRU: r0 misses, touch 0 1 -> [0 1]; r1 misses, touch 2 evicts 0, touch 3 evicts 1 -> [2 3];
    #      r2 looks up 0 (miss) and 2 (hit)                                                  -> 1 hit
    # LFU: same evictions (all counts 1)                                                      -> 1 hit
    # Belady: r1 keeps 2 (next use r2) over 1 (never), does not keep 3 (never) -> {0 2}; r2 both hit -> 2
    t = _grouped([(1, [0, 1]), (1, [2, 3]), (1, [0, 2])])
    assert _hits(t, 2) == {"lru": 1, "lfu": 1, "belady": 2}


def test_request_larger_than_the_cache():
    # Capacity 1, requests [0 1] twice: r0 touches 0 then 1 (evicting 0) -> [1];
    # r1 looks up 0 (miss) and 1 (hit) before touching anything.                  -> 1 hit
    t = _grouped([(1, [0, 1]), (1, [0, 1])])
    r = simulate(t, "lru", 1)
    assert r.hit.tolist() == [False, False, False, True]
    assert (r.hits, r.misses, r.lookups, r.requests) == (1, 3, 4, 2)
    assert r.hit_rate == 0.25


def test_shared_and_per_layer_capacity():
    # Layers 1 and 2 both use expert 0 every step, alternating: keys (1, 0) and (2, 0).
    t = _grouped([(1, [0]), (2, [0])] * 3)
    assert simulate(t, "lru", 1).hits == 0
    assert simulate(t, "lru", 2).hits == 4
    per = simulate(t, "lru", 1, per_layer_capacity=True)
    assert per.hits == 4 and per.per_layer == {1: (2, 3), 2: (2, 3)}
    assert simulate(t, "belady", 1).hits == 2
    assert simulate(t, "belady", 1, per_layer_capacity=True).hits == 4


def _exhaustive_optimum(requests: list[list[tuple[int, int]]], cap: int) -> int:
    """Best hit count of any cache that, after each request, keeps any `cap` of what it held
    plus what was just requested (what Belady claims to reach)."""

    @cache
    def best(r: int, cache: frozenset) -> int:
        if r == len(requests):
            return 0
        req = set(requests[r])
        hits = len(req & cache)
        cands = sorted(cache | req)
        keep = min(cap, len(cands))
        return hits + max(best(r + 1, frozenset(s)) for s in combinations(cands, keep))

    return best(0, frozenset())


def test_belady_is_optimal_and_bounds_lru_lfu():
    rng = np.random.default_rng(0)
    for trial in range(40):
        reqs = []
        for _ in range(int(rng.integers(4, 11))):
            size = int(rng.integers(1, 4))
            reqs.append((int(rng.integers(1, 3)), sorted(rng.choice(4, size, replace=False).tolist())))
        t = _grouped(reqs)
        keyed = [[(lay, e) for e in ids] for lay, ids in reqs]
        for cap in range(0, 4):
            got = _hits(t, cap)
            assert got["belady"] == _exhaustive_optimum(keyed, cap), (trial, cap, reqs)
            assert got["lru"] <= got["belady"] and got["lfu"] <= got["belady"]


def _naive_stack_distances(requests: list[list[int]]) -> list[int]:
    """LRU stack, most recent first; a request reads depths, then moves its ids to the top in order."""
    stack: list[int] = []
    out = []
    for req in requests:
        out += [stack.index(k) if k in stack else -1 for k in req]
        for k in req:
            if k in stack:
                stack.remove(k)
            stack.insert(0, k)
    return out


def test_reuse_distances_hand_worked_and_against_a_plain_stack():
    # A B C A B D: A's second use saw B and C since -> 2; B's saw C and A -> 2.
    h = reuse_distances(_single("ABCABD"))
    assert h.distance.tolist() == [-1, -1, -1, 2, 2, -1]
    assert h.counts.tolist() == [0, 0, 2] and h.cold == 4
    assert h.lru_hits(2) == 0 and h.lru_hits(3) == 2

    t = Trace.synthetic(prompt=48, decode=40, moe_layers=[1, 2, 3], num_experts=12, top_k=3, chunk=8, seed=1)
    req = t.requests()
    keys = req.lookup_layer * t.num_experts + req.ids
    grouped = [keys[req.start[r]:req.start[r + 1]].tolist() for r in range(len(req))]
    h = reuse_distances(t)
    assert h.distance.tolist() == _naive_stack_distances(grouped)
    assert h.counts.sum() + h.cold == len(req.ids)
    for cap in (0, 1, 3, 7, 12, 20, 36, 50):
        assert h.lru_hits(cap) == simulate(t, "lru", cap).hits, cap
    hl = reuse_distances(t, per_layer_capacity=True)
    for cap in (1, 4, 12):
        assert hl.lru_hits(cap) == simulate(t, "lru", cap, per_layer_capacity=True).hits
    assert sum(hl.layer_counts(lay).sum() for lay in t.moe_layers) == hl.counts.sum()


def test_lru_hits_never_fall_as_the_cache_grows():
    t = Trace.synthetic(prompt=64, decode=64, moe_layers=[1, 2], num_experts=32, top_k=4, skew=1.2, seed=2)
    table = sweep(t, [0, 4, 16, 48, 64])
    for policy in ("lru", "belady"):
        hits = [table[policy][c].hits for c in (0, 4, 16, 48, 64)]
        assert hits == sorted(hits) and hits[0] == 0
    # 64 entries hold both layers' 32 experts: only first uses miss.
    assert table["lru"][64].misses == reuse_distances(t).cold
    text = format_sweep(table)
    assert text.splitlines()[0].split() == ["capacity", "lru", "lfu", "belady"]
    assert len(text.splitlines()) == 6


def test_recorded_hits_are_counted_per_lookup():
    t = Trace.from_arrays(
        [[0, 1], [1, 0], [2, 1]],
        layer=1,
        step=np.array([0, 0, 1]),
        hit=np.array([[False, True], [True, False], [False, True]]),
        num_experts=3,
    )
    r = recorded(t)
    # Requests: step 0 looks up 0 (miss) and 1 (hit); step 1 looks up 1 (hit) and 2 (miss).
    assert r.hit.tolist() == [False, True, True, False] and r.hits == 2 and r.requests == 2


def test_prefill_dedup_hand_worked():
    ids = np.array([[0, 1], [1, 2], [0, 1], [3, 4]])
    # chunk 1: every token loads its own 2 experts -> 8 / 8; chunk 2: {0 1 2} + {0 1 3 4} -> 8 / 7;
    # chunk 4: {0 1 2 3 4} -> 8 / 5.
    assert prefill_dedup_ratio(ids, [1, 2, 4]) == {1: 1.0, 2: 8 / 7, 4: 8 / 5}
    two = {1: ids, 2: np.array([[5, 5], [5, 5], [5, 5], [5, 5]])}
    # Layer 2 loads expert 5 once per chunk of 2: 8 lookups / 2 loads.
    assert prefill_dedup_per_layer(two, [2])[2] == {1: 8 / 7, 2: 4.0}
    assert prefill_dedup_ratio(two, [2]) == {2: 16 / 9}


def test_prefill_dedup_from_a_trace_uses_prefill_rows_by_position():
    ids = np.array([[0, 1], [2, 3], [1, 0], [0, 2]])
    # Rows of layer 1 recorded out of position order; the decode row is left out unless phase="all".
    t = Trace.from_arrays(
        ids[[1, 0, 2, 3]],
        layer=1,
        position=np.array([1, 0, 2, 3]),
        phase=np.array([0, 0, 0, 1]),
        step=np.array([0, 0, 1, 2]),
    )
    # Prefill by position: [0 1] [2 3] [1 0]; chunk 2 -> {0 1 2 3} + {0 1} = 6 loads for 6 lookups.
    assert prefill_dedup_ratio(t, [2]) == {2: 1.0}
    # All rows: chunks [0 1][2 3] and [1 0][0 2] -> 4 + 3 loads for 8 lookups.
    assert prefill_dedup_ratio(t, [2], phase="all") == {2: 8 / 7}
    with pytest.raises(WasteError, match="no prefill rows"):
        prefill_dedup_ratio(t.select_phase("decode"), [2])
    with pytest.raises(WasteError, match="chunk size"):
        prefill_dedup_ratio(ids, [0])


def test_argument_checks():
    t = _single("AB")
    with pytest.raises(WasteError, match="policy"):
        simulate(t, "fifo", 2)
    with pytest.raises(WasteError, match="negative"):
        simulate(t, "lru", -1)
    assert capacity_for_budget(10 * 4096 + 5, 4096) == 10
    assert capacity_for_budget(100, 4096) == 0
    with pytest.raises(WasteError):
        capacity_for_budget(100, 0)
