"""Work shared out by ranges with stealing (waste.kernels.steal): every item exactly once."""

from __future__ import annotations

import numpy as np
import pytest

from waste.jit import parallel_kernel, prange
from waste.kernels.steal import LINE, new_ranges, next_item


@parallel_kernel
def _take_all(n, threads, taken, first_taker):
    """taken[i] += 1 for every item handed out, first_taker[i] = the thread it went to."""
    words = new_ranges(n, threads)
    for t in prange(threads):
        cursor = np.zeros(1, np.int64)
        i = next_item(words, t, cursor)
        while i >= 0:
            taken[i] += 1
            first_taker[i] = t
            i = next_item(words, t, cursor)


@pytest.mark.parametrize("threads", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 64, 1001])
def test_every_item_is_handed_out_exactly_once(n: int, threads: int) -> None:
    """Whatever the items and the threads (more threads than the cores, or than the items), each
    item goes to exactly one thread. (A thread that takes an item writes taken[i] alone: a
    second taker would show as 2, or as a lost update, never as exactly 1 everywhere.)"""
    for _ in range(20):
        taken = np.zeros(n, np.int64)
        first_taker = np.full(n, -1, np.int64)
        _take_all(n, threads, taken, first_taker)
        assert (taken == 1).all()
        assert ((first_taker >= 0) & (first_taker < threads)).all()


def test_ranges_are_contiguous_and_a_lone_thread_takes_its_own_first_then_the_others_from_their_ends() -> None:
    """Thread 0 alone (no other thread runs): its own range front to back, then thread 1's
    range from the back, then thread 2's."""
    words = new_ranges(10, 3)
    assert words.shape == (3 * LINE,)
    assert [(int(w) & 0xFFFFFFFF, int(w) >> 32) for w in words[::LINE]] == [(0, 3), (3, 6), (6, 10)]
    cursor = np.zeros(1, np.int64)
    order = []
    while (i := next_item(words, 0, cursor)) >= 0:
        order.append(i)
    assert order == [0, 1, 2, 5, 4, 3, 9, 8, 7, 6]
    assert next_item(words, 1, np.zeros(1, np.int64)) == -1  # nothing left for a late thread
