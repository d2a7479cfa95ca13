"""An expert's blob of experts.bin in memory: its three matrices (w1, w3, w2) as views over the
blob's bytes, as stored, or, for MXFP4 experts a store reads, repacked in place of those bytes
into the kernels' interleave (docs/CONTAINER.md, "MXFP4 experts")."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from waste.container.format import ContainerError, ExpertsLayout, TensorEntry
from waste.qformat import ROWS

# The product kernels (Numba) are imported when an expert is first decoded, not with the reader.
if TYPE_CHECKING:
    from waste.kernels.quant import QMatrix


def buffer_views(base: np.ndarray, entry: TensorEntry, start: int) -> dict[str, np.ndarray]:
    """The buffers of `entry` (a trunk tensor or an expert part) stored from byte `start` of `base`."""
    out = {}
    for b in entry.buffers:
        lo = start + b.offset
        out[b.name] = base[lo:lo + b.nbytes].view(np.dtype(b.dtype)).reshape(b.shape)
    return out


def interleaved_when_read(experts: ExpertsLayout) -> bool:
    """Whether a store that reads blobs holds them in the kernels' interleave (`interleave`): MXFP4
    experts whose parts' rows are a multiple of 16, for which the interleave is as large as the
    stored bytes. Left as stored, each would be held twice: the blob and the copy its products
    read (`QMatrix`)."""
    return experts.storage == "mxfp4" and all(p.shape[0] % ROWS == 0 for p in experts.parts)


def check_buffer(experts: ExpertsLayout, buf: np.ndarray) -> None:
    if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes != experts.blob_bytes:
        raise ContainerError(f"expert blob buffer must be uint8 [{experts.blob_bytes}], got {buf.dtype} {buf.shape}")


def _interleaved_views(buf: np.ndarray, part: TensorEntry) -> dict[str, np.ndarray]:
    """A part's interleaved buffers (`mxfp4_interleaved_layout`) over its stored buffers' bytes."""
    from waste.kernels.quant import mxfp4_interleaved_layout

    spans = {b.name: (part.offset + b.offset, b.nbytes) for b in part.buffers}
    out = {}
    for (name, dtype, shape), stored in zip(mxfp4_interleaved_layout((part.shape[0], part.shape[1])),
                                            ("packed", "scales"), strict=True):
        lo, nbytes = spans[stored]
        out[name] = buf[lo:lo + nbytes].view(dtype).reshape(shape)
    return out


def interleave(experts: ExpertsLayout, blob: np.ndarray, out: np.ndarray) -> None:
    """Repack a blob as read (checked: its CRCs cover these bytes) into `out`, each part in the
    kernels' interleave at the offsets of its stored buffers, on the calling thread."""
    from waste.kernels.mxfp4 import repack_blocks

    check_buffer(experts, blob)
    check_buffer(experts, out)
    for p in experts.parts:
        stored, kernel = buffer_views(blob, p, p.offset), _interleaved_views(out, p)
        repack_blocks(stored["packed"], stored["scales"], kernel["qs"], kernel["scales"], 0, kernel["scales"].shape[0])


def decode(experts: ExpertsLayout, base: np.ndarray, start: int,
           interleaved: bool = False) -> tuple[QMatrix, QMatrix, QMatrix]:
    """(w1, w3, w2) of the blob at byte `start` of `base`: views of its stored buffers, each matrix
    prepared for the products (an MXFP4 one repacks a copy: the caller's thread pays for it), or,
    `interleaved`, views of the interleave `interleave` wrote."""
    from waste.kernels.quant import from_buffers, mxfp4_interleaved

    parts = {}
    for p in experts.parts:
        shape = (p.shape[0], p.shape[1])
        if interleaved:
            parts[p.name] = mxfp4_interleaved(shape, _interleaved_views(base[start:], p))
        else:
            parts[p.name] = from_buffers(p.storage, shape, buffer_views(base, p, start + p.offset)).prepare()
    return parts["w1"], parts["w3"], parts["w2"]
