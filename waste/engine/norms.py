"""RMSNorm as every engine layer applies it (float32)."""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Row-wise RMSNorm of x [T, D] in float32."""
    ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    return (x / np.sqrt(ms + np.float32(eps))).astype(np.float32) * weight
