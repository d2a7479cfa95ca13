"""Reading a container: memory-mapped, checked on open, zero-copy views, CRCs on first use.

`open_container(path)` opens the directory once and its three files relative to that handle,
so a `convert --force` replacing the container meanwhile cannot pair one generation's
manifest with another's data. It checks the manifest (checksum, magic, version, config,
tensor table against `expected_tensors`), the sizes of trunk.bin and experts.bin and every
tensor's bounds, then the CRC32C of every trunk tensor; each expert blob is checked the
first time it is used (`expert`, or `check_expert` for a blob read into memory). What it
hands out are read-only NumPy views over the memory maps, so a damaged file is reported by
name instead of read as garbage; a model copies the trunk into memory on huge pages when it
loads (`hold_trunk_in_memory`) and takes its views from the copy; a run whose experts all fit
in RAM copies each expert the same way when it is first used (`hold_experts_in_memory`).
`verify=False` skips the data CRCs (`--no-verify`), never the manifest's. `Container.verify()`
reads every byte: every CRC, and that padding is zero.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import zlib
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from waste import sigbus
from waste.config import ModelConfig
from waste.container import blobs, lease
from waste.container.format import (
    EXPERTS,
    MANIFEST,
    TRUNK,
    ContainerError,
    TensorEntry,
    crc32c,
    expert_name,
    tensor_class,
)
from waste.container.manifest import Manifest, parse_manifest
from waste.container.rows import FileRows
from waste.container.verify import verify_files
from waste.fileio import NotRegularFile, open_regular, pread_into

# The product kernels (Numba) are imported by the first matrix asked for, not with the reader:
# `waste info`, `waste verify` and the planner read containers without loading them.
if TYPE_CHECKING:
    from waste.kernels.quant import QMatrix

_MAX_MANIFEST = 1 << 30  # bytes; a manifest is a few MB even for K3
HUGE_PAGE = 2 << 20  # bytes: x86's transparent huge page
# Bytes of trunk.bin copied at a time by `hold_trunk_in_memory` before their mapped pages are
# dropped, so the copy never makes the process hold the trunk twice.
COPY_STEP = 64 << 20
# The trunk matrix a token reads one row of, when the lm_head is a matrix of its own: the model reads
# its rows from trunk.bin (`Container.rows`), and `hold_trunk_in_memory` leaves it out of its copy.
ROW_READ = "model.embed_tokens.weight"
_DAMAGED = "the container is damaged (`waste verify` lists every problem; --no-verify skips this check)"


def _open_dir(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ContainerError(f"{path}: not a container directory (no such directory)") from None
    except NotADirectoryError:
        raise ContainerError(f"{path}: not a container directory (a file; a container is a NAME.waste "
                             "directory)") from None
    except OSError as e:
        raise ContainerError(f"{path}: cannot open the container directory ({e.strerror})") from None


def huge_page_buffer(nbytes: int) -> np.ndarray:
    """A writable uint8 [nbytes] array of anonymous memory, not yet touched, starting on a 2 MiB
    boundary and advised MADV_HUGEPAGE where the kernel offers it, so the pages its first
    writes fault in are transparent huge pages (where not, 4 KiB pages: it still serves)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    whole = np.frombuffer(region, np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE
    return whole[start:start + nbytes]


def _side_file_matches(data: bytes, record: dict[str, Any]) -> bool:
    if "crc32c" in record:
        return crc32c(data) == record["crc32c"]
    # Containers written before side files moved to CRC32C (2026-11-30) list zlib's CRC32; the
    # manifest's checksum covers that record as well.
    return "crc32" in record and zlib.crc32(data) == record["crc32"]


class Container:
    """An open NAME.waste container; see docs/CONTAINER.md."""

    def __init__(self, path: str | Path, *, verify: bool = True):
        self.path = Path(path)
        self.verify_data = verify
        self.trunk_path = self.path / TRUNK
        self.experts_path = self.path / EXPERTS
        self._maps: list[mmap.mmap] = []
        self._watched: list[int] = []  # sigbus slots of the maps: a fault in them is one line (sigbus.py)
        self._fds: dict[str, int] = {}  # trunk.bin and experts.bin, open as long as their maps
        self.guarded: dict[str, bool] = {}  # file -> a lease was taken on it at open (lease.py)
        self._closed = False
        self._trunk = self._experts = np.zeros(0, np.uint8)
        self.trunk_in_memory = 0  # bytes of the trunk held in anonymous memory (hold_trunk_in_memory)
        self._trunk_map: np.ndarray | None = None  # trunk.bin's map, once part of it is left out of the copy
        self._expert_copy: np.ndarray | None = None  # (hold_experts_in_memory)
        self._expert_copy_read = self._expert_copy
        self.dir_fd = _open_dir(self.path)
        try:
            data = self._read_manifest()
            self._manifest: Manifest = parse_manifest(data, str(self.path / MANIFEST))
            self.manifest_sha256 = hashlib.sha256(data).hexdigest()
            self._trunk = self._map_file(TRUNK, self._manifest.file_bytes[TRUNK], self._trunk_owner)
            self._experts = self._map_file(EXPERTS, self._manifest.file_bytes[EXPERTS], self._expert_owner)
            ex = self._manifest.experts
            self._expert_checked = np.zeros((len(ex.layers), ex.num_experts), bool)
            self._expert_copied = np.zeros_like(self._expert_checked)  # (hold_experts_in_memory)
            if verify:
                self._check_trunk()
        except BaseException:
            self.close()
            raise

    def open_member(self, name: str, flags: int = os.O_RDONLY) -> int:
        """A descriptor of one of the container's files, opened relative to the directory handle
        (the same generation as the manifest); refuses anything but a regular file."""
        where = self.path / name
        try:
            return open_regular(name, flags, dir_fd=self.dir_fd)
        except FileNotFoundError:
            raise ContainerError(f"{where}: missing") from None
        except NotRegularFile:
            raise ContainerError(f"{where}: not a regular file") from None
        except OSError as e:
            raise ContainerError(f"{where}: cannot open ({e.strerror})") from None

    def _read_manifest(self) -> bytes:
        where = self.path / MANIFEST
        try:
            fd = self.open_member(MANIFEST)
        except ContainerError as e:
            if str(e).endswith(": missing"):
                raise ContainerError(f"{where}: missing; {self.path} is not a WASTE container") from None
            raise
        try:
            size = os.fstat(fd).st_size
            if size > _MAX_MANIFEST:
                raise ContainerError(f"{where}: {size} bytes, larger than any manifest")
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read(size + 1)
        except OSError as e:
            raise ContainerError(f"{where}: cannot read ({e.strerror})") from None
        finally:
            os.close(fd)

    def _trunk_owner(self, offset: int) -> str:
        for e in sorted(self._manifest.tensors.values(), key=lambda e: e.offset):
            if e.offset + e.nbytes > offset:
                return f"tensor {e.name!r} (bytes {e.offset}..{e.offset + e.nbytes})"
        return "the end padding"

    def _expert_owner(self, offset: int) -> str:
        ex = self._manifest.experts
        blob = offset // ex.blob_bytes
        layer = ex.layers[min(blob // ex.num_experts, len(ex.layers) - 1)]
        return f"expert {blob % ex.num_experts} of layer {layer} (blob at byte {blob * ex.blob_bytes})"

    def _map_file(self, name: str, size: int, owner: Any) -> np.ndarray:
        """The file as a read-only uint8 array over a memory map (an empty array for an empty file).

        The descriptor stays open while the container is: it holds the lease that turns a
        truncation by another process into one line (`waste.container.lease`), and lets
        `expert` see a truncation that happened without one."""
        path = self.path / name
        fd = self.open_member(name)
        self._fds[name] = fd
        self.guarded[name] = lease.guard(fd, path)
        actual = os.fstat(fd).st_size
        if actual < size:
            raise ContainerError(f"{path}: truncated to {actual} of {size} bytes; {owner(actual)} is cut off")
        if actual > size:
            raise ContainerError(f"{path}: {actual} bytes, the manifest says {size}")
        if size == 0:
            return np.zeros(0, np.uint8)
        try:
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ContainerError(f"{path}: cannot map ({e.strerror})") from None
        self._maps.append(mm)
        mapped = np.frombuffer(mm, np.uint8)
        self._watched.append(sigbus.watch(mapped, path))
        return mapped

    def hold_trunk_in_memory(self) -> None:
        """Serve the trunk's views from a copy in anonymous memory backed by transparent huge
        pages where the kernel offers them (`huge_page_buffer`), instead of from trunk.bin's map
        of 4 KiB page-cache pages: a decode step streams every trunk weight once, and with 2 MiB
        pages its reads miss the TLB 512 times less often and its prefetchers are not stopped at
        every 4 KiB (on `mini` q4, EPYC, 2026-12-03: a decode step 1.05-1.07x faster in one
        process; the lm_head's product 14%, KDA's 9%). Views taken before keep the map. The copy
        is read in steps of COPY_STEP, each step's mapped pages dropped after it (they stay in
        the page cache), so the process never holds the trunk twice; `trunk_in_memory` then says
        how much it holds (the memory planner counts it as the trunk, not as runtime). Idempotent.

        The embedding of a model with an lm_head of its own (ROW_READ) is left out, but for the
        huge pages at its ends: a token reads one row of it, which the model reads from the file
        (`rows`), so the memory a copy would take goes to the expert cache instead (383 MiB on the
        48B q4). Views of it taken afterwards read the map."""
        if self.trunk_in_memory or self._trunk.size == 0:
            return
        n = self._trunk.nbytes
        skip_lo, skip_hi = self._row_read_span()
        copy = huge_page_buffer(n)
        source = self._trunk.base
        for lo in range(0, n, COPY_STEP):
            hi = min(n, lo + COPY_STEP)
            for a, b in ((lo, min(hi, skip_lo)), (max(lo, skip_hi), hi)):  # around the part left out
                if a < b:
                    copy[a:b] = self._trunk[a:b]
            if isinstance(source, memoryview) and isinstance(source.obj, mmap.mmap):
                source.obj.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        copy.setflags(write=False)  # read-only as the map's views are (the kernels' types stay)
        self._trunk_map = self._trunk if skip_lo < skip_hi else None
        self._trunk = copy
        self.trunk_in_memory = n - (skip_hi - skip_lo)

    def _row_read_span(self) -> tuple[int, int]:
        """The bytes of trunk.bin `hold_trunk_in_memory` leaves out: the huge pages wholly inside an
        untied embedding ((n, n): none)."""
        n = self._trunk.nbytes
        e = self._manifest.tensors.get(ROW_READ)
        if e is None or self.config.tie_word_embeddings:
            return n, n
        lo, hi = -(-e.offset // HUGE_PAGE) * HUGE_PAGE, (e.offset + e.nbytes) // HUGE_PAGE * HUGE_PAGE
        return (lo, hi) if lo < hi else (n, n)

    def _trunk_base(self, name: str) -> np.ndarray:
        """What a trunk tensor's views read: the copy in memory, or the map for a tensor left out of it."""
        return self._trunk_map if name == ROW_READ and self._trunk_map is not None else self._trunk

    def read_trunk(self, out: np.ndarray, offset: int) -> None:
        """Fill `out` (a writable uint8 array) from trunk.bin at `offset` with a positional read; a
        file cut short since it was opened, or a failed read, is a ContainerError naming it."""
        if self._closed:
            raise ContainerError(f"{self.path}: container is closed")
        try:
            pread_into(self._fds[TRUNK], out, offset)
        except EOFError:
            raise ContainerError(f"{self.trunk_path}: cut short during the run (needed {out.nbytes} B at offset "
                                 f"{offset})") from None
        except OSError as e:
            raise ContainerError(f"{self.trunk_path}: reading {out.nbytes} B at offset {offset}: "
                                 f"{e.strerror}") from None

    def rows(self, name: str) -> FileRows:
        """A trunk matrix whose rows are read from trunk.bin as they are asked for (`FileRows`)."""
        e = self.entry(name)
        if len(e.shape) != 2:
            raise ContainerError(f"{self.path}: tensor {name!r} has shape {list(e.shape)}, not a matrix")
        return FileRows(self, e)

    def hold_experts_in_memory(self) -> None:
        """From now on `expert` hands out views of a copy in anonymous memory on huge pages, as
        `hold_trunk_in_memory` does for the trunk, for a run whose experts all fit in RAM: each
        expert's blob is read into the copy (a positional read: none of the map's pages become
        the process's) the first time it is asked for, and its CRCs checked on the copy, which is
        what the kernels read; so the copy grows only with the experts a run uses. It has
        experts.bin's layout: its huge pages fill as neighbouring blobs are used. On `mini` q4 and
        q8 (EPYC, 2026-12-03) a decode step 1.02-1.04x faster in one process. Only for experts
        that fit: a copy of experts larger than RAM would be swapped or killed where the map's
        pages are simply dropped (`waste run` holds them only when the memory plan says they
        fit). `experts_view` still views the map. Idempotent. Nothing for MXFP4 experts: their
        products read a repacked copy in process memory already (`waste.kernels.quant.QMatrix`),
        and a second copy would hold them twice."""
        if self._expert_copy is not None or self._experts.size == 0 or self.expert_storage == "mxfp4":
            return
        self._expert_copy = huge_page_buffer(self._experts.nbytes)
        self._expert_copy_read = self._expert_copy.view()
        self._expert_copy_read.setflags(write=False)  # the kernels' types are those of the map's views

    @property
    def experts_in_memory(self) -> bool:
        """Whether `expert` hands out views of a copy in memory (`hold_experts_in_memory`)."""
        return self._expert_copy is not None

    def _check_trunk(self) -> None:
        for e in self._manifest.tensors.values():
            if crc32c(self._trunk[e.offset:e.offset + e.nbytes]) != e.crc32c:
                raise ContainerError(f"{self.trunk_path}: CRC mismatch in tensor {e.name!r} (bytes {e.offset}.."
                                     f"{e.offset + e.nbytes}): {_DAMAGED}")

    def check_expert(self, layer: int, expert: int, blob: np.ndarray) -> None:
        """Raise ContainerError unless every part of this expert's blob (uint8, in memory) matches
        its CRC32C."""
        ex = self._manifest.experts
        offset = ex.blob_offset(layer, expert)
        li = ex.layers.index(layer)
        for p, part in enumerate(ex.parts):
            if crc32c(blob[part.offset:part.offset + part.nbytes]) != ex.crc32c[li, expert, p]:
                raise ContainerError(f"{self.experts_path}: CRC mismatch in {expert_name(layer, expert, part.name)} "
                                     f"(blob at byte {offset}): {_DAMAGED}")
        self._expert_checked[li, expert] = True

    def read_side_file(self, relpath: str, record: Any) -> bytes:
        """A small file the manifest lists (the tokenizer's), read relative to the directory handle
        and checked against its record {"bytes": n, "crc32c": c}; ContainerError names the file."""
        where = self.path / relpath
        size = record.get("bytes") if isinstance(record, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= _MAX_MANIFEST:
            raise ContainerError(f"{self.path / MANIFEST}: no valid size recorded for {relpath}")
        fd = self.open_member(relpath)
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(size + 1)
        except OSError as e:
            raise ContainerError(f"{where}: cannot read ({e.strerror})") from None
        finally:
            os.close(fd)
        if len(data) != size:
            raise ContainerError(f"{where}: {len(data)}{'+' if len(data) > size else ''} bytes, the manifest says "
                                 f"{size}; the file is damaged")
        if not _side_file_matches(data, record):
            raise ContainerError(f"{where}: does not match the manifest (CRC mismatch); the file is damaged")
        return data

    # -- what the manifest says ------------------------------------------------------------
    @property
    def config(self) -> ModelConfig:
        return self._manifest.config

    @property
    def manifest(self) -> dict[str, Any]:
        return self._manifest.raw

    @property
    def scheme(self) -> str:
        return self._manifest.scheme

    @property
    def expert_storage(self) -> str:
        """Storage of the routed experts: f32, q8g, q4g or mxfp4 (docs/CONTAINER.md)."""
        return self._manifest.experts.storage

    def names(self) -> list[str]:
        """Trunk tensor names in file order (routed experts are reached through `expert`)."""
        return list(self._manifest.tensors)

    def has(self, name: str) -> bool:
        return name in self._manifest.tensors

    def entry(self, name: str) -> TensorEntry:
        """The manifest row of a trunk tensor."""
        e = self._manifest.tensors.get(name)
        if e is None:
            raise ContainerError(f"{self.path}: no tensor {name!r}")
        return e

    # -- views -----------------------------------------------------------------------------
    def _views(self, base: np.ndarray, entry: TensorEntry, start: int) -> dict[str, np.ndarray]:
        if self._closed:
            raise ContainerError(f"{self.path}: container is closed")
        return blobs.buffer_views(base, entry, start)

    def tensor(self, name: str) -> np.ndarray:
        """A float32 tensor in its original shape (read-only view); for arrays and f32 matrices."""
        e = self.entry(name)
        if e.storage != "f32":
            raise ContainerError(f"{self.path}: tensor {name!r} is a {e.storage} matrix; use matrix()")
        return self._views(self._trunk_base(name), e, e.offset)["w"]

    def matrix(self, name: str) -> QMatrix:
        """A weight matrix [N, K] as a QMatrix over the memory map (also 2-D float32 arrays: the router)."""
        e = self.entry(name)
        if len(e.shape) != 2:
            raise ContainerError(f"{self.path}: tensor {name!r} has shape {list(e.shape)}, not a matrix")
        from waste.kernels.quant import from_buffers

        return from_buffers(e.storage, (e.shape[0], e.shape[1]), self._views(self._trunk_base(name), e, e.offset))

    def _decode(self, base: np.ndarray, start: int, interleaved: bool = False) -> tuple[QMatrix, QMatrix, QMatrix]:
        if self._closed:
            raise ContainerError(f"{self.path}: container is closed")
        # Prepared here (blobs.decode), not at the first product: `expert` drops an MXFP4 expert's
        # pages of the map right after, once its copy is repacked.
        return blobs.decode(self._manifest.experts, base, start, interleaved)

    def expert_span(self, layer: int, expert: int) -> tuple[int, int]:
        """(offset, nbytes) of one expert's blob in experts.bin; offset and nbytes are multiples of 4096."""
        ex = self._manifest.experts
        return ex.blob_offset(layer, expert), ex.blob_bytes

    def expert(self, layer: int, expert: int) -> tuple[QMatrix, QMatrix, QMatrix]:
        """(w1, w3, w2) of one routed expert: [I, D], [I, D], [D, I], zero-copy over experts.bin.

        Its CRCs are checked the first time it is asked for (unless opened with verify=False)."""
        offset, nbytes = self.expert_span(layer, expert)
        li = self._manifest.experts.layers.index(layer)
        if self._expert_copy is not None:
            if not self._expert_copied[li, expert]:
                self._check_size(EXPERTS, offset + nbytes)
                blob = self._expert_copy[offset:offset + nbytes]
                try:
                    pread_into(self._fds[EXPERTS], blob, offset)  # a read, not the map: no pages of it mapped
                except (EOFError, OSError) as e:
                    why = getattr(e, "strerror", None) or "the file ends first"
                    raise ContainerError(f"{self.experts_path}: reading {nbytes} B at {offset}: {why}") from None
                if self.verify_data:
                    self.check_expert(layer, expert, blob)
                self._expert_copied[li, expert] = True
            return self._decode(self._expert_copy_read, offset)
        first = not self._expert_checked[li, expert]
        if first:
            self._check_size(EXPERTS, offset + nbytes)
            if self.verify_data:
                self.check_expert(layer, expert, self._experts[offset:offset + nbytes])
            self._expert_checked[li, expert] = True
        views = self._decode(self._experts, offset)
        if first and self.expert_storage == "mxfp4":
            # Its products read the copy the QMatrix repacked: the map's pages leave the process
            # (the page cache keeps them) instead of holding the expert twice.
            self.advise_experts(offset, nbytes, mmap.MADV_DONTNEED)
        return views

    @property
    def experts_fd(self) -> int:
        """Descriptor of experts.bin (open while the container is; do not close it)."""
        return self._fds[EXPERTS]

    def experts_view(self, offset: int, nbytes: int) -> np.ndarray:
        """experts.bin's bytes [offset, offset + nbytes) as a read-only view of its memory map,
        neither touched nor checked: the caller brings the pages in (`advise_experts`) and checks
        them (`check_expert`)."""
        self._check_size(EXPERTS, offset + nbytes)
        return self._experts[offset:offset + nbytes]

    def advise_experts(self, offset: int, nbytes: int, advice: int) -> None:
        """madvise(2) `advice` over experts.bin's map, bytes [offset, offset + nbytes) (offset a
        multiple of the page size); OSError as the kernel reports it."""
        view = self._experts.base
        if not isinstance(view, memoryview) or not isinstance(view.obj, mmap.mmap):
            raise ContainerError(f"{self.experts_path}: not mapped (empty, or the container is closed)")
        view.obj.madvise(advice, offset, nbytes)

    def data_fds(self) -> list[int]:
        """Descriptors of trunk.bin and experts.bin (open while the container is; do not close them)."""
        return list(self._fds.values())

    def _check_size(self, name: str, needed: int) -> None:
        """Before a first touch: a file truncated since it was mapped would kill the process with
        SIGBUS at the touch; say so in one line instead (files no lease guards, or no longer)."""
        if lease.held(self._fds[name]):
            return
        actual = os.fstat(self._fds[name]).st_size
        if actual < needed:
            raise lease.ContainerChanged(f"{self.path / name}: truncated to {actual} bytes while in use (byte "
                                         f"{needed} is needed); another process changed the container")

    @property
    def experts_interleaved_when_read(self) -> bool:
        """Whether a store that reads blobs hands them to `decode_expert` in the kernels' interleave
        (`interleave_expert`; `waste.container.blobs.interleaved_when_read`)."""
        return blobs.interleaved_when_read(self._manifest.experts)

    def interleave_expert(self, blob: np.ndarray, out: np.ndarray) -> None:
        """Repack a blob as read from experts.bin (checked: its CRCs cover these bytes) into `out`
        (uint8, as long) in the kernels' interleave, on the calling thread. Only where
        `experts_interleaved_when_read`."""
        if not self.experts_interleaved_when_read:
            raise ContainerError(f"{self.path}: its {self.expert_storage} experts are handed out as stored")
        blobs.interleave(self._manifest.experts, blob, out)

    def decode_expert(self, layer: int, buf: np.ndarray) -> tuple[QMatrix, QMatrix, QMatrix]:
        """(w1, w3, w2) as read-only views over a blob read into `buf` (uint8, expert_blob_bytes
        long; in the kernels' interleave where `experts_interleaved_when_read`): read-only as the
        map's views are, so the kernels meet one type whichever store handed the expert out (a
        writable one would load or compile a second variant of each)."""
        ex = self._manifest.experts
        if layer not in ex.layers:
            raise ContainerError(f"layer {layer} has no routed experts (MoE layers: {list(ex.layers)})")
        blobs.check_buffer(ex, buf)
        read_only = buf.view()
        read_only.setflags(write=False)
        return self._decode(read_only, 0, self.experts_interleaved_when_read)

    # -- sizes -----------------------------------------------------------------------------
    def byte_counts(self) -> dict[str, Any]:
        """trunk_bytes, expert_bytes (file sizes), expert_blob_bytes and per_class data bytes of the trunk."""
        per_class: dict[str, int] = {}
        for e in self._manifest.tensors.values():
            cls = tensor_class(e.name, self.config)
            per_class[cls] = per_class.get(cls, 0) + e.data_bytes
        ex = self._manifest.experts
        return {
            "trunk_bytes": self._manifest.file_bytes[TRUNK],
            "expert_bytes": self._manifest.file_bytes[EXPERTS],
            "expert_blob_bytes": ex.blob_bytes,
            "expert_storage": ex.storage,
            "expert_data_bytes": sum(p.data_bytes for p in ex.parts),
            "expert_layers": len(ex.layers),
            "num_experts": ex.num_experts,
            "per_class": per_class,
        }

    # -- checks ----------------------------------------------------------------------------
    def verify(self, *, collect: bool = False) -> list[str]:
        """Check every CRC and that all padding is zero, reading both files once, sequentially
        (`waste.container.verify.verify_files`, which also reports the speed).

        Raises ContainerError naming file and tensor on the first problem; with collect=True,
        returns the list of all problems instead (empty when the container is sound).
        """
        problems = verify_files(self).problems
        if problems and not collect:
            raise ContainerError(problems[0])
        return problems

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Release the memory maps (views still alive keep theirs until they are dropped)."""
        self._closed = True
        self._trunk = self._experts = np.zeros(0, np.uint8)
        self._trunk_map = self._expert_copy = self._expert_copy_read = None
        for slot in self._watched:
            sigbus.unwatch(slot)  # before the unmapping: the addresses may be reused
        self._watched.clear()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass  # a caller still holds a view; the map goes when the view does
        self._maps.clear()
        for fd in self._fds.values():
            lease.release(fd)
            os.close(fd)
        self._fds.clear()
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1

    def __del__(self) -> None:
        # An unclosed container still lets go of its descriptors (and leases) when it is dropped.
        try:
            self.close()
        except Exception:  # at interpreter shutdown, what close() uses may be gone already
            pass

    def __enter__(self) -> Container:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Container({str(self.path)!r}, scheme={self.scheme!r}, experts={self.expert_storage!r})"


def open_container(path: str | Path, *, verify: bool = True) -> Container:
    """Open and check a NAME.waste container (manifest checksum, magic, version, tensor table, file
    sizes, bounds; with `verify`, the trunk's CRCs now and each expert's when first used)."""
    return Container(path, verify=verify)
