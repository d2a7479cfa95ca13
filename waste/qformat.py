"""The weight storage formats' constants and buffer layouts (what `waste.kernels.quant.QMatrix`
holds), in plain NumPy so the container, the planner and the quantiser share them without
importing the product kernels. Byte layouts and their reasons: docs/QUANT.md.
"""

from __future__ import annotations

import math

import numpy as np

from waste.errors import WasteError

FORMATS = ("f32", "bf16", "q8g", "q4g", "mxfp4")
# Container schemes (waste.container.format.storage_of says what each stores where) and the
# routed-expert storage `--experts` asks for.
SCHEMES = ("f32", "bf16", "q8", "q4", "q4all")
EXPERT_CHOICES = {"f32": "f32", "bf16": "bf16", "q8": "q8g", "q4": "q4g", "mxfp4": "mxfp4"}

GROUP = 32  # weights (and activations) sharing one scale, along K
ROWS = 16  # output rows interleaved in one block: 16 int32 lanes of a 512-bit vector
# one group of one block (mxfp4: of the copy its QMatrix repacks for the kernels)
BLOCK_BYTES = {"q8g": GROUP * ROWS, "q4g": GROUP * ROWS // 2, "mxfp4": GROUP * ROWS // 2}
# The kernels read codes as unsigned bytes (q8g: code + 128, mxfp4: twice the E2M1 value + 12).
CODE_OFFSET = {"q8g": 128, "q4g": 8, "mxfp4": 12}
QMAX = {"q8g": 127, "q4g": 8}  # |code - offset| that the group's largest weight maps to
# The largest group scale divided by tscale lies in [2**14, 2**15): float16 normals span
# 2**-14 .. 65504, so every group within 2**28 of the largest keeps a full 11-bit scale.
SCALE_EXPONENT = 14


def padded_shape(shape: tuple[int, int]) -> tuple[int, int]:
    """(row blocks NB, groups G) of a q-format matrix: N padded to 16 rows, K to 32 inputs."""
    n, k = shape
    return -(-n // ROWS), -(-k // GROUP)


def buffer_layout(fmt: str, shape: tuple[int, int]) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """Names, dtypes and shapes of the buffers a matrix of this format and shape holds."""
    n, k = shape
    if fmt == "f32":
        return [("w", np.dtype(np.float32), (n, k))]
    if fmt == "bf16":
        return [("w", np.dtype(np.uint16), (n, k))]
    if fmt in ("q8g", "q4g"):
        nb, g = padded_shape(shape)
        code = np.int8 if fmt == "q8g" else np.uint8
        return [("qs", np.dtype(code), (nb, g, BLOCK_BYTES[fmt])),
                ("scales", np.dtype(np.float16), (nb, g, ROWS)),
                ("tscale", np.dtype(np.float32), (1,))]
    if fmt == "mxfp4":
        # A checkpoint's weight_packed and weight_scale bytes verbatim (waste.kernels.mxfp4).
        check_mxfp4_shape(shape)
        return [("packed", np.dtype(np.uint8), (n, k // 2)),
                ("scales", np.dtype(np.uint8), (n, k // GROUP))]
    raise WasteError(f"unknown weight format {fmt!r}; expected one of {', '.join(FORMATS)}")


def check_mxfp4_shape(shape: tuple[int, int]) -> None:
    """Refuse shapes MXFP4 cannot hold: one scale per 32 inputs, no padding."""
    if shape[1] % GROUP:
        raise WasteError(f"mxfp4 matrix {shape}: K must be a multiple of {GROUP}")


def bits_per_weight(fmt: str, shape: tuple[int, int]) -> float:
    """Stored bits per logical weight, padding and the per-matrix scale included."""
    total = sum(math.prod(s) * dt.itemsize for _, dt, s in buffer_layout(fmt, shape))
    return 8.0 * total / max(1, shape[0] * shape[1])
