"""Rows of a trunk matrix read from trunk.bin as they are asked for (`FileRows`): the untied
embedding, of which a token reads one row, so the process never holds it whole
(`Container.rows`, `Container.hold_trunk_in_memory`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from waste.container.format import ContainerError, TensorEntry
from waste.qformat import ROWS

if TYPE_CHECKING:
    from waste.container.reader import Container


class FileRows:
    """A trunk matrix [N, K] whose rows are read from trunk.bin as they are asked for, with
    positional reads through the page cache: for a matrix a token reads one row of (the
    embedding, `waste.container.reader.ROW_READ`), which the process then never holds whole, in
    its copy or in mapped pages (with large page-cache folios a mapped row brings up to 2 MiB of
    its neighbours into the RSS).

    `take_rows` gives what `QMatrix.take_rows` gives over the whole matrix, bit for bit: in f32 and
    bf16 it reads the rows asked for; in the q formats the blocks of ROWS interleaved rows they lie
    in (codes and scales), from which the matrix's own row kernel takes them. A file cut short since
    it was opened is named as such."""

    def __init__(self, container: Container, entry: TensorEntry):
        if entry.storage not in ("f32", "bf16", "q8g", "q4g"):
            raise ContainerError(f"{container.path}: tensor {entry.name!r} is {entry.storage}, not a trunk format")
        self.fmt = entry.storage
        self.shape = (int(entry.shape[0]), int(entry.shape[1]))
        self._container = container
        # Per buffer: (dtype, the shape of one unit: a row, or a block of ROWS rows; its bytes; where
        # unit 0 starts)
        self._units = {b.name: (np.dtype(b.dtype), tuple(int(d) for d in b.shape[1:]), b.nbytes // int(b.shape[0]),
                                entry.offset + b.offset) for b in entry.buffers if len(b.shape) > 1}
        tscale = [b for b in entry.buffers if b.name == "tscale"]
        self._tscale = (self._read(entry.offset + tscale[0].offset, np.dtype(np.float32), (1,))[0]
                        if tscale else None)

    def take_rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantised rows W[ids]: ids [L] int -> [L, K] float32 (see the class doc)."""
        from waste.kernels.quant import bf16_to_f32, checked_row_ids, take_q_rows

        ids = checked_row_ids(ids, self.shape[0])
        if self.fmt in ("f32", "bf16"):
            rows = self._read_units("w", ids)
            return rows if self.fmt == "f32" else bf16_to_f32(rows)
        if ids.size == 1:  # a decode step's token
            blocks, which = ids // ROWS, np.zeros(1, np.int64)
        else:
            blocks, which = np.unique(ids // ROWS, return_inverse=True)
        out = np.empty((len(ids), self.shape[1]), np.float32)
        take_q_rows(self._read_units("qs", blocks), self._read_units("scales", blocks).view(np.uint16), self._tscale,
                    (which.reshape(-1) * ROWS + ids % ROWS).astype(np.int64), out)
        return out

    def _read_units(self, name: str, units: np.ndarray) -> np.ndarray:
        """Buffer `name`'s units (rows, or row blocks) `units`, read one by one."""
        dtype, shape, unit_bytes, start = self._units[name]
        out = np.empty((len(units), *shape), dtype)
        flat = out.reshape(-1).view(np.uint8)
        for i, u in enumerate(units.tolist()):
            self._read_into(flat[i * unit_bytes:(i + 1) * unit_bytes], start + u * unit_bytes)
        return out

    def _read(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty(shape, dtype)
        self._read_into(out, offset)
        return out

    def _read_into(self, out: np.ndarray, offset: int) -> None:
        self._container.read_trunk(out if out.dtype == np.uint8 else out.reshape(-1).view(np.uint8), offset)
