"""waste.jit: compile options and the process's BLAS thread count."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
from threadpoolctl import threadpool_info

from waste import jit
from waste.env import BLAS_THREADS_ENV, blas_threads


def _blas_threads_in(env_value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != BLAS_THREADS_ENV}
    if env_value is not None:
        env[BLAS_THREADS_ENV] = env_value
    code = ("import waste.jit\nfrom threadpoolctl import threadpool_info\n"
            "print(sorted({p['num_threads'] for p in threadpool_info() if p['user_api'] == 'blas'}))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_blas_runs_on_one_thread_unless_asked() -> None:
    assert np.ones(1) is not None  # numpy (and its BLAS) loaded, as for every kernel user
    blas = [p for p in threadpool_info() if p["user_api"] == "blas"]
    assert blas, "numpy's BLAS not found by threadpoolctl"
    assert {p["num_threads"] for p in blas} == {blas_threads()}
    assert _blas_threads_in(None).stdout.strip() == "[1]"
    assert _blas_threads_in("2").stdout.strip() == "[2]"
    bad = _blas_threads_in("lots")
    assert bad.returncode != 0 and "WASTE_BLAS_THREADS='lots': expected a positive number of threads" in bad.stderr


def test_kernel_options_are_shared() -> None:
    @jit.kernel
    def double(x):
        return 2 * x

    assert double(21) == 42
    assert type(double._cache).__name__ != "NullCache"  # compiled code is kept on disk
    assert double.targetoptions["fastmath"] == jit.FASTMATH and double.targetoptions["nogil"]


def test_bad_blas_threads_is_a_one_line_cli_error() -> None:
    env = dict(os.environ, **{BLAS_THREADS_ENV: "0"})
    code = "from waste.cli import main; raise SystemExit(main(['plan', 'tiny']))"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip() == "waste: error: WASTE_BLAS_THREADS='0': expected a positive number of threads"
