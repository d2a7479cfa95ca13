"""Read-ahead of the next MoE layer's experts during a long prefill pass, and of the guessed experts
of the next MoE layers during decode: the same logits, hits, misses and final cache as without
them, reads never beyond the model's expert bytes, the memory they take bounded, and unused reads
dropped and counted."""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import wait
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from waste.container.format import ContainerError
from waste.container.reader import open_container
from waste.engine.experts import GUESS_LAYERS, IO_MODES, MmapExpertStore, StreamingExpertStore
from waste.engine.model import Model
from waste.engine.moe_layer import MoELayer
from waste.errors import WasteError
from waste.testing import tiny_container

# 100 tokens x 2 of 8 experts: 25 picks per expert, so a prefill pass reads ahead.
PROMPT = [int(t) for t in np.random.default_rng(11).integers(3, 500, 100)]
DECODE = 4


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    return tiny_container(tmp_path_factory.mktemp("read_ahead") / "q4", quant="q4")


def _run(c, store, read_ahead: bool) -> dict:
    """Prefill PROMPT, decode DECODE greedy tokens: every logits row, the counters and the cache."""
    model = Model(c, store=store)
    model.read_ahead = read_ahead
    model.guess_experts = False  # the decode's guesses (tested below) read wrong guesses by timing
    session = model.new_session(len(PROMPT) + DECODE)
    rows = [model.prefill(session, PROMPT, chunk=16)]
    prefill = store.stats.total.as_dict()
    for _ in range(DECODE):
        rows.append(model.decode(session, int(np.argmax(rows[-1][-1])))[None, :])
    out = {"logits": np.concatenate(rows), "prefill": prefill, "total": store.stats.total.as_dict(),
           "cached": store.cached_keys() if isinstance(store, StreamingExpertStore) else None,
           "peak": getattr(store, "read_ahead_peak", 0)}
    store.close()
    return out


@pytest.mark.parametrize("io", IO_MODES)
@pytest.mark.parametrize("layers_cached", [0, 1.5, 3, 99])
def test_read_ahead_changes_nothing_but_when_reads_happen(q4, layers_cached, io) -> None:
    """With a cache of 0, 1.5, 3 layers' experts or all of them: logits bit for bit those of the
    memory map; hits, misses, bytes and the cache's final entries as without read-ahead; the
    prefill reads at most the model's expert bytes, each expert at most once; what is cached,
    under way and read ahead never takes more than the budget, and the read-ahead happens
    whenever the budget has room for it."""
    with open_container(q4) as c:
        blob = int(c.expert_span(c.config.moe_layers[0], 0)[1])
        budget = int(layers_cached * c.config.num_experts * blob)
        mapped = _run(c, MmapExpertStore(c), True)
        plain = _run(c, StreamingExpertStore(c, budget, read_threads=4, io=io), False)
        ahead = _run(c, StreamingExpertStore(c, budget, read_threads=4, io=io), True)
        expert_bytes = c.byte_counts()["expert_bytes"]
    np.testing.assert_array_equal(ahead["logits"], mapped["logits"])
    np.testing.assert_array_equal(plain["logits"], mapped["logits"])
    for key in ("hits", "misses", "requests", "calls", "bytes_read"):
        assert ahead["prefill"][key] == plain["prefill"][key], key
        assert ahead["total"][key] == plain["total"][key], key
    assert ahead["cached"] == plain["cached"]
    assert ahead["prefill"]["unused_bytes"] == 0  # 25 picks per expert: every one is routed
    assert 0 < ahead["prefill"]["bytes_read"] <= expert_bytes
    assert ahead["prefill"]["misses"] <= len(c.config.moe_layers) * c.config.num_experts
    assert ahead["peak"] <= budget
    assert plain["peak"] == 0
    assert (ahead["peak"] > 0) == (budget > 0)


def test_read_ahead_reads_the_next_layer_before_it_is_asked_for(q4) -> None:
    """Entering read-ahead reads the first layer; asking for a layer reads the next one; an expert
    read ahead is handed out without a read of its own; one not asked for is dropped, its bytes
    counted as read and unused, its buffer spare."""
    with open_container(q4) as c:
        layers = c.config.moe_layers[:3]
        E = c.config.num_experts
        store = StreamingExpertStore(c, 10 * E * int(c.expert_span(layers[0], 0)[1]), read_threads=4)
        issued = []
        read = store._read
        store._read = lambda offset, nbytes: issued.append(offset) or read(offset, nbytes)  # type: ignore[method-assign]
        with store.read_ahead(layers):
            wait([task for _, task, _ in store._ahead.values()])
            assert len(issued) == E and {k[0] for k in store._ahead} == {layers[0]}
            store.get(layers[0], list(range(E)))
            assert {k[0] for k in store._ahead} == {layers[1]}
            wait([task for _, task, _ in store._ahead.values()])
            assert len(issued) == 2 * E
            store.get(layers[1], [0, 3])  # the 6 others of layers[1] were read for nothing
            wait([task for _, task, _ in store._ahead.values()])
            assert len(issued) == 3 * E
        assert store._ahead == {} and store._ahead_bytes == 0 and store._missing_bytes == 0
        unused = store.stats.layer(layers[1]).unused_bytes
        assert unused == (E - 2) * int(c.expert_span(layers[1], 0)[1])
        assert store.stats.layer(layers[1]).bytes_read == E * int(c.expert_span(layers[1], 0)[1])
        assert store.stats.layer(layers[1]).misses == 2
        assert store.stats.layer(layers[2]).unused_bytes == store.stats.layer(layers[2]).bytes_read > 0
        assert sorted(k for k in store.cached_keys() if k[0] == layers[1]) == [(layers[1], 0), (layers[1], 3)]
        store.close()


def _flip_byte(container: Path, layer: int, expert: int) -> None:
    with open_container(container, verify=False) as c:
        offset = c.expert_span(layer, expert)[0] + 40
    with open(container / "experts.bin", "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x04]))


def test_a_damaged_blob_read_ahead_fails_the_step_only_when_used(tmp_path: Path, q4: Path) -> None:
    """A blob read ahead is checked like any other: used, its CRC mismatch stops the prefill;
    read ahead but never asked for, it is dropped and nothing fails."""
    copy = tmp_path / "c.waste"
    shutil.copytree(q4, copy)
    with open_container(copy) as c:
        layers = c.config.moe_layers
        blob = int(c.expert_span(layers[0], 0)[1])
    _flip_byte(copy, layers[1], 5)
    with open_container(copy) as c, StreamingExpertStore(c, 99 * blob, read_threads=4) as store:
        model = Model(c, store=store)
        session = model.new_session(len(PROMPT))
        with pytest.raises(ContainerError, match="experts.bin: CRC mismatch"):
            model.prefill(session, PROMPT)
        assert session.tokens == [] and (layers[1], 5) not in store.cached_keys()
        assert (layers[1], 4) in store.cached_keys()
    with open_container(copy) as c, StreamingExpertStore(c, 99 * blob, read_threads=4) as store:
        with store.read_ahead(layers[:2]):
            store.get(layers[0], list(range(c.config.num_experts)))
            wait([task for _, task, _ in store._ahead.values()])  # (layers[1], 5) read, never checked
            store.get(layers[1], [0, 3])
        store.verify_pending()
        assert store.stats.layer(layers[1]).unused_bytes == (c.config.num_experts - 2) * blob


@pytest.mark.parametrize("read_threads", [4, 1])
def test_a_damaged_mxfp4_blob_fails_the_step_only_when_used(tmp_path_factory: pytest.TempPathFactory,
                                                            read_threads: int) -> None:
    """K3's MXFP4 blobs are checked as they are read (before their repack for the kernels), read
    ahead or not: used, a CRC mismatch stops the prefill with the container's error, and the blob
    is not cached; read ahead but never asked for, it is dropped and nothing fails."""
    root = tmp_path_factory.mktemp("k3_damaged")
    copy = tiny_container(root / "k3", preset="k3-tiny")
    with open_container(copy) as c:
        assert c.experts_interleaved_when_read
        layers, experts = c.config.moe_layers, c.config.num_experts
        blob = int(c.expert_span(layers[0], 0)[1])
        prompt = [int(t) for t in np.random.default_rng(12).integers(3, c.config.vocab_size, 60)]
    _flip_byte(copy, layers[1], 5)
    with open_container(copy) as c, StreamingExpertStore(c, 99 * blob, read_threads=read_threads) as store:
        model = Model(c, store=store)
        session = model.new_session(len(prompt))
        with pytest.raises(ContainerError, match="experts.bin: CRC mismatch"):
            model.prefill(session, prompt)
        assert session.tokens == [] and (layers[1], 5) not in store.cached_keys()
    with open_container(copy) as c, StreamingExpertStore(c, 99 * blob, read_threads=4) as store:
        with store.read_ahead(layers[:2]):
            store.get(layers[0], list(range(experts)))
            wait([task for _, task, _ in store._ahead.values()])  # (layers[1], 5) read and failed its check
            store.get(layers[1], [0, 3])
        store.verify_pending()
        assert store.stats.layer(layers[1]).unused_bytes == (experts - 2) * blob


def test_a_blob_read_ahead_is_checked_only_when_asked_for(tmp_path: Path, q4: Path) -> None:
    """A read issued ahead is checked once its layer asks for the blob, in a reader thread: a wrong
    guess is never checked (on this VM a blob's first touch after an O_DIRECT read costs about
    as much as its CRC), a right one is, and a damaged one asked for fails the request."""
    copy = tmp_path / "c.waste"
    shutil.copytree(q4, copy)
    with open_container(copy) as c:
        layer = c.config.moe_layers[1]
    _flip_byte(copy, layer, 4)
    with open_container(copy) as c, StreamingExpertStore(c, 0, read_threads=4) as store:
        checked = []
        check = c.check_expert
        c.check_expert = lambda lay, e, buf: checked.append((lay, e)) or check(lay, e, buf)  # type: ignore[method-assign]
        store.guess(layer, [1, 4, 6])
        wait([task for _, task, _ in store._ahead.values()])
        assert checked == []  # read, not yet asked for
        store.get(layer, [1, 6])  # 4, damaged, guessed wrongly: dropped unchecked
        assert sorted(checked) == [(layer, 1), (layer, 6)]
        assert store.stats.layer(layer).ahead_used == 2
        store.guess(layer, [4])
        wait([task for _, task, _ in store._ahead.values()])
        with pytest.raises(ContainerError, match="experts.bin: CRC mismatch"):
            store.get(layer, [4])
        assert checked[-1] == (layer, 4) and (layer, 4) not in store.cached_keys()


def test_blobs_read_ahead_that_have_arrived_are_ready_with_the_hits(q4: Path) -> None:
    """fetch hands out its hits, then the blobs read ahead that have arrived, without waiting:
    `ready` counts both, so the MoE layer computes them in one call; a read still to be done
    (here, one issued by the fetch itself) comes after them."""
    with open_container(q4) as c, StreamingExpertStore(c, 1 << 30, read_threads=4) as store:
        layer = c.config.moe_layers[1]
        store.get(layer, [2])  # cached: a hit below
        store.guess(layer, [1, 4])
        wait([task for _, task, _ in store._ahead.values()])
        # The read of expert 6 waits until the ready ones are out: a finished read would be ready too.
        released, read, held_back = threading.Event(), store._read, c.expert_span(layer, 6)[0]

        def read_when_released(offset: int, nbytes: int) -> np.ndarray:
            if offset == held_back:
                assert released.wait(30)
            return read(offset, nbytes)

        store._read = read_when_released  # type: ignore[method-assign]
        arrivals = store.fetch(layer, [1, 2, 4, 6])
        assert arrivals.ready == 3
        assert [i for i, _ in islice(arrivals, arrivals.ready)] == [1, 0, 2]  # the hit, then ids 1 and 4
        released.set()
        assert [i for i, _ in arrivals] == [3]
        st = store.stats.layer(layer)
        assert (st.hits, st.misses, st.ahead_used) == (1, 1 + 3, 2)  # the get of 2 was a miss


GUESS_STEPS = 10


def _decode_run(c, budget: int, guess: bool, io: str) -> dict:
    """A 3-token prompt (too short to read ahead), then GUESS_STEPS greedy decode steps, guessing
    or not: every logits row, the counters, the cache, and the most bytes the cache, the reads
    under way and those ahead held beyond the budget just after a guess was issued."""
    store = StreamingExpertStore(c, budget, read_threads=4, io=io)
    model = Model(c, store=store)
    model.guess_experts = guess
    beyond = [0]
    issue = store._issue_ahead

    def recording(layer, ids, extra):  # type: ignore[no-untyped-def]
        issued = issue(layer, ids, extra)
        beyond.append(store._cache.held + store._missing_bytes + store._ahead_bytes - budget)
        return issued

    store._issue_ahead = recording  # type: ignore[method-assign]
    session = model.new_session(3 + GUESS_STEPS)
    rows = [model.prefill(session, PROMPT[:3])[-1]]
    for _ in range(GUESS_STEPS):
        rows.append(model.decode(session, int(np.argmax(rows[-1]))))
    out = {"logits": np.stack(rows), "total": store.stats.total.as_dict(), "cached": store.cached_keys(),
           "beyond": max(beyond)}
    store.close()
    return out


@pytest.mark.parametrize("io", IO_MODES)
@pytest.mark.parametrize("layers_cached", [0, 1.5, 99])
def test_decode_guesses_change_nothing_but_when_reads_happen(q4, layers_cached, io) -> None:
    """Decode guessing the next MoE layers' experts: logits bit for bit, hits, misses and the cache's
    final entries as without guesses; some misses were read before their layer asked (with a
    cache too small to hold everything); bytes read are those of the misses plus the wrong
    guesses; and what is held beyond the budget stays within GUESS_LAYERS + 1 layers' picks."""
    with open_container(q4) as c:
        blob = int(c.expert_span(c.config.moe_layers[0], 0)[1])
        budget = int(layers_cached * c.config.num_experts * blob)
        k = c.config.num_experts_per_token
        guessed = _decode_run(c, budget, True, io)
        plain = _decode_run(c, budget, False, io)
    np.testing.assert_array_equal(guessed["logits"], plain["logits"])
    for key in ("hits", "misses", "requests", "calls"):
        assert guessed["total"][key] == plain["total"][key], key
    assert guessed["cached"] == plain["cached"]
    assert plain["total"]["ahead_used"] == 0 and plain["total"]["unused_bytes"] == 0
    assert guessed["total"]["bytes_read"] == plain["total"]["bytes_read"] + guessed["total"]["unused_bytes"]
    assert guessed["beyond"] <= (GUESS_LAYERS + 1) * k * blob
    if layers_cached < 99:
        assert guessed["total"]["ahead_used"] > 0


def test_a_guess_is_read_ahead_used_when_asked_for_and_dropped_when_wrong(q4) -> None:
    """A guessed expert is read before its layer asks and handed out without a read of its own
    (a miss, counted in `ahead_used`); a wrong guess is dropped when the layer asks, its bytes read
    and unused. Bad ids and a closed store are refused; the memory map passes guesses on to the
    kernel (POSIX_FADV_WILLNEED) and counts nothing."""
    with open_container(q4) as c:
        layer = c.config.moe_layers[1]
        blob = int(c.expert_span(layer, 0)[1])
        store = StreamingExpertStore(c, 0, read_threads=4)
        issued = []
        read = store._read
        store._read = lambda offset, nbytes: issued.append(offset) or read(offset, nbytes)  # type: ignore[method-assign]
        store.guess(layer, [1, 4])
        wait([task for _, task, _ in store._ahead.values()])
        assert len(issued) == 2
        store.get(layer, [1, 5])
        assert len(issued) == 3  # expert 1 came from its guess, 5 was read when asked for
        st = store.stats.layer(layer)
        assert (st.misses, st.ahead_used, st.unused_bytes, st.bytes_read) == (2, 1, blob, 3 * blob)
        assert store._ahead == {} and store._ahead_bytes == 0
        with pytest.raises(WasteError, match="outside"):
            store.guess(layer, [c.config.num_experts])
        with pytest.raises(WasteError, match="not a MoE layer"):
            store.guess(0, [1])
        store.close()
        with pytest.raises(WasteError, match="closed"):
            store.guess(layer, [1])
        mapped = MmapExpertStore(c)
        advised = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os, "posix_fadvise", lambda *a: advised.append(a))
            mapped.guess(layer, [1, 4])
        assert advised == [(c.experts_fd, *c.expert_span(layer, e), os.POSIX_FADV_WILLNEED) for e in (1, 4)]
        assert mapped.stats.total.bytes_read == 0


def test_decode_guesses_only_where_they_can_help(q4) -> None:
    """Guessing costs a decode step two routings per MoE layer (8% of a `mini` step): the model
    guesses only for a store that can miss: a streaming cache smaller than the experts, or a map
    asked to pass guesses on; not the plain map `waste run` uses when every expert fits."""
    with open_container(q4) as c:
        total = c.byte_counts()["expert_bytes"]
        stores = {"map": MmapExpertStore(c), "advised map": MmapExpertStore(c, advise_guesses=True),
                  "small cache": StreamingExpertStore(c, total // 2, read_threads=4),
                  "cache of all": StreamingExpertStore(c, total, read_threads=4),
                  "no reader threads": StreamingExpertStore(c, 0, read_threads=1)}
        expected = {"map": False, "advised map": True, "small cache": True, "cache of all": False,
                    "no reader threads": False}
        for name, store in stores.items():
            assert store.takes_guesses == expected[name], name
            guessed = []
            store.guess = lambda layer, ids, guessed=guessed: guessed.append(layer)  # type: ignore[method-assign]
            model = Model(c, store=store)
            session = model.new_session(4)
            model.prefill(session, PROMPT[:2])
            model.decode(session, 5)
            assert bool(guessed) == expected[name], name
            store.close()


def test_an_advised_map_guesses_when_the_tables_run_the_step(q4) -> None:
    """A decode step whose experts all have rows in the layer's tables runs in one call
    (`ExpertTables.route_and_sum`); an advised map's guesses still go out for every MoE layer
    followed by another, GUESS_LAYERS of them each (capped at the last layer), and only after
    the layer's experts are counted."""
    with open_container(q4) as c:
        store = MmapExpertStore(c, advise_guesses=True)
        model = Model(c, store=store)
        moe = list(c.config.moe_layers)
        for i in moe:  # every expert gets rows before the step
            tables = model.ffn[i]._tables_for(store, model.ffn[i].shared)
            for e in range(c.config.num_experts):
                tables.add(e, store.get(i, [e])[0])
        events = []
        count_request = store.count_request
        store.count_request = lambda layer, ids: (events.append(("count", layer)), count_request(layer, ids))
        store.guess = lambda layer, ids: events.append(("guess", layer))  # type: ignore[method-assign]
        session = model.new_session(4)
        model.prefill(session, PROMPT[:2])
        events.clear()
        model.decode(session, 5)
    expected = []
    for n, layer in enumerate(moe):
        expected.append(("count", layer))
        expected += [("guess", later) for later in moe[n + 1:n + 1 + GUESS_LAYERS]]
    assert events == expected


@pytest.mark.parametrize("layers_cached", [2, 2.5])
def test_a_full_cache_still_reads_every_layer_ahead(q4, layers_cached) -> None:
    """Once a prompt's first layers fill the cache, the entries of the layers the pass has left
    make way for the next layer's reads ahead: every miss of every layer is read ahead (before,
    the layers after the cache filled were read on demand), with the same logits, counters and
    final cache as without read-ahead, and never more than the budget cached, under way and ahead."""
    with open_container(q4) as c:
        layers = c.config.moe_layers
        assert len(layers) > layers_cached + 1  # some layers come after the cache is full
        blob = int(c.expert_span(layers[0], 0)[1])
        budget = int(layers_cached * c.config.num_experts * blob)
        plain = _run(c, StreamingExpertStore(c, budget, read_threads=4), False)
        store = StreamingExpertStore(c, budget, read_threads=4)
        ahead = _run(c, store, True)
        mapped = _run(c, MmapExpertStore(c), True)
    np.testing.assert_array_equal(ahead["logits"], mapped["logits"])
    for key in ("hits", "misses", "requests", "bytes_read"):
        assert ahead["prefill"][key] == plain["prefill"][key], key
    assert ahead["cached"] == plain["cached"] and ahead["peak"] <= budget
    first = c.config.num_experts  # the first layer's misses are read ahead as the pass begins too
    assert ahead["prefill"]["ahead_used"] == ahead["prefill"]["misses"] == len(layers) * first


def test_each_guess_uses_the_guessed_layers_router(q4):
    """A decode step guesses layer n's experts with layer n's own norm and router (the hidden
    state it will have is the one it has now): each guess equals what that layer's route gives
    the same state, which a wrong router would only match by chance."""
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 500, 40)]
    with open_container(q4) as c, StreamingExpertStore(c, 0, read_threads=4) as store:
        model = Model(c, store=store)
        assert store.takes_guesses
        routed: list[tuple[int, np.ndarray]] = []
        for i, ffn in enumerate(model.ffn):
            if isinstance(ffn, MoELayer):
                def route(x, i=i, original=ffn.route):
                    out = original(x)
                    routed.append((i, np.sort(out[0][0])))
                    return out
                ffn.route = route
        guesses = []
        original_guess = store.guess

        def guess(layer, ids):
            guesses.append((layer, np.asarray(ids).copy(), routed[-1]))
            return original_guess(layer, ids)

        store.guess = guess
        session = model.new_session(len(prompt) + 4)
        logits = model.prefill(session, prompt, all_logits=False)[-1]
        for _ in range(4):
            logits = model.decode(session, int(np.argmax(logits)))
    assert guesses
    for layer, ids, (routed_by, want) in guesses:
        assert routed_by == layer
        np.testing.assert_array_equal(ids, want)
