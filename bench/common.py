"""Helpers shared by the benchmarks: the cached `mini` containers, the machine's copy bandwidth,
page-cache dropping, equal thread counts for kernel and baseline, working sets larger than the
last-level cache, fixed-width tables and atomic JSON results.

Fair ratios. Importing waste pins NumPy's BLAS to one thread (waste.jit), while Numba kernels
use every core. A ratio is only reported between a kernel and a baseline run at the same
thread count: `thread_counts()` gives (1, all cores) and `at_threads(n)` sets both Numba's
and BLAS's threads for the timings inside it. A product timed over and over on one matrix
keeps its weights in the last-level cache; `rotation(make, nbytes)` builds enough copies to
exceed it (`rotation_bytes()`), and `cycle(calls)` steps through them, one per call.

The benchmarks import this as `common` (they run as scripts, so bench/ is on sys.path).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from waste.analysis.machine import measure_disk
from waste.container import ContainerError, open_container
from waste.container.convert import convert
from waste.fileio import write_atomic
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


def sequential_read(path: Path, *, direct: bool = False, block: int = 8 << 20,
                    limit: int | None = None) -> dict[str, Any]:
    """Read `path` start to end (or its first `limit` bytes) in `block`-byte reads, after
    dropping it from the page cache; with O_DIRECT when `direct` (into a page-aligned buffer).
    The baseline for the expert store's reads (`waste.analysis.machine.measure_disk`, the read
    `waste plan` measures the disk with): {bytes, seconds, gbps, io_mode, cache_dropped}."""
    dropped = drop_page_cache(path)
    return {**measure_disk(path, limit, direct=direct, block=block), "cache_dropped": dropped}


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


def fresh_memory_cost(total: int = 4 << 30, piece: int = 256 << 20) -> list[float]:
    """System CPU seconds per GB to fault in `total` bytes of new anonymous memory, held in maps of
    `piece` bytes populated at the map call (MAP_POPULATE), one figure per GB in order. On a
    bare machine this is the kernel zeroing pages (a few tenths of a second per GB); on a VM whose
    host takes freed memory back, the later GBs also pay the host's faults."""
    import mmap
    import resource

    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    held, costs, per_gb = [], [], max(1, (1 << 30) // piece)
    try:
        while len(held) * piece < total:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
            for _ in range(per_gb):
                held.append(mmap.mmap(-1, piece, flags=flags))
            costs.append((resource.getrusage(resource.RUSAGE_SELF).ru_stime - before) * 1e9 / (per_gb * piece))
    finally:
        for m in held:
            m.close()
    return costs


def thread_cpu_seconds() -> dict[int, tuple[float, float]]:
    """{native thread id: (user, system) CPU seconds} of this process's threads so far, from
    /proc/self/task (Linux; empty elsewhere): what `thread_cpu_split` takes apart."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[int, tuple[float, float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (int(fields[11]) / tick, int(fields[12]) / tick)  # utime, stime
    return out


def thread_cpu_split(before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]],
                     groups: dict[str, Callable[[int, str], bool]]) -> dict[str, dict[str, float]]:
    """CPU seconds (user, system) each group of threads used between two `thread_cpu_seconds`
    snapshots; a thread goes to the first group whose test (native id, Python thread name or "")
    accepts it, else to "other" (threads Python did not start: Numba's workers)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    split: dict[str, dict[str, float]] = {}
    for tid, (user, system) in after.items():
        user0, system0 = before.get(tid, (0.0, 0.0))
        name = names.get(tid, "")
        group = next((g for g, test in groups.items() if test(tid, name)), "other")
        acc = split.setdefault(group, {"user_s": 0.0, "system_s": 0.0, "threads": 0})
        acc["user_s"] += user - user0
        acc["system_s"] += system - system0
        acc["threads"] += 1
    return split


def thread_counts() -> tuple[int, ...]:
    """The thread counts every ratio is reported at: one, and all cores (once on a 1-core machine)."""
    return tuple(sorted({1, num_threads()}))


@contextlib.contextmanager
def at_threads(n: int) -> Iterator[None]:
    """Numba kernels and NumPy's BLAS both on n threads inside the block (restored after)."""
    before = numba.get_num_threads()
    numba.set_num_threads(n)
    try:
        with threadpool_limits(n, user_api="blas"):
            yield
    finally:
        numba.set_num_threads(before)


def l3_bytes() -> int:
    """The largest CPU cache in bytes (sysfs; 32 MiB when unreadable)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


# A guest's sysfs gives one cache slice, not what the process gets of the host's: an AMD EPYC
# guest reporting 32 MiB read 64 MiB at 54 GB/s and 128 MiB at 42 GB/s, against 37 GB/s from
# 256 MiB up (bench/memory.py), so a working set of twice the reported size was half served
# from cache. The floor is where that curve had flattened.
ROTATION_FLOOR_BYTES = 256 << 20


def rotation_bytes() -> int:
    """Bytes a rotation spans: four times the reported last-level cache, and at least the floor."""
    return max(4 * l3_bytes(), ROTATION_FLOOR_BYTES)


def rotation(make: Callable[[int], Any], nbytes: int) -> list[Any]:
    """Copies make(0), make(1), ... of an operand of `nbytes` each, together more than
    `rotation_bytes()`, so that stepping through them reads each from memory, not from cache
    (one copy when one alone is that large)."""
    return [make(i) for i in range(max(1, -(-rotation_bytes() // max(1, nbytes))))]


def cycle(calls: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs the next of `calls` each time (round robin)."""
    state = {"i": 0}

    def step() -> object:
        i = state["i"]
        state["i"] = (i + 1) % len(calls)
        return calls[i]()

    return step


def describe_exit(returncode: int) -> str:
    """How a child process ended, for a one-line failure: its exit code, or the signal that killed
    it (SIGKILL is what the kernel's out-of-memory killer sends, and leaves no message)."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    hint = " (the out-of-memory killer's signal: was another large process running?)" if name == "SIGKILL" else ""
    return f"killed by {name}{hint}"


def uptime() -> str:
    """`uptime`'s line (the load on the shared machine while a benchmark ran)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


# The virtio device id of a memory balloon, and the feature bit of its free page reporting
# (VIRTIO_BALLOON_F_REPORTING) in the device's features string, bit 0 first.
VIRTIO_BALLOON_DEVICE = "0x0005"
BALLOON_REPORTING_BIT = 5


def free_page_reporting(devices: Path = Path("/sys/bus/virtio/devices")) -> bool | None:
    """Whether this guest's virtio balloon hands memory the guest frees back to its host (free
    page reporting), None without a balloon. Where it does, new memory costs a process the
    host's faults as well once what it takes was freed some time before: on the Intel Xeon guest
    of 2026-12-04 (docs/MEASURED.md), 0.4 s of system CPU per GB when retaken at once, 1.7 after 30 s, so
    `fresh_memory_cost` (memory just freed, often) can understate what a cold run pays."""
    for device in sorted(devices.glob("*")):
        try:
            if (device / "device").read_text().strip() != VIRTIO_BALLOON_DEVICE:
                continue
            features = (device / "features").read_text().strip()
        except OSError:
            continue
        return features[BALLOON_REPORTING_BIT:BALLOON_REPORTING_BIT + 1] == "1"
    return None


def busy_fraction(seconds: float = 1.0, stat: Path = Path("/proc/stat")) -> float | None:
    """The share of this machine's CPU time other work used over the next `seconds` (all CPUs,
    from /proc/stat's first line: 1 - idle and iowait over the total), or None where there is no
    /proc/stat. Unlike the load average, which decays over minutes, it says whether the cores are
    busy now, not whether a run just before was."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in stat.read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields[:8]), fields[3] + fields[4]  # user..steal, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def machine_info() -> dict[str, Any]:
    """CPU model, core count, Numba threads, library versions, and whether freed memory goes
    back to the host (`free_page_reporting`)."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "numba_threads": num_threads(), "numba": numba.__version__,
            "numpy": np.__version__, "python": platform.python_version(), "load_average": os.getloadavg(),
            "uptime": uptime(), "l3_bytes": l3_bytes(), "free_page_reporting": free_page_reporting(),
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
    text = json.dumps(obj, indent=1, default=_jsonable) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))
    print(f"wrote {path}")


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, Path):
        return str(v)
    raise TypeError(f"not JSON serialisable: {type(v).__name__}")
