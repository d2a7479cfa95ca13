"""Helpers shared by the benchmarks: the cached `mini` containers, the machine's copy bandwidth,
page-cache dropping, fixed-width tables and atomic JSON results.

The benchmarks import this as `common` (they run as scripts, so bench/ is on sys.path).
"""

from __future__ import annotations

import datetime
import json
import mmap
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numba
import numpy as np

from waste.container import ContainerError, open_container
from waste.container.convert import convert
from waste.jit import num_threads
from waste.synth import synthesize

BENCH_DIR = Path(__file__).resolve().parent
CACHE_DIR = BENCH_DIR / ".cache"
RESULTS_DIR = BENCH_DIR / "results"


def mini_container(quant: str, cache_dir: Path = CACHE_DIR, *, preset: str = "mini", seed: int = 0) -> Path:
    """A `preset` container in scheme `quant` under cache_dir, built once and reused.

    The random checkpoint is synthesised once (bf16, `preset-s{seed}-hf`) and converted per
    scheme (`preset-s{seed}-{quant}.waste`). A cached container the reader refuses (an older
    format version, a damaged file) is rebuilt.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = cache_dir / f"{preset}-s{seed}-{quant}.waste"
    if (out / "manifest.json").is_file():
        try:
            open_container(out).close()
            return out
        except ContainerError as e:
            print(f"rebuilding {out}: {e}", file=sys.stderr)
    hf = cache_dir / f"{preset}-s{seed}-hf"
    if not (hf / "model.safetensors.index.json").is_file():
        t0 = time.perf_counter()
        synthesize(preset, hf, seed=seed, force=True)
        print(f"synthesised {hf} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    t0 = time.perf_counter()
    convert(hf, out, quant=quant, force=True, progress=False)
    print(f"converted {out} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def sequential_read(path: Path, *, direct: bool = False, block: int = 8 << 20) -> dict[str, Any]:
    """Read `path` start to end in `block`-byte reads, after dropping it from the page cache;
    with O_DIRECT when `direct` (into a page-aligned buffer). The baseline for the expert
    store's reads: {bytes, seconds, gbps, io_mode, cache_dropped}."""
    dropped = drop_page_cache(path)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    total = 0
    fd = os.open(path, flags)
    try:
        t0 = time.perf_counter()
        while True:
            got = os.preadv(fd, [buf], total)
            if got == 0:
                break
            total += got
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
    return {"bytes": total, "seconds": seconds, "gbps": total / seconds / 1e9,
            "io_mode": "direct" if direct else "buffered", "cache_dropped": dropped}


def drop_page_cache(path: Path, *, whole_machine: bool = False) -> str:
    """Evict `path` from the page cache as far as this process may; says what was done.

    posix_fadvise(DONTNEED) drops the file's clean pages for any user. Only when asked
    (`whole_machine`), and only as root, 3 goes to /proc/sys/vm/drop_caches, which drops every
    file's pages on the machine: other jobs' included, so never by default.
    """
    done = []
    try:
        os.sync()
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            done.append("fadvise")
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
    if whole_machine:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            done.append("drop_caches")
        except OSError:
            pass
    return "+".join(done) or "none"


def machine_info() -> dict[str, Any]:
    """CPU model, core count, Numba threads and library versions."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "numba_threads": num_threads(), "numba": numba.__version__,
            "numpy": np.__version__, "python": platform.python_version(), "load_average": os.getloadavg(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def best_seconds(fn: Callable[[], object], rounds: int, settle_s: float = 0.0) -> float:
    """Best wall time of `rounds` calls of fn, back to back unless settle_s > 0 (after a pause
    the quantiser measured 1.3-1.5 ns/weight instead of 0.8-0.9, docs/QUANT.md)."""
    best = float("inf")
    for _ in range(rounds):
        time.sleep(settle_s)
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], floats: str = ".2f") -> str:
    """A fixed-width text table: first column left-aligned, the rest right-aligned; floats
    formatted with `floats`, None printed as '-'."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return "nan" if np.isnan(v) else format(v, floats)
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return " ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths,
                                                                                           strict=True)))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in text)])


def write_json(path: Path, obj: Any) -> None:
    """Write obj as indented JSON to a temporary name beside `path`, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj, indent=1, default=_jsonable) + "\n")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    print(f"wrote {path}")


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, Path):
        return str(v)
    raise TypeError(f"not JSON serialisable: {type(v).__name__}")
