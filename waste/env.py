"""Settings waste reads from the environment, parsed in one place without importing Numba, so
the CLI can refuse a bad value before any work starts (kernels apply them when imported)."""

from __future__ import annotations

import os
from pathlib import Path

from waste.errors import WasteError

BLAS_THREADS_ENV = "WASTE_BLAS_THREADS"


def _is_count(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes "²", which int() then refuses."""
    return text.isascii() and text.isdigit()


def blas_threads() -> int:
    """Threads BLAS may use (default 1, see waste/jit.py); a value that is not a positive integer
    is a WasteError naming the variable."""
    value = os.environ.get(BLAS_THREADS_ENV, "1")
    if not _is_count(value) or int(value) < 1:
        raise WasteError(f"{BLAS_THREADS_ENV}={value!r}: expected a positive number of threads")
    return int(value)


NUMBA_THREADS_ENV = "NUMBA_NUM_THREADS"


def check_numba_threads() -> None:
    """A WasteError naming NUMBA_NUM_THREADS unless it is unset, empty or a positive integer (Numba
    itself stops with a traceback at 0, and warns and ignores text)."""
    value = os.environ.get(NUMBA_THREADS_ENV, "")
    if value and (not _is_count(value.strip()) or int(value) < 1):
        raise WasteError(f"{NUMBA_THREADS_ENV}={value!r}: expected a positive number of threads")


def user_cache_home() -> Path:
    """waste's directory under $XDG_CACHE_HOME (default ~/.cache): machine figures, notebooks'
    models and, unless NUMBA_CACHE_DIR says otherwise, compiled kernels live below it."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "waste"
