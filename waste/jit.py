"""The one place where Numba compilation options are set.

Every kernel in waste is compiled through `kernel` (serial leaf kernels) or
`parallel_kernel` (outer drivers that use `prange`), so caching, fast-math and the
error model are decided here once. `cache=True` keeps compiled code on disk
(`kernel_cache_dir`), so tests and notebooks do not recompile on every run; a fresh
clone simply compiles once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numba
from numba.core.event import install_timer
from numba.np.ufunc.parallel import _launch_threads
from threadpoolctl import threadpool_limits

from waste.cpu import int8_isa
from waste.env import blas_threads, user_cache_home

F = TypeVar("F", bound=Callable[..., Any])

# Reassociation and contraction let LLVM vectorise reductions and fuse multiply-adds.
# No 'nnan'/'ninf': kernels must propagate NaN so NaN-filled test buffers fail loudly,
# and no 'afn': exp/log keep full accuracy (the decay gates sit in exponents).
FASTMATH = frozenset({"reassoc", "contract", "nsz", "arcp"})

# Numba 0.68 (seen 2026-12-05 on Zen 4): float code that one kernel reaches in another library (a
# @kernel it calls and LLVM does not inline, or a prange body, which Numba compiles as a function
# of its own) can run in other bits in the process that compiled it than in a process that loads
# it from the cache (an ulp; through a MoE's routing, other tokens later in a K3 run). The
# caller's cached object holds a weak copy of the callee, optimised a second time inside the
# caller's module; the compiling process had the callee's own code loaded first and runs that,
# and so does any process that loads the callee before the caller. Where the second pass changes
# the order of a float sum (a vectorised reduction's remainder under 'reassoc', a multiply-add
# fused in one copy only), the bits differ. So sums reached that way run without "reassoc" in
# fixed lanes, which vectorise without licence to reorder (`mla._softmax_step`,
# `norm._rms_norm_row`), and the per-head product, whose prange body differed, calls a @kernel
# that does not (`mla._head_times`). tests/test_jit.py holds models' logits in each format,
# compiled and cached and loaded in another order, to the same bits.
FIXED_ORDER_FASTMATH = FASTMATH - {"reassoc"}

COMMON_OPTIONS: dict[str, Any] = {
    "cache": True,
    "nogil": True,
    "fastmath": set(FASTMATH),
    # Division by zero gives inf/nan as in NumPy instead of raising inside kernels.
    "error_model": "numpy",
}

prange = numba.prange

# waste's parallelism is Numba's. OpenBLAS's worker threads keep spinning after each call and
# slow the Numba kernels that follow on the same cores: on `mini` in f32, decode ran 10.5 tok/s
# with two BLAS threads and 22.8 with one (bench/engine.py); an MLA prefill through BLAS made
# the whole prefill 3x slower. So BLAS runs on one thread, unless WASTE_BLAS_THREADS says
# otherwise (for the whole process, numpy included, once waste's kernels are imported).
threadpool_limits(blas_threads(), user_api="blas")

# How long libgomp's workers (Numba's OpenMP threading layer) spin after a parallel region before
# they sleep; libgomp reads GOMP_SPINCOUNT once, when it loads. Its default, 300000 spins, kept a
# worker busy 10 ms after every region here (2-core Zen 5 guest, 2026-12-03): while a prefill or a
# decode step waits for expert reads, that worker took a core from the reader threads. 10000 spins
# (0.5 ms): the cold 512-token prefill of the 48B q4 container from disk (bench/scale.py, three
# alternating pairs) took 17 s of user CPU instead of 36-37 and ran 9.7-12.3 tok/s against
# 10.0-11.4 (its ~40 s of system CPU, the cache's fresh memory, swings as much); its decode and
# `mini`'s in-memory decode (regions microseconds apart) did not change. Sleeping at once
# (OMP_WAIT_POLICY=passive) made a `mini` decode step 1.8x slower.
SPIN_COUNT = 10000
SPIN_COUNT_ENV = "GOMP_SPINCOUNT"


def _start_threads() -> None:
    """Start Numba's thread pool now, libgomp spinning SPIN_COUNT times unless the user set
    GOMP_SPINCOUNT; the variable then leaves the environment again, so child processes (llama.cpp
    in bench/peer.py, which has OpenMP threads of its own) get the user's."""
    if SPIN_COUNT_ENV in os.environ:
        _launch_threads()
        return
    os.environ[SPIN_COUNT_ENV] = str(SPIN_COUNT)
    try:
        _launch_threads()
    finally:
        del os.environ[SPIN_COUNT_ENV]


_start_threads()


PACKAGE_DIR = Path(__file__).resolve().parent
# Cache directories of other source versions kept beside the current one (older ones are removed).
KEPT_SOURCE_VERSIONS = 3


def source_digest(package_dir: Path = PACKAGE_DIR) -> str:
    """A digest of every Python source of the package (paths and bytes)."""
    digest = hashlib.sha256()
    for path in sorted(package_dir.rglob("*.py")):
        for part in (path.relative_to(package_dir).as_posix().encode(), path.read_bytes()):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return digest.hexdigest()[:20]


def kernel_cache_dir() -> Path:
    """Where compiled kernels are cached: $NUMBA_CACHE_DIR (else waste's user cache) / numba,
    one directory per version of waste's sources.

    Numba checks a cached function against its own file's timestamp only, so a caller whose
    file did not change kept the machine code it had inlined from a callee in a file that did
    (after an update, a caller ran the old callee: a stale kernel and silently other bits).
    Keying the directory on every source's bytes makes any change compile afresh. It is keyed
    on the integer products' lowering too (`waste.cpu.int8_isa`): Numba keys a kernel on the
    CPU's features, which stay the same when WASTE_AMX=0 or Linux's refusal takes AMX away, and
    a kernel compiled with AMX tiles would then be loaded and stop the process at its first tile."""
    base = Path(os.environ.get("NUMBA_CACHE_DIR") or user_cache_home() / "numba")
    return base / f"waste-{source_digest()}-{int8_isa()}"


def _prepare_cache(current: Path) -> None:
    """Create `current`, mark it the most recently used, and remove the cache directories of all
    but the KEPT_SOURCE_VERSIONS most recently used other source versions. Where it cannot be
    written, Numba caches elsewhere (next to the sources or in its own user directory)."""
    try:
        current.mkdir(parents=True, exist_ok=True)
        os.utime(current)
    except OSError:
        return
    others = sorted((d for d in current.parent.glob("waste-*") if d.is_dir() and d != current),
                    key=lambda d: d.stat().st_mtime, reverse=True)
    for old in others[KEPT_SOURCE_VERSIONS:]:
        shutil.rmtree(old, ignore_errors=True)


CACHE_DIR = kernel_cache_dir()
_prepare_cache(CACHE_DIR)


def kernel(fn: F | None = None, **overrides: Any) -> Any:
    """Compile a serial kernel: `@kernel` or `@kernel(signature=...)`."""
    options = {**COMMON_OPTIONS, **overrides}
    signature = options.pop("signature", None)

    def wrap(f: F) -> F:
        # Numba picks a function's cache directory when it is decorated, from its config.
        numba.config.CACHE_DIR = str(CACHE_DIR)
        if signature is None:
            return numba.njit(**options)(f)
        return numba.njit(signature, **options)(f)

    return wrap(fn) if fn is not None else wrap


def parallel_kernel(fn: F | None = None, **overrides: Any) -> Any:
    """Compile an outer driver whose `prange` loops run on all cores."""
    return kernel(fn, parallel=True, **overrides)


@contextmanager
def compile_time() -> Iterator[list[float]]:
    """Yields a one-element list that holds, once the block has run, the seconds Numba spent in it
    compiling kernels (loading them from the cache is not compiling): what a run's timings owe
    to the first use of kernels after an update."""
    spent = [0.0]
    with install_timer("numba:compile", lambda seconds: spent.__setitem__(0, seconds)):
        yield spent


def num_threads() -> int:
    """Threads Numba's parallel loops use on this thread (NUMBA_NUM_THREADS or all cores, or
    what numba.set_num_threads set): numba.get_num_threads(), without the lock that function
    takes on every call to see whether the pool is up (0.7 against 0.1 us; a decode step asks
    once per kernel call, `waste.kernels.steal`)."""
    if _thread_count:
        return _thread_count[0]()
    numba.get_num_threads()  # starts the pool, which binds Numba's C function
    # Where a Numba version lacks it, the public function.
    _thread_count.append(getattr(numba.np.ufunc.parallel, "_get_num_threads", numba.get_num_threads))
    return _thread_count[0]()


_thread_count: list[Callable[[], int]] = []
