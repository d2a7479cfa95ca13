"""waste.jit: compile options and the process's BLAS thread count."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from waste import jit
from waste.cpu import int8_isa
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


@pytest.mark.parametrize("value", ["0", "\u00b2"])  # "²" passes str.isdigit(), not int()
def test_bad_blas_threads_is_a_one_line_cli_error(value: str) -> None:
    env = dict(os.environ, **{BLAS_THREADS_ENV: value})
    code = "from waste.cli import main; raise SystemExit(main(['plan', 'tiny']))"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip() == f"waste: error: WASTE_BLAS_THREADS={value!r}: expected a positive number of threads"


@pytest.mark.parametrize("value", ["0", "abc", "-2", "\u00b2"])
def test_bad_numba_threads_is_a_one_line_cli_error(value: str) -> None:
    env = dict(os.environ, NUMBA_NUM_THREADS=value)
    code = "from waste.cli import main; raise SystemExit(main(['plan', 'tiny']))"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip() == f"waste: error: NUMBA_NUM_THREADS={value!r}: expected a positive number of threads"


def test_kernels_cache_below_a_directory_named_by_the_sources() -> None:
    @jit.kernel
    def triple(x):
        return 3 * x

    assert triple(2) == 6
    # keyed on the integer products' lowering too: a kernel compiled with AMX tiles must not be
    # loaded by a process that may not use them (WASTE_AMX=0, tests/test_cpu.py)
    assert jit.CACHE_DIR.name == f"waste-{jit.source_digest()}-{int8_isa()}"
    assert Path(triple._cache._cache_path).is_relative_to(jit.CACHE_DIR)


def test_an_edited_callee_in_another_file_is_not_served_stale(tmp_path) -> None:  # noqa: ANN001
    """Numba alone checks a cached caller against its own file only, and kept running the old
    code of a callee in an edited file (10 after the callee changed to return 2)."""
    package = tmp_path / "copy" / "waste"
    shutil.copytree(jit.PACKAGE_DIR, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "probe_callee.py").write_text("from waste.jit import kernel\n\n@kernel\ndef one():\n    return 1\n")
    (package / "probe_caller.py").write_text(
        "from waste.jit import kernel\nfrom waste.probe_callee import one\n\n"
        "@kernel\ndef ten_times():\n    return 10 * one()\n")
    env = {**os.environ, "PYTHONPATH": str(package.parent), "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    code = "from waste.probe_caller import ten_times; from waste.probe_callee import one; print(ten_times(), one())"

    def run() -> str:
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip()

    assert run() == "10 1"
    assert run() == "10 1"  # from the cache
    callee = package / "probe_callee.py"
    callee.write_text(callee.read_text().replace("return 1", "return 2"))
    assert run() == "20 2"
    assert len(list((tmp_path / "cache").glob("waste-*"))) == 2


def test_old_cache_directories_are_pruned(tmp_path) -> None:  # noqa: ANN001
    for age in range(6):
        old = tmp_path / f"waste-old{age}"
        old.mkdir()
        os.utime(old, (1e9 - age, 1e9 - age))
    (tmp_path / "other").mkdir()
    jit._prepare_cache(tmp_path / "waste-now")
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == sorted(["other", "waste-now", *[f"waste-old{age}" for age in range(jit.KEPT_SOURCE_VERSIONS)]])


def test_num_threads_is_numbas_count_and_follows_set_num_threads() -> None:
    import numba

    assert jit.num_threads() == numba.get_num_threads()
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        assert jit.num_threads() == 1
    finally:
        numba.set_num_threads(before)
    assert jit.num_threads() == before


def _libgomp_spin_count(env_value: str | None) -> tuple[str | None, str]:
    """(GOMP_SPINCOUNT as libgomp read it when waste.jit started the pool, None where Numba's
    threads are not libgomp's; GOMP_SPINCOUNT in os.environ afterwards) in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != jit.SPIN_COUNT_ENV}
    env["OMP_DISPLAY_ENV"] = "verbose"  # libgomp prints its settings to stderr as it loads
    if env_value is not None:
        env[jit.SPIN_COUNT_ENV] = env_value
    code = "import os, waste.jit\nprint(os.environ.get('GOMP_SPINCOUNT'))"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    read = [line.split("=", 1)[1].strip().strip("'") for line in run.stderr.splitlines()
            if line.strip().startswith("GOMP_SPINCOUNT =")]
    return (read[0] if read else None), run.stdout.strip()


def test_libgomp_workers_spin_briefly_unless_the_user_says() -> None:
    import numba

    jit.num_threads()
    maps = Path("/proc/self/maps")
    if numba.threading_layer() != "omp" or not maps.is_file() or "libgomp" not in maps.read_text():
        return  # another threading layer: no libgomp spin count to set
    assert _libgomp_spin_count(None) == (str(jit.SPIN_COUNT), "None")  # set for libgomp, gone from the environment
    assert _libgomp_spin_count("777") == ("777", "777")  # the user's is kept


def test_compile_time_counts_compiling_only() -> None:
    """A kernel compiled inside the block counts; calling it again (compiled) adds nothing."""
    import numba

    with jit.compile_time() as first:
        @numba.njit(cache=False)
        def fresh(x):
            return 3 * x + 1

        assert fresh(2) == 7
    with jit.compile_time() as again:
        assert fresh(3) == 10
    assert first[0] > 0.0 and again[0] == 0.0


_FORWARD = """
import sys
import numpy as np
from waste.container import open_container
from waste.engine.model import Model
out = {}
CHUNKS = [int(c) for c in sys.argv[2].split(",")]
for path in sys.argv[3:]:
    with open_container(path) as c:
        model = Model(c)
        prompt = np.random.default_rng(1).integers(0, c.config.vocab_size, 90)
        for chunk in CHUNKS:  # one pass, and the short tiles and single tokens of small chunks
            session = model.new_session(capacity=100)
            key = f"{path}:chunk{chunk}"
            out[key + ":prefill"] = model.prefill(session, prompt, chunk=chunk)
            token = int(np.argmax(out[key + ":prefill"][-1]))
            for step in range(3):
                out[key + f":decode{step}"] = model.decode(session, token)
                token = int(np.argmax(out[key + f":decode{step}"]))
np.savez(sys.argv[1], **out)
"""


def test_kernels_compiled_here_and_loaded_from_the_cache_give_the_same_bits(tmp_path) -> None:  # noqa: ANN001
    """Models' logits, prompt (in one pass and in chunks of 7) and decode, in every product format,
    from kernels compiled in the process (an empty cache) and from the same kernels loaded from
    Numba's cache, bit for bit (see FIXED_ORDER_FASTMATH). MLA prefill's online softmax let LLVM
    reorder its running sum, and a fresh compile and the cached code then differed by an ulp past
    the first 64-key block; through the MoE's routing, later tokens differed in K3 runs."""
    waste = [sys.executable, "-m", "waste.cli"]
    containers = []
    # Every product format: q8g trunk with MXFP4 experts, q4g, f32, bf16 (through convert).
    for preset, quant in (("k3-tiny", "q8"), ("tiny", "q4"), ("tiny", "f32")):
        out = tmp_path / f"{preset}-{quant}.waste"
        assert subprocess.run([*waste, "synth", preset, str(out), "--quant", quant, "--quiet"],
                              capture_output=True, text=True, timeout=300).returncode == 0
        containers.append(str(out))
    checkpoint, out = tmp_path / "k3-tiny-bf16", tmp_path / "k3-tiny-bf16.waste"
    for command in (["synth", "k3-tiny", str(checkpoint)], ["convert", str(checkpoint), str(out), "--quant", "bf16",
                                                             "--quiet"]):
        assert subprocess.run([*waste, *command], capture_output=True, text=True, timeout=300).returncode == 0
    containers.append(str(out))
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    runs = []
    # The cached run takes the chunkings in the other order: which kernel a process loads first
    # decides which copy of a callee runs (FIXED_ORDER_FASTMATH), so the bits must not depend on it.
    for name, chunks in (("compiled", "256,7"), ("cached", "7,256")):
        result = tmp_path / f"{name}.npz"
        run = subprocess.run([sys.executable, "-c", _FORWARD, str(result), chunks, *containers], env=env,
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stderr[-2000:]
        runs.append(np.load(result))
    assert any((tmp_path / "cache").rglob("*.nbi"))  # the second run had a cache to load
    for key in runs[0].files:
        np.testing.assert_array_equal(runs[0][key], runs[1][key], err_msg=key)
