"""Work items shared out between threads in one parallel region: each thread takes its own
contiguous range in order, then takes what is left of the others' ranges from their ends.

A decode step's products run as `prange` loops over work items (row blocks). Numba splits a
prange statically, so a thread whose half DRAM served more slowly keeps the other waiting at
the region's end. Claiming items one at a time from one shared counter balanced that but
measured 12-16% slower (both threads read every other item, so neither streamed memory in
order, and the counter's cache line moved between the cores at every claim). Here each thread
owns a range and claims its items front to back with an atomic add on a word only it touches
until it is done; then it takes items from the back of the other ranges, one atomic add each,
so only the last few items of a region are contended (`next_item`). An item is computed by
the same code whichever thread takes it: results do not depend on the split.

Usage inside a parallel kernel, with `threads` from the caller (numba.get_num_threads(): read
in compiled code it would keep the kernel out of the cache):

    words = new_ranges(n, threads)
    for t in prange(threads):
        cursor = np.zeros(1, np.int64)
        i = next_item(words, t, cursor)
        while i >= 0:
            ... item i ...
            i = next_item(words, t, cursor)
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from waste.jit import kernel

LINE = 8  # int64 words per cache line: each range's word on a line of its own
_BACK = np.int64(1) << 32  # a range's word: its front item in the low 32 bits, its end in the high 32
_LOW = np.int64(0xFFFFFFFF)


@intrinsic
def fetch_add(typingctx, words, index, value):
    """Atomically words[index] += value (sequentially consistent); returns the value before."""
    if not (isinstance(words, types.Array) and words.dtype == types.int64 and words.ndim == 1
            and isinstance(index, types.Integer) and isinstance(value, types.Integer)):
        return None
    sig = types.int64(words, index, value)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        i = context.cast(builder, args[1], signature.args[1], types.intp)
        v = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", builder.gep(array.data, [i]), v, "seq_cst")

    return sig, codegen


@intrinsic
def load_acquire(typingctx, words, index):
    """words[index], read atomically with acquire ordering (what the writer stored before its
    fetch_add is visible after this load sees that add)."""
    if not (isinstance(words, types.Array) and words.dtype == types.int64 and words.ndim == 1
            and isinstance(index, types.Integer)):
        return None
    sig = types.int64(words, index)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        i = context.cast(builder, args[1], signature.args[1], types.intp)
        return builder.load_atomic(builder.gep(array.data, [i]), "acquire", 8)

    return sig, codegen


_X86 = platform.machine().lower() in ("x86_64", "amd64")


@intrinsic
def spin_pause(typingctx):
    """x86's `pause` (tells the core it is spinning: the other hyperthread runs and leaving the
    loop costs no pipeline flush); nothing elsewhere."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        if _X86:
            pause = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                   "llvm.x86.sse2.pause")
            builder.call(pause, [])
        return context.get_dummy_value()

    return sig, codegen


@kernel
def wait_until(words, index, value):
    """Spin until words[index] >= value (a count of done items another thread adds to)."""
    while load_acquire(words, index) < value:
        spin_pause()


@kernel
def set_ranges(words, n):
    """Split n items into contiguous ranges, one per thread (words [threads * LINE]): the first
    n // threads or so to thread 0, and on."""
    threads = words.shape[0] // LINE
    for t in range(threads):
        words[t * LINE] = (n * t // threads) | ((n * (t + 1) // threads) << 32)


@kernel
def new_ranges(n, threads):
    """Words for n items split into `threads` contiguous ranges (`set_ranges`), one word per
    cache line."""
    words = np.zeros(max(1, threads) * LINE, np.int64)
    set_ranges(words, n)
    return words


@kernel
def next_item(words, t, cursor):
    """The next item for thread t, or -1 when every item is taken. cursor [1] int64, zero at the
    start of the region, is the thread's own: 0 while it takes its own range's front, then the
    offset of the range it takes back items of."""
    threads = words.shape[0] // LINE
    while cursor[0] < threads:
        if cursor[0] == 0:
            old = fetch_add(words, t * LINE, 1)
            front, end = old & _LOW, old >> 32
            if front < end:
                return front
        else:
            # A failed take leaves end below front: the range reads as empty from then on.
            old = fetch_add(words, ((t + cursor[0]) % threads) * LINE, -_BACK)
            front, end = old & _LOW, old >> 32
            if front < end:
                return end - 1
        cursor[0] += 1
    return -1
