"""Weight storage formats and the matrix products over them.

A weight matrix `[N, K]` (N output rows, K inputs, PyTorch's Linear layout) is held as a
`QMatrix`: a format name, the logical shape, and named NumPy buffers whose dtypes and
shapes follow from (format, shape) alone, so a container can store the buffers back to
back and hand out zero-copy views on read.

Formats: "f32" (exact), "bf16" (bfloat16 storage, float32 arithmetic), "q8g" and "q4g"
(groups of 32 along K, one scale per group; docs/QUANT.md).

Shapes: x [K], X [T, K], y [N], Y [T, N].
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from waste.errors import WasteError

FORMATS = ("f32", "bf16", "q8g", "q4g")


@dataclass(frozen=True)
class QMatrix:
    """A weight matrix [N, K] in one storage format."""

    fmt: str
    shape: tuple[int, int]
    buffers: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.buffers.values())

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """y = W x for one token: x [K] float32 -> y [N] float32."""
        return self.matmul(np.asarray(x, np.float32)[None, :])[0]

    def matmul(self, X: np.ndarray) -> np.ndarray:
        """Y = X W^T for a chunk: X [T, K] float32 -> Y [T, N] float32."""
        return np.ascontiguousarray(np.asarray(X, np.float32) @ self.dequantize().T)

    def dequantize(self) -> np.ndarray:
        """The float32 weights [N, K] this matrix stands for."""
        if self.fmt == "f32":
            return self.buffers["w"]
        if self.fmt == "bf16":
            return self.buffers["w"].view(ml_dtypes.bfloat16).astype(np.float32)
        raise WasteError(f"format {self.fmt!r} is not implemented yet")


def buffer_layout(fmt: str, shape: tuple[int, int]) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """Names, dtypes and shapes of the buffers a matrix of this format and shape holds."""
    n, k = shape
    if fmt == "f32":
        return [("w", np.dtype(np.float32), (n, k))]
    if fmt == "bf16":
        return [("w", np.dtype(np.uint16), (n, k))]
    raise WasteError(f"unknown weight format {fmt!r}; expected one of {', '.join(FORMATS)}")


def quantize(w: np.ndarray, fmt: str) -> QMatrix:
    """Store a float weight matrix [N, K] in format `fmt`."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise WasteError(f"weight must be 2-D [N, K], got shape {w.shape}")
    shape = (int(w.shape[0]), int(w.shape[1]))
    if fmt == "f32":
        return QMatrix(fmt, shape, {"w": np.ascontiguousarray(w, np.float32)})
    if fmt == "bf16":
        bits = np.ascontiguousarray(w.astype(ml_dtypes.bfloat16)).view(np.uint16)
        return QMatrix(fmt, shape, {"w": bits})
    raise WasteError(f"unknown weight format {fmt!r}; expected one of {', '.join(FORMATS)}")


def from_buffers(fmt: str, shape: tuple[int, int], buffers: dict[str, np.ndarray]) -> QMatrix:
    """Wrap existing buffers (e.g. views into a memory map) as a QMatrix, checking them."""
    for name, dtype, bshape in buffer_layout(fmt, shape):
        b = buffers.get(name)
        if b is None or b.dtype != dtype or tuple(b.shape) != bshape:
            raise WasteError(f"{fmt} matrix {shape}: buffer {name!r} must be {dtype} {bshape}")
    return QMatrix(fmt, shape, buffers)
