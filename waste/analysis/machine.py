"""This machine's disk and memory bandwidths, for the decode bound `waste plan` predicts.

Measured once and cached in `machine.json` under `$WASTE_CACHE_DIR` (default
`~/.cache/waste`), so that a plan costs nothing the second time:

- disk: a sequential read of up to DISK_SAMPLE_BYTES of a container's experts.bin in 8 MiB
  reads, with O_DIRECT where the file system takes it (otherwise buffered, after evicting the
  file from the page cache), cached per file system (its device number); what the expert
  store's reads can reach at best on that disk;
- memory: `measure_memory`, the bytes per second the engine's own q8g matvec reads from a
  matrix of MEMORY_SAMPLE_BYTES on as many threads as Numba's kernels use: what a decode
  step's weight reads reach. (A copy, which counts bytes read plus written, said 47 GB/s on a
  Xeon whose kernels read 26: it made the decode bound of the 48B model 1.5x too high.)

`--disk-gbps` and `--mem-gbps` override either; `--measure` measures again. Every figure
carries where it came from, which `waste plan` prints. A disk figure from a read shorter than
MIN_CACHED_DISK_SAMPLE (a small container) is used for that plan only and never cached.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from waste.env import user_cache_home
from waste.errors import WasteError
from waste.fileio import write_atomic
from waste.units import MAX_GBPS

DISK_SAMPLE_BYTES = 1 << 30
DISK_BLOCK = 8 << 20
MIN_CACHED_DISK_SAMPLE = 256 << 20  # a shorter read (a small container) is used once, never cached
# Larger than any last-level cache seen here (a Xeon VM reports 480 MiB of L3): 256 MiB read at
# 57 GB/s from a 64 MiB matrix and 33 from 1 GiB there.
MEMORY_SAMPLE_BYTES = 1 << 30
CACHE_FILE = "machine.json"
# The cache's key for the memory figure; a cache from before it held a copy's speed under "memory".
MEMORY_KEY = "memory_read"
# Stands in a fresh measurement's source until the cache is written (`bandwidths`).
CACHE_NOTE = "<cache>"


@dataclass(frozen=True)
class Bandwidth:
    """One figure in decimal GB/s and where it came from."""

    gbps: float
    source: str  # e.g. "given (--disk-gbps)", "measured now: 1.0 GB of .../experts.bin, direct"


@dataclass(frozen=True)
class Bandwidths:
    disk: Bandwidth
    memory: Bandwidth

    def as_dict(self) -> dict[str, Any]:
        return {"disk_gbps": self.disk.gbps, "disk_source": self.disk.source, "mem_gbps": self.memory.gbps,
                "mem_source": self.memory.source}


def cache_path() -> Path:
    base = os.environ.get("WASTE_CACHE_DIR")
    if not base:
        base = user_cache_home()
    return Path(base) / CACHE_FILE


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, data: dict[str, Any]) -> str:
    """Write the cache; where a measurement now lives, for its source line. A cache that cannot be
    written only means measuring again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda f: f.write(json.dumps(data, indent=1).encode()))
    except OSError as e:
        return f"not cached: {path}: {e.strerror}"
    return f"cached in {path}"


def _device_key(path: Path) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def _cached(entry: Any, where: Path) -> Bandwidth | None:
    gbps = entry.get("gbps") if isinstance(entry, dict) else None
    if isinstance(gbps, (int, float)) and math.isfinite(gbps) and 0 < gbps <= MAX_GBPS:
        return Bandwidth(float(entry["gbps"]), f"measured {entry.get('when', '?')}: {entry.get('what', '?')}; "
                                               f"cached in {where}")
    return None


def measure_disk(path: Path, limit: int | None = DISK_SAMPLE_BYTES, *, direct: bool = True,
                 block: int = DISK_BLOCK) -> dict[str, Any]:
    """Sequential read of `path` from its start (up to `limit` bytes; None: all of it) in `block`
    byte reads, with O_DIRECT when `direct` and the file system takes it, else buffered after
    evicting the file from the page cache: {bytes, seconds, gbps, io_mode}."""
    flag = getattr(os, "O_DIRECT", 0) if direct else 0
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    try:
        try:
            fd, io_mode = os.open(path, os.O_RDONLY | flag), "direct" if flag else "buffered"
        except OSError:
            fd, io_mode = os.open(path, os.O_RDONLY), "buffered"
        try:
            if io_mode == "buffered":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages go; the read comes from disk
            total = 0
            t0 = time.perf_counter()
            while limit is None or total < limit:
                got = os.preadv(fd, [buf], total)
                if got == 0:
                    break
                total += got
            seconds = time.perf_counter() - t0
        finally:
            os.close(fd)
    except OSError as e:
        raise WasteError(f"measuring the disk with {path}: {e.strerror}") from None
    finally:
        buf.close()
    if total == 0 or seconds <= 0:
        raise WasteError(f"measuring the disk with {path}: nothing to read")
    return {"bytes": total, "seconds": seconds, "gbps": total / seconds / 1e9, "io_mode": io_mode}


def measure_memory(nbytes: int = MEMORY_SAMPLE_BYTES, rounds: int = 3) -> dict[str, Any]:
    """The best of `rounds` q8g matvecs (`waste.kernels.quant`, the decode's own kernel, on its
    threads) over a [N, 4096] matrix of about `nbytes`, counting the codes and scales read:
    {bytes, best_seconds, gbps}. The matrix repeats one quantised block of random rows (the
    kernel reads every byte whatever the values)."""
    import numpy as np

    from waste.kernels.quant import QMatrix, quantize

    block = quantize(np.random.default_rng(0).standard_normal((256, 4096)).astype(np.float32), "q8g")
    reps = max(1, nbytes // block.nbytes)
    qs, scales = (np.tile(block.buffers[b], (reps, 1, 1)) for b in ("qs", "scales"))
    matrix = QMatrix("q8g", (256 * reps, 4096), {"qs": qs, "scales": scales, "tscale": block.buffers["tscale"]})
    x = np.ones(4096, np.float32)
    matrix.matvec(x)  # compiles or loads the kernel, faults the pages in
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        matrix.matvec(x)
        best = min(best, time.perf_counter() - t0)
    read = int(qs.nbytes + scales.nbytes)
    return {"bytes": read, "best_seconds": best, "gbps": read / best / 1e9}


def bandwidths(*, disk_file: Path, disk_gbps: float | None = None, mem_gbps: float | None = None,
               measure: bool = False) -> Bandwidths:
    """The disk and memory bandwidths to plan with: given, else cached, else measured (the disk
    on `disk_file`, a container's experts.bin, and cached for its file system)."""
    path = cache_path()
    cache = _read_cache(path)
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    changed = False
    disks = cache.get("disks") if isinstance(cache.get("disks"), dict) else {}
    if disk_gbps is not None:
        disk = Bandwidth(disk_gbps, "given (--disk-gbps)")
    else:
        key = _device_key(disk_file)
        cached = None if measure else _cached(disks.get(key), path)
        if cached is None:
            m = measure_disk(disk_file)
            what = f"{m['bytes'] / 1e9:.2f} GB of {disk_file} read sequentially, {m['io_mode']}, device {key}"
            if m["bytes"] >= MIN_CACHED_DISK_SAMPLE:
                disks[key] = {"gbps": m["gbps"], "when": when, "what": what}
                cached, changed = Bandwidth(m["gbps"], f"measured now: {what}; {CACHE_NOTE}"), True
            else:
                cached = Bandwidth(m["gbps"], f"measured now: {what}; too short a read to cache or trust")
        disk = cached
    if mem_gbps is not None:
        memory = Bandwidth(mem_gbps, "given (--mem-gbps)")
    else:
        cached = None if measure else _cached(cache.get(MEMORY_KEY), path)
        if cached is None:
            from waste.jit import num_threads

            m = measure_memory(MEMORY_SAMPLE_BYTES)
            what = f"best of 3 q8g matvecs reading {m['bytes'] >> 20} MiB on {num_threads()} threads"
            cache[MEMORY_KEY] = {"gbps": m["gbps"], "when": when, "what": what}
            cached, changed = Bandwidth(m["gbps"], f"measured now: {what}; {CACHE_NOTE}"), True
        memory = cached
    if changed:
        note = _write_cache(path, {**cache, "disks": disks})
        disk, memory = (dataclasses.replace(b, source=b.source.replace(CACHE_NOTE, note)) for b in (disk, memory))
    return Bandwidths(disk, memory)
