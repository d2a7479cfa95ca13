"""The one place where Numba compilation options are set.

Every kernel in waste is compiled through `kernel` (serial leaf kernels) or
`parallel_kernel` (outer drivers that use `prange`), so caching, fast-math and the
error model are decided here once. `cache=True` keeps compiled code on disk next to
the module (`__pycache__`), so tests and notebooks do not recompile on every run;
a fresh clone simply compiles once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numba
from threadpoolctl import threadpool_limits

from waste.env import blas_threads

F = TypeVar("F", bound=Callable[..., Any])

# Reassociation and contraction let LLVM vectorise reductions and fuse multiply-adds.
# No 'nnan'/'ninf': kernels must propagate NaN so NaN-filled test buffers fail loudly,
# and no 'afn': exp/log keep full accuracy (the decay gates sit in exponents).
FASTMATH = frozenset({"reassoc", "contract", "nsz", "arcp"})

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


def kernel(fn: F | None = None, **overrides: Any) -> Any:
    """Compile a serial kernel: `@kernel` or `@kernel(signature=...)`."""
    options = {**COMMON_OPTIONS, **overrides}
    signature = options.pop("signature", None)

    def wrap(f: F) -> F:
        if signature is None:
            return numba.njit(**options)(f)
        return numba.njit(signature, **options)(f)

    return wrap(fn) if fn is not None else wrap


def parallel_kernel(fn: F | None = None, **overrides: Any) -> Any:
    """Compile an outer driver whose `prange` loops run on all cores."""
    return kernel(fn, parallel=True, **overrides)


def num_threads() -> int:
    """Threads Numba's parallel loops use (NUMBA_NUM_THREADS or all cores)."""
    return numba.get_num_threads()
