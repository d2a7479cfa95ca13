"""Causal depthwise short convolution with SiLU, in front of a KDA layer's q, k and v.

    y_t = SiLU(sum_j w[j] * x_{t-W+1+j})        taps [W, C], w[W-1] on the current token

Over a sequence (prefill) the W-1 inputs before the first token come from a ring that the
call leaves holding the last W-1 inputs; a decode step shifts one token through the ring, so
prefill then decode equals token-by-token decoding. Shapes: x [T, C], ring [W-1, C].
"""

from __future__ import annotations

import numpy as np

from waste.errors import WasteError
from waste.jit import kernel, parallel_kernel, prange
from waste.kernels.fastmath import fsigmoid


def conv_taps(w: np.ndarray) -> np.ndarray:
    """Checkpoint conv weight [C, 1, W] (or [C, W]) -> taps-major [W, C] float32 for the kernels."""
    w = np.asarray(w, np.float32)
    if w.ndim == 3:
        if w.shape[1] != 1:
            raise WasteError(f"depthwise conv weight must be [C, 1, W], got {w.shape}")
        w = w[:, 0, :]
    if w.ndim != 2:
        raise WasteError(f"conv weight must be [C, 1, W] or [C, W], got shape {w.shape}")
    return np.ascontiguousarray(w.T)


@parallel_kernel
def _conv_seq_kernel(x, w, ring, y):
    T, C = x.shape
    W = w.shape[0]
    R = W - 1
    for t in prange(T):
        for c in range(C):
            y[t, c] = 0.0
        for j in range(W):
            # tap j sees input t - R + j; positions before the sequence come from the ring
            s = t - R + j
            src = x[s] if s >= 0 else ring[R + s]
            for c in range(C):
                y[t, c] += w[j, c] * src[c]
        for c in range(C):
            y[t, c] = y[t, c] * fsigmoid(y[t, c])


@kernel
def _conv_ring_update(x, ring):
    T = x.shape[0]
    R = ring.shape[0]
    # the new ring is the last R rows of [ring; x]
    if T >= R:
        for r in range(R):
            ring[r, :] = x[T - R + r, :]
    else:
        for r in range(R - T):
            ring[r, :] = ring[r + T, :]
        for r in range(T):
            ring[R - T + r, :] = x[r, :]


def short_conv_silu(x: np.ndarray, w_taps: np.ndarray, ring: np.ndarray) -> np.ndarray:
    """Causal depthwise conv + SiLU over a sequence: x [T, C], w_taps [W, C], ring [W-1, C] -> y [T, C].

    `ring` holds the W-1 inputs before x (oldest first, zeros at the start) and is left holding
    the last W-1 inputs, exactly as token-by-token `short_conv_silu_step` would.
    """
    x = np.ascontiguousarray(x, np.float32)
    _check_conv(x.shape[1], w_taps, ring)
    y = np.empty_like(x)
    _conv_seq_kernel(x, w_taps, ring, y)
    _conv_ring_update(x, ring)
    return y


@kernel
def _conv_step_kernel(x, w, ring, y):
    """N convs at once: x [N, C], w [N, W, C], ring [N, W-1, C] -> y [N, C]."""
    N, C = x.shape
    R = ring.shape[1]
    for n in range(N):
        # Passes over C (not taps inside a channel loop) so that each pass, the exp included,
        # vectorises; a channel still sums x first, then the ring oldest first.
        for c in range(C):
            y[n, c] = w[n, R, c] * x[n, c]
        for j in range(R):
            for c in range(C):
                y[n, c] += w[n, j, c] * ring[n, j, c]
        for c in range(C):
            y[n, c] = y[n, c] * fsigmoid(y[n, c])
        for r in range(R - 1):
            for c in range(C):
                ring[n, r, c] = ring[n, r + 1, c]
        for c in range(C):
            ring[n, R - 1, c] = x[n, c]


def short_conv_silu_step(x: np.ndarray, w_taps: np.ndarray, ring: np.ndarray) -> np.ndarray:
    """One decode step of the conv: x [C] -> y [C]; shifts x into `ring` [W-1, C].

    Also N convs in one call (the q, k, v convs of a KDA layer): x [N, C], w_taps [N, W, C],
    ring [N, W-1, C] -> y [N, C].
    """
    x = np.ascontiguousarray(x, np.float32)
    _check_conv(x.shape[-1], w_taps, ring, x.shape[:-1])
    y = np.empty_like(x)
    if x.ndim == 1:
        _conv_step_kernel(x[None], w_taps[None], ring[None], y[None])
    else:
        _conv_step_kernel(x, w_taps, ring, y)
    return y


def _check_conv(C: int, w_taps: np.ndarray, ring: np.ndarray, lead: tuple[int, ...] = ()) -> None:
    """Taps [*lead, W, C] and ring [*lead, W-1, C], contiguous float32 (lead: () or (N,))."""
    n = len(lead)
    if (w_taps.dtype != np.float32 or w_taps.ndim != n + 2 or w_taps.shape[:n] != lead or w_taps.shape[-1] != C
            or not w_taps.flags.c_contiguous or n > 1):
        raise WasteError(f"conv taps must be contiguous float32 [{'N, ' * n}W, {C}] (see conv_taps), "
                         f"got {w_taps.shape}")
    R = w_taps.shape[-2] - 1
    if ring.dtype != np.float32 or ring.shape != (*lead, R, C) or not ring.flags.c_contiguous or R < 1:
        raise WasteError(f"conv ring must be contiguous float32 [{'N, ' * n}{R}, {C}], got {ring.dtype} {ring.shape}")
