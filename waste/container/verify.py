"""`waste verify`: every byte of trunk.bin and experts.bin read once, at disk speed.

Each file is read start to end in large positional reads (VERIFY_BLOCK bytes, with O_DIRECT
where the file system takes it, so the check sees what is on the disk rather than a cached
copy, and a 27 GB read does not push everything else out of the page cache), one read ahead
of the checks on a second buffer so that reading and checking overlap. The file is described
as a list of spans that tile it in order, each a tensor (or expert part) with its CRC32C or a
stretch of padding that must be zero; a span may cross any number of reads, its CRC carried
from one to the next. Problems are collected, not raised: the caller decides.
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from waste.container.format import EXPERT_PARTS, EXPERTS, TRUNK, TRUNK_ALIGN, TensorEntry, crc32c
from waste.fileio import open_regular

VERIFY_BLOCK = 16 << 20  # bytes per read: large and sequential; a multiple of every O_DIRECT alignment


@dataclass(frozen=True)
class ValueRegion:
    """Bytes [start, end) of a file holding one buffer's values, each of which must be a number:
    `kind` is a float dtype name ("float32", "float16", "bfloat16") or "e8m0" (MXFP4 scales)."""

    start: int
    end: int
    kind: str
    problem: str


# The bits that make a value NaN or infinite: the exponent field all ones (E8M0 has only an exponent).
_NOT_A_NUMBER_BITS = {"float32": (np.uint32, 0x7F800000), "float16": (np.uint16, 0x7C00),
                      "bfloat16": (np.uint16, 0x7F80), "e8m0": (np.uint8, 0xFF)}
# Buffers whose integer dtype holds values (waste.qformat.buffer_layout): bfloat16 kept as uint16,
# MXFP4's E8M0 scales as uint8. Float dtypes are values by their dtype; other integers are codes.
_VALUES_IN_INTEGERS = {("bf16", "w"): "bfloat16", ("mxfp4", "scales"): "e8m0"}


def holds_non_number(piece: np.ndarray, kind: str) -> bool:
    """Whether the bytes `piece` (whole values of `kind`) hold a NaN or an infinity."""
    dtype, bits = _NOT_A_NUMBER_BITS[kind]
    values = piece.view(dtype)
    return bool(np.any(np.bitwise_and(values, bits) == bits))


def value_regions(entry: TensorEntry, base: int, what: str, where: str = "") -> tuple[ValueRegion, ...]:
    """The value-holding buffers of a tensor whose span starts at byte `base` of its file; `what`
    names the tensor in a problem, `where` is added after the buffer's name."""
    regions = []
    for b in entry.buffers:
        kind = b.dtype if b.dtype in ("float32", "float16") else _VALUES_IN_INTEGERS.get((entry.storage, b.name))
        if kind is not None and b.nbytes:
            problem = "the E8M0 NaN scale byte 255" if kind == "e8m0" else "NaN or infinite values"
            regions.append(ValueRegion(base + b.offset, base + b.offset + b.nbytes, kind,
                                       f"{what} holds {problem} (buffer {b.name!r}{where})"))
    return tuple(regions)


@dataclass(frozen=True)
class Span:
    """Bytes [start, end) of a file: a CRC32C span (`crc` set) or padding (`crc` None, must be zero).
    `problem` is the message when the check fails; `values` are the span's buffers whose values
    must be numbers."""

    start: int
    end: int
    crc: int | None
    problem: str
    values: tuple[ValueRegion, ...] = ()


@dataclass
class VerifyReport:
    """What `verify_files` found and how fast it read."""

    problems: list[str] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0
    io_modes: set[str] = field(default_factory=set)  # "direct" and/or "buffered"

    @property
    def gbps(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else float("nan")


def trunk_spans(container: Any) -> list[Span]:
    """trunk.bin as spans: every tensor with its CRC, the gaps between them as padding."""
    m = container._manifest
    path = container.trunk_path
    spans, pos = [], 0
    for e in sorted(m.tensors.values(), key=lambda e: e.offset):
        if e.offset > pos:
            spans.append(Span(pos, e.offset, None, f"{path}: nonzero padding in bytes {pos}..{e.offset} before tensor "
                                                   f"{e.name!r}"))
        spans.append(Span(e.offset, e.offset + e.nbytes, e.crc32c,
                          f"{path}: CRC mismatch in tensor {e.name!r} (bytes {e.offset}..{e.offset + e.nbytes})",
                          value_regions(e, e.offset, f"{path}: tensor {e.name!r}")))
        pos = e.offset + e.nbytes
    size = m.file_bytes[TRUNK]
    if size > pos:
        spans.append(Span(pos, size, None, f"{path}: nonzero padding after the last tensor (bytes {pos}..{size})"))
    return spans


def expert_spans(container: Any) -> list[Span]:
    """experts.bin as spans: each blob's parts with their CRCs, and the padding around them."""
    ex = container._manifest.experts
    path = container.experts_path
    spans = []
    for li, layer in enumerate(ex.layers):
        crcs = ex.crc32c[li].tolist()
        for e in range(ex.num_experts):
            base = (li * ex.num_experts + e) * ex.blob_bytes
            pos = 0
            for p, part in enumerate(ex.parts):
                if part.offset > pos:
                    spans.append(Span(base + pos, base + part.offset, None, f"{path}: nonzero padding before "
                                      f"{EXPERT_PARTS[p]} of expert {e}, layer {layer}"))
                name = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{part.name}.weight"
                spans.append(Span(base + part.offset, base + part.offset + part.nbytes, crcs[e][p],
                                  f"{path}: CRC mismatch in {name} (blob at byte {base})",
                                  value_regions(part, base + part.offset, f"{path}: {name}", f", blob at byte {base}")))
                pos = part.offset + part.nbytes
            if ex.blob_bytes > pos:
                spans.append(Span(base + pos, base + ex.blob_bytes, None,
                                  f"{path}: nonzero padding at the end of expert {e}, layer {layer}"))
    return spans


def _open(container: Any, name: str) -> tuple[int, str]:
    """A descriptor of one of the container's files, with O_DIRECT when the file system takes it."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return open_regular(name, os.O_RDONLY | direct, dir_fd=container.dir_fd), "direct"
        except OSError:
            pass  # EINVAL on a file system without O_DIRECT (tmpfs); any other failure, the plain open names
    return container.open_member(name), "buffered"


def _blocks(fd: int, size: int, io_mode: str, reopen: Callable[[], int]) -> Iterator[tuple[int, np.ndarray, str]]:
    """(offset, bytes, io mode) of the file's consecutive blocks; the next block is read in a
    thread while the caller checks this one. Stops early if the file ends before `size`."""
    buffers = [np.frombuffer(mmap.mmap(-1, VERIFY_BLOCK), np.uint8) for _ in range(2)]  # page-aligned
    state = {"fd": fd, "mode": io_mode}

    def read(offset: int, buf: np.ndarray) -> int:
        want = min(VERIFY_BLOCK, size - offset)
        if state["mode"] == "direct":
            want = VERIFY_BLOCK  # O_DIRECT lengths stay aligned; the read stops at the end of the file
        try:
            return os.preadv(state["fd"], [memoryview(buf)[:want]], offset)
        except OSError as e:
            if state["mode"] != "direct" or e.errno != errno.EINVAL:
                raise
            os.close(state["fd"])  # this file system refuses O_DIRECT reads after all: read buffered
            state["fd"], state["mode"] = reopen(), "buffered"
            return os.preadv(state["fd"], [memoryview(buf)[:min(VERIFY_BLOCK, size - offset)]], offset)

    try:
        with ThreadPoolExecutor(1, "waste-verify-read") as pool:
            offset, k = 0, 0
            pending = pool.submit(read, 0, buffers[0]) if size else None
            while pending is not None:
                got = min(pending.result(), size - offset)
                if offset + got < size:
                    got -= got % TRUNK_ALIGN  # a short read: blocks end between values, never inside one
                if got <= 0:
                    return
                nxt = offset + got
                pending = pool.submit(read, nxt, buffers[(k + 1) % 2]) if nxt < size else None
                yield offset, buffers[k % 2][:got], state["mode"]
                offset, k = nxt, k + 1
    finally:
        os.close(state["fd"])


def check_file(container: Any, name: str, spans: list[Span], report: VerifyReport,
               progress: Callable[[int], Any]) -> None:
    """Read one file of the container and check it against `spans`, adding to `report`."""
    size = spans[-1].end if spans else 0
    fd, first_mode = _open(container, name)
    i, crc, flagged, bad_values = 0, 0, False, False
    end = 0
    for offset, block, mode in _blocks(fd, size, first_mode, lambda: container.open_member(name)):
        end = offset + block.size
        report.bytes_read += block.size
        report.io_modes.add(mode)
        while i < len(spans):
            s = spans[i]
            lo, hi = max(s.start, offset), min(s.end, end)
            if lo < hi:
                piece = block[lo - offset:hi - offset]
                if s.crc is not None:
                    crc = crc32c(piece, crc)
                    if not bad_values:
                        bad_values = _check_values(s.values, block, offset, lo, hi, report)
                elif not flagged and piece.any():
                    report.problems.append(s.problem)
                    flagged = True
            if s.end > end:
                break
            if s.crc is not None and crc != s.crc:
                report.problems.append(s.problem)
            i, crc, flagged, bad_values = i + 1, 0, False, False
        progress(block.size)
    if end < size:
        report.problems.append(f"{container.path / name}: ended at byte {end} of {size} while being read")


def _check_values(regions: tuple[ValueRegion, ...], block: np.ndarray, offset: int, lo: int, hi: int,
                  report: VerifyReport) -> bool:
    """Check the values of `regions` inside bytes [lo, hi) of the file (`block` starts at `offset`);
    report the first region found to hold a non-number and return True, else False."""
    for r in regions:
        a, b = max(r.start, lo), min(r.end, hi)
        if a < b and holds_non_number(block[a - offset:b - offset], r.kind):
            report.problems.append(r.problem)
            return True
    return False


def verify_files(container: Any, progress: Callable[[int], Any] = lambda n: None) -> VerifyReport:
    """Every CRC, padding byte and stored float of trunk.bin, then experts.bin; `progress(n)` after
    each block of n bytes."""
    report = VerifyReport()
    t0 = time.perf_counter()
    check_file(container, TRUNK, trunk_spans(container), report, progress)
    check_file(container, EXPERTS, expert_spans(container), report, progress)
    report.seconds = time.perf_counter() - t0
    return report
