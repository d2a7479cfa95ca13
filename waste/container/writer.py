"""Writing a container: planned layout, tensors placed by pwrite, atomic rename at the end.

The whole layout (every offset in trunk.bin and experts.bin) is planned before the first
byte is written, so tensors can arrive in any order (shard by shard) and the result does
not depend on how the checkpoint was sharded. The container is built in a hidden sibling
directory and renamed into place only after the manifest is written.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from waste.config import ModelConfig
from waste.container.format import (
    EXPERT_PARTS,
    EXPERTS,
    MANIFEST,
    TRUNK,
    TRUNK_ALIGN,
    Shape,
    TensorEntry,
    align,
    crc32c,
    expert_storage,
    is_container_dir,
    plan_experts,
    plan_trunk,
)
from waste.container.manifest import manifest_json
from waste.errors import WasteError
from waste.fileio import check_free_space, check_output_dir, install_dir, recover_stale, remove_tree, temp_dir_for
from waste.tokenizer import write_files

# The quantiser and QMatrix (Numba kernels) are imported when a tensor is encoded, so that
# importing waste.container does not load Numba (see reader.py).
if TYPE_CHECKING:
    from waste.kernels.quant import QMatrix


def _encode(entry: TensorEntry, value: np.ndarray | QMatrix) -> list[tuple[int, np.ndarray]]:
    """(offset in the span, bytes) of each buffer of `value` stored as `entry` says.

    A QMatrix already in the entry's storage is written verbatim (MXFP4 experts); one in another
    format is dequantised and stored again (only when convert is asked to)."""
    from waste.kernels.quant import QMatrix, quantize

    if isinstance(value, QMatrix) and value.fmt == entry.storage:
        if value.shape != entry.shape:
            raise WasteError(f"tensor {entry.name!r}: shape {list(value.shape)}, planned {list(entry.shape)}")
        buffers = value.buffers
        if set(buffers) != {spec.name for spec in entry.buffers}:  # an MXFP4 matrix in the kernels' interleave
            raise WasteError(f"tensor {entry.name!r}: buffers {sorted(buffers)} are not the stored layout "
                             f"{[spec.name for spec in entry.buffers]}")
    else:
        value = value.dequantize() if isinstance(value, QMatrix) else np.asarray(value)
        if tuple(value.shape) != entry.shape:
            raise WasteError(f"tensor {entry.name!r}: shape {list(value.shape)}, planned {list(entry.shape)}")
        if entry.kind == "array":
            buffers = {"w": np.ascontiguousarray(value, dtype=np.float32)}
        else:
            buffers = quantize(value.astype(np.float32, copy=False), entry.storage).buffers
    out = []
    for spec in entry.buffers:
        b = buffers[spec.name]
        if b.dtype.name != spec.dtype or tuple(b.shape) != spec.shape:
            raise WasteError(f"tensor {entry.name!r}: quantize({entry.storage}) gave buffer {spec.name!r} "
                             f"{b.dtype} {b.shape}, layout says {spec.dtype} {spec.shape}")
        out.append((spec.offset, np.ascontiguousarray(b).reshape(-1).view(np.uint8)))
    return out


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data)
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _span_crc(pieces: list[tuple[int, np.ndarray]]) -> int:
    """CRC32C of a span: the buffers with the zero padding between them."""
    crc, pos = 0, 0
    for off, data in pieces:
        if off > pos:
            crc = crc32c(bytes(off - pos), crc)
        crc = crc32c(data, crc)
        pos = off + data.nbytes
    return crc


class ContainerWriter:
    """Builds NAME.waste/ in a temporary directory; `finish()` writes the manifest and renames.

    `shapes` are the trunk tensors in trunk order with the shapes found in the checkpoint
    (A_log may use either accepted spelling); routed experts follow `plan_experts(cfg, storage)`,
    their storage `expert_storage(cfg, scheme, experts)` (experts: f32, q8, q4, mxfp4 or None).
    """

    def __init__(self, out: str | Path, cfg: ModelConfig, scheme: str, shapes: dict[str, Shape], *,
                 experts: str | None = None, force: bool = False, extra: dict[str, Any] | None = None):
        self.out = Path(out)
        check_output_dir(self.out, "waste container", force, is_container_dir)
        if not self.out.parent.is_dir():
            raise WasteError(f"{self.out.parent}: no such directory")
        self.force = force
        self.cfg, self.scheme, self.extra = cfg, scheme, extra or {}
        self.entries = {e.name: e for e in plan_trunk(cfg, scheme, shapes)}
        last = max(self.entries.values(), key=lambda e: e.offset)
        self.trunk_bytes = align(last.offset + last.nbytes, TRUNK_ALIGN)
        self.experts = plan_experts(cfg, expert_storage(cfg, scheme, experts))
        self.crc: dict[str, int] = {}
        grid = (len(self.experts.layers), self.experts.num_experts, len(EXPERT_PARTS))
        self.expert_crc = np.zeros(grid, np.uint32)
        self.expert_done = np.zeros(grid, bool)
        recover_stale(self.out)
        self.tmp = temp_dir_for(self.out)
        self._fds: dict[str, int] = {}
        try:
            # The files are sized at once but sparse: without this, a full disk shows only part-way.
            check_free_space(self.out, self.trunk_bytes + self.experts.file_bytes, "container")
            for name, size in ((TRUNK, self.trunk_bytes), (EXPERTS, self.experts.file_bytes)):
                fd = os.open(self.tmp / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                self._fds[name] = fd
                # EFBIG where the file system caps a file's size (FAT32: 4 GiB) or `ulimit -f` does
                os.ftruncate(fd, size)
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError):
                raise WasteError(f"{self.out}: cannot write {name}: {e.strerror or e}") from None
            raise

    def write_tensor(self, name: str, value: np.ndarray) -> None:
        """Store one trunk tensor (float values in their checkpoint shape)."""
        entry = self.entries.get(name)
        if entry is None:
            raise WasteError(f"tensor {name!r} is not part of this container's trunk")
        if name in self.crc:
            raise WasteError(f"tensor {name!r} written twice")
        pieces = _encode(entry, value)
        for off, data in pieces:
            _pwrite_all(self._fds[TRUNK], data, entry.offset + off)
        self.crc[name] = _span_crc(pieces)

    def write_expert(self, layer: int, expert: int, part: str, value: np.ndarray | QMatrix) -> None:
        """Store one routed expert matrix (part w1, w3 or w2) into its blob: float values, or a QMatrix
        (kept verbatim when it is already in the experts' storage)."""
        base = self.experts.blob_offset(layer, expert)
        p = EXPERT_PARTS.index(part)
        idx = (self.experts.layers.index(layer), expert, p)
        if self.expert_done[idx]:
            raise WasteError(f"expert {expert} {part} of layer {layer} written twice")
        entry = self.experts.parts[p]
        pieces = _encode(entry, value)
        for off, data in pieces:
            _pwrite_all(self._fds[EXPERTS], data, base + entry.offset + off)
        self.expert_crc[idx] = _span_crc(pieces)
        self.expert_done[idx] = True

    def add_files(self, subdir: str, files: dict[str, bytes]) -> None:
        """Carry small side files (the tokenizer) into `subdir` of the container."""
        write_files(self.tmp / subdir, files)

    def finish(self) -> Path:
        """Check everything was written, write manifest.json, rename into place; the container's path."""
        missing = [n for n in self.entries if n not in self.crc]
        if missing:
            raise WasteError(f"{len(missing)} tensor(s) never written, first {missing[0]!r}")
        if not self.expert_done.all():
            li, e, p = (int(i) for i in np.argwhere(~self.expert_done)[0])
            raise WasteError(f"expert {e} {EXPERT_PARTS[p]} of layer {self.experts.layers[li]} never written")
        for fd in self._fds.values():
            os.fsync(fd)
            os.close(fd)
        self._fds.clear()
        tensors = [dataclasses.replace(e, crc32c=self.crc[e.name]) for e in self.entries.values()]
        experts = dataclasses.replace(self.experts, crc32c=self.expert_crc)
        data = manifest_json(self.cfg, self.scheme, tensors, experts, self.trunk_bytes, self.extra)
        with open(self.tmp / MANIFEST, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        install_dir(self.tmp, self.out, force=self.force)
        return self.out

    def abort(self) -> None:
        """Drop the temporary directory; the destination is left as it was."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        remove_tree(self.tmp)

    def __enter__(self) -> ContainerWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()
            if isinstance(exc, OSError) and exc.filename is None:  # a write's: name the container, not just ENOSPC
                raise WasteError(f"{self.out}: cannot write the container: {exc.strerror or exc}") from None
