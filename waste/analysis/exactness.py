"""Fast KDA kernels against the float64 reference, in the seed's table format.

The seed validated its C decode step against fla's naive recurrence at two shapes
(FACTS.md): T=24, H=4, K=V=32 and T=64, H=32, K=V=128, reporting the largest absolute
difference of the output and of the final state. `kda_errors` reproduces that comparison
for the Numba kernels against `waste.reference.kda`: the decode steps the engine runs per
generated token (`kda_decode_step`, and `kda_decode_step_deferred`, the one `waste run` uses),
fed T tokens one at a time, and the prefill kernels (recurrent and chunked); and
`format_seed_table` prints it the way the seed did.

Inputs follow fla's test convention: q, k, v standard normal, g = logsigmoid(N(0, 1)) per
channel (log-space decay), beta = sigmoid(N(0, 1)) per head; q and k are L2-normalised
inside the kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from waste.testing import kda_inputs

SEED_SHAPES = ((24, 4, 32, 32), (64, 32, 128, 128))  # (T, H, K, V)
# The seed's figures for its C decode step against fla's float32 naive recurrence.
SEED_FIGURES = {(24, 4, 32, 32): (3.7e-08, 2.4e-07), (64, 32, 128, 128): (4.1e-08, 1.8e-07)}


def random_kda_inputs(T: int, H: int, K: int, V: int, seed: int = 0) -> dict[str, np.ndarray]:
    """q, k [T, H, K], v [T, H, V], g [T, H, K] (log decay, < 0), beta [T, H], all float32."""
    q, k, v, g, beta, _ = kda_inputs(np.random.default_rng(seed), T, H, K, V)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta}


def dims_label(T: int, H: int, K: int, V: int) -> str:
    """The seed's way of naming a shape: "T=24, H=4, K=V=32"."""
    return f"T={T}, H={H}, " + (f"K=V={K}" if K == V else f"K={K}, V={V}")


@dataclass(frozen=True)
class KernelError:
    """Largest absolute differences of one kernel against its reference at one shape."""

    kernel: str
    reference: str
    shape: tuple[int, int, int, int]  # (T, H, K, V)
    output: float  # max |o - o_ref|
    state: float  # max |S - S_ref|

    @property
    def dims(self) -> str:
        return dims_label(*self.shape)


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def decode_steps(x: dict[str, np.ndarray], *, deferred: bool) -> tuple[np.ndarray, np.ndarray]:
    """Feed the T tokens of `x` one at a time through the engine's decode step from a zero state;
    (o [T, H, V], final state [H, K, V])."""
    from waste.kernels.kda_decode import apply_pending, kda_decode_step, kda_decode_step_deferred

    T, H, K = x["q"].shape
    V = x["v"].shape[2]
    state = np.zeros((H, K, V), np.float32)
    pending_k, pending_d = np.zeros((H, K), np.float32), np.zeros((H, V), np.float32)
    o = np.empty((T, H, V), np.float32)
    for t in range(T):
        args = (x["q"][t], x["k"][t], x["v"][t], x["g"][t], x["beta"][t])
        o[t] = (kda_decode_step_deferred(*args, state, pending_k, pending_d) if deferred
                else kda_decode_step(*args, state))
    if deferred:
        apply_pending(state, pending_k, pending_d)
    return o, state


def kda_errors(shapes: Sequence[tuple[int, int, int, int]] = SEED_SHAPES, *, seed: int = 0,
               chunk_size: int = 64) -> list[KernelError]:
    """For each shape, on the same random inputs (fresh per shape): the two decode steps,
    recurrent_kda and chunk_kda against naive_recurrent_kda (float64), and chunk_kda against
    recurrent_kda."""
    from waste.kernels.kda import recurrent_kda
    from waste.kernels.kda_chunk import chunk_kda
    from waste.reference.kda import naive_recurrent_kda

    rows = []
    for i, shape in enumerate(shapes):
        x = random_kda_inputs(*shape, seed=seed + i)
        ref_o, ref_s = naive_recurrent_kda(**x)
        for deferred, name in ((False, "kda_decode_step"), (True, "kda_decode_step_deferred (engine)")):
            o, s = decode_steps(x, deferred=deferred)
            rows.append(KernelError(name, "naive_recurrent_kda (float64)", shape, _max_abs(o, ref_o),
                                    _max_abs(s, ref_s)))
        rec_o, rec_s = recurrent_kda(**x)
        chk_o, chk_s = chunk_kda(**x, chunk_size=chunk_size)
        rows += [
            KernelError("recurrent_kda", "naive_recurrent_kda (float64)", shape,
                        _max_abs(rec_o, ref_o), _max_abs(rec_s, ref_s)),
            KernelError(f"chunk_kda (chunk {chunk_size})", "naive_recurrent_kda (float64)", shape,
                        _max_abs(chk_o, ref_o), _max_abs(chk_s, ref_s)),
            KernelError(f"chunk_kda (chunk {chunk_size})", "recurrent_kda", shape,
                        _max_abs(chk_o, rec_o), _max_abs(chk_s, rec_s)),
        ]
    return rows


def format_seed_table(rows: Sequence[KernelError]) -> str:
    """Markdown tables in the seed's format, one per (kernel, reference) pair:
    | dims | output max|diff| | state max|diff| |."""
    out = []
    for pair in dict.fromkeys((r.kernel, r.reference) for r in rows):
        out += [f"{pair[0]} against {pair[1]}:", "", "| dims | output max\\|diff\\| | state max\\|diff\\| |",
                "|---|---|---|"]
        out += [f"| {r.dims} | {r.output:.1e} | {r.state:.1e} |" for r in rows if (r.kernel, r.reference) == pair]
        out.append("")
    return "\n".join(out).rstrip()
