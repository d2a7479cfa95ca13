"""KDA kernels against the float64 oracle at the decays fla's default inputs never draw.

fla's convention, g = logsigmoid(N(0, 1)), keeps about ten tokens of memory, so errors are
forgotten as fast as they are made. Here, over T = 512 tokens at H = 2, K = V = 64:

- weak: decays exp(g) drawn uniform in [0.99, 1) per token and channel (100 to 10^4 tokens
  of memory);
- steady: exp(g) = 0.992 for every token and channel (a head that keeps ~125 tokens);
- zero: g = 0, no decay at all (only the delta rule's own contraction along k_t);
- floor: g = -5 everywhere, K3's lower bound (exp(-5) = 0.0067 a step; inside a chunk of 64
  the cumulative decay reaches -320, far beyond float32's exponent range);
- mixed: half the channels at the floor, half at 0.999, so the chunked form's pairwise decays
  span both extremes within one head.

Tolerances are relative to the largest element of the float64 result (max |fast - exact| <=
rtol * max |exact|), since the state's size depends on the decay: with g = 0 it is the sum of
hundreds of updates (max |S| about 3 here), at the floor about one (0.5). The bound is made
from u = 2**-24, float32's unit roundoff:

- With long memory every step's rounding (a few u of |S| per element: the decay multiply,
  the K-term prediction, the rank-1 update) stays in the state, in directions the delta rule
  does not contract. Independent roundings add as a random walk: after T steps about
  c u sqrt(T) |S|; with c = 4, rtol = 4 u sqrt(512) = 5.4e-6 (weak and zero; the kernels
  measure 1.3e-7 to 4.8e-7, the decode step highest, as it rounds the state every token).
- A decay that is the same every token is not random: the token-by-token kernels (recurrent,
  decode step) multiply by exp(g) rounded to float32 (half an ulp, plus about one ulp from
  `fexp`), so a term n tokens old carries n times that same error. The bound is then
  1.5 u min(T, memory) ~ 1.5 u T = 4.6e-5 (steady and mixed; measured up to 6e-6 for the
  token-by-token kernels, 3e-7 for the chunked form, which takes exp of float64 sums of g).
- At the floor the state keeps about one token, so nothing accumulates: the error is that of
  one update and one K-term output dot, a few u sqrt(K) = 8 u typical; rtol = 16 u = 9.5e-7
  (measured 1.3e-7 to 1.7e-7).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import max_abs_diff

from waste.kernels.kda import recurrent_kda
from waste.kernels.kda_chunk import chunk_kda
from waste.kernels.kda_decode import kda_decode_step
from waste.reference.kda import naive_chunk_kda, naive_recurrent_kda
from waste.testing import kda_inputs

T, H, K = 512, 2, 64
UNIT_ROUNDOFF = 2.0**-24
RTOL = {
    "weak": 4 * UNIT_ROUNDOFF * np.sqrt(T),  # independent roundings: a random walk
    "zero": 4 * UNIT_ROUNDOFF * np.sqrt(T),
    "steady": 1.5 * UNIT_ROUNDOFF * T,  # one rounded decay factor, repeated: coherent
    "mixed": 1.5 * UNIT_ROUNDOFF * T,
    "floor": 16 * UNIT_ROUNDOFF,  # about one token of memory: nothing accumulates
}
KINDS = list(RTOL)
FLOOR = -5.0  # K3's gate_lower_bound


def _decays(kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "weak":
        return np.log(rng.uniform(0.99, 1.0, (T, H, K)))
    if kind == "steady":
        return np.full((T, H, K), np.log(0.992))
    if kind == "zero":
        return np.zeros((T, H, K))
    if kind == "floor":
        return np.full((T, H, K), FLOOR)
    g = np.full((T, H, K), np.log(0.999))
    g[:, :, ::2] = FLOOR
    return g


def _kernels(q, k, v, g, beta, s0) -> dict[str, tuple[np.ndarray, np.ndarray]]:  # noqa: ANN001
    out = {"recurrent": recurrent_kda(q, k, v, g, beta, initial_state=s0)}
    for chunk in (16, 64):
        out[f"chunk {chunk}"] = chunk_kda(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    state = s0.copy()
    o = np.full(v.shape, np.nan, np.float32)
    for t in range(T):
        o[t] = kda_decode_step(q[t], k[t], v[t], g[t], beta[t], state)
    out["decode step"] = (o, state)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_long_sequences_at_extreme_decays(kind: str) -> None:
    rng = np.random.default_rng(KINDS.index(kind))
    q, k, v, g, beta, s0 = kda_inputs(rng, T, H, K, K, g=_decays(kind, rng))
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    rtol = RTOL[kind]
    for name, (o, s) in _kernels(q, k, v, g, beta, s0).items():
        o_err = max_abs_diff(o, o_ref) / np.max(np.abs(o_ref))
        s_err = max_abs_diff(s, s_ref) / np.max(np.abs(s_ref))
        assert o_err <= rtol and s_err <= rtol, f"{name} at {kind} decays: output {o_err:.2e}, state {s_err:.2e}"


def test_oracles_agree_at_the_floor_over_a_long_chunk() -> None:
    """The two float64 oracles agree where the chunked form's cumulative decay reaches 64 x -5:
    the plain chunk oracle forms exp(G_i - G_j) from differences, so it never overflows."""
    rng = np.random.default_rng(9)
    q, k, v, g, beta, s0 = kda_inputs(rng, 128, 1, 16, 16, g=np.full((128, 1, 16), FLOOR))
    o_rec, s_rec = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    o_chk, s_chk = naive_chunk_kda(q, k, v, g, beta, initial_state=s0, chunk_size=64)
    assert max_abs_diff(o_chk, o_rec) <= 1e-12 and max_abs_diff(s_chk, s_rec) <= 1e-12
