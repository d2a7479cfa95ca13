"""SwiGLU and SiTU expert kernels against the float64 oracle in waste.reference.moe.

Tolerance: SwiGLU outputs go through two float32 matmuls over <= 64 inputs and a SiLU, 1e-5 of
the output scale (see test_mla.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close

from waste.errors import WasteError
from waste.kernels import moe_step
from waste.kernels.moe import (
    PARALLEL_ACTIVATION,
    SITU_BLOCK,
    add_weighted,
    add_weighted_rows,
    gated_experts,
    gated_experts_one_token,
    gated_experts_sum_one_token,
    silu_mul,
    situ_mlp,
    swiglu,
)
from waste.kernels.moe_step import ExpertTables
from waste.kernels.quant import quantize
from waste.kernels.routing import route, router_logits
from waste.reference import k3 as k3ref
from waste.reference import moe as ref
from waste.reference import quant as qref


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_swiglu_matches_reference(fmt: str) -> None:
    rng = np.random.default_rng(3)
    T, D, I = 6, 48, 64
    x = rng.standard_normal((T, D)).astype(np.float32)
    mats = [rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1]) for s in ((I, D), (I, D), (D, I))]
    q = [quantize(m, fmt) for m in mats]
    got = swiglu(x, *q)
    assert got.shape == (T, D) and got.dtype == np.float32
    if fmt == "f32":
        want = ref.swiglu(x, *(m.dequantize().astype(np.float64) for m in q))
    else:
        # bf16 products round their activations to bf16 (docs/QUANT.md), which ref.swiglu does
        # not (2.2e-3 to 4.7e-3 of the output scale over ten seeds): the oracle's products that
        # round them as well, around the float32 hidden vector the down product reads.
        hidden = ref.silu(qref.reference_matmul(q[0], x)) * qref.reference_matmul(q[1], x)
        want = qref.reference_matmul(q[2], hidden.astype(np.float32))
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_silu_mul_extremes_are_finite() -> None:
    g = np.array([[-1e4, -100.0, 0.0, 100.0, 1e4]], np.float32)
    u = np.full_like(g, 2.0)
    got = silu_mul(g, u)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, ref.silu(g) * 2.0, rtol=1e-6, atol=1e-30)
    with pytest.raises(WasteError, match="equal"):
        silu_mul(g, u[:, :3])


# -- several experts on one token (decode) --------------------------------------------------------

# Shapes (experts, I, D): the q8g / q4g ones pad rows (I = 40, D = 72) and K; mxfp4 needs both
# widths multiples of 32, hence of 16, so its rows never pad.
ONE_TOKEN_CASES = [(fmt, *shape) for fmt in ("q8g", "q4g") for shape in ((1, 40, 72), (3, 64, 48), (8, 96, 64))]
ONE_TOKEN_CASES += [("mxfp4", *shape) for shape in ((1, 64, 32), (3, 32, 96), (8, 96, 64))]
ONE_TOKEN_CASES += [(fmt, *shape) for fmt in ("f32", "bf16") for shape in ((1, 40, 72), (9, 96, 50))]
# None: SwiGLU; otherwise SiTU's (beta, linear_beta), null or not.
ACTIVATIONS = [None, (None, None), (4.0, 25.0), (2.0, None)]


def _experts(rng: np.random.Generator, fmt: str, n: int, I: int, D: int):
    def weight(shape):
        return (rng.standard_normal(shape) * rng.uniform(0.02, 1.0, (shape[0], 1))).astype(np.float32)

    return [tuple(quantize(weight(s), fmt) for s in ((I, D), (I, D), (D, I))) for _ in range(n)]


def _one_by_one(x, experts, act):
    if act is None:
        return [swiglu(x, *e)[0] for e in experts]
    return [situ_mlp(x, *e, *act)[0] for e in experts]


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize(("fmt", "n", "I", "D"), ONE_TOKEN_CASES)
def test_gated_experts_one_token_equal_one_by_one(fmt: str, n: int, I: int, D: int, act) -> None:
    rng = np.random.default_rng(n * 100 + I + D)
    experts = _experts(rng, fmt, n, I, D)
    x = (4 * rng.standard_normal((1, D))).astype(np.float32)
    got = gated_experts_one_token(x, experts, act)
    assert got.shape == (n, D) and got.dtype == np.float32
    for e, want in enumerate(_one_by_one(x, experts, act)):
        np.testing.assert_array_equal(got[e], want)
    # Any subset in any order: each expert's row depends on that expert alone.
    order = rng.permutation(n)[: max(1, n // 2)]
    np.testing.assert_array_equal(gated_experts_one_token(x, [experts[i] for i in order], act), got[order])


@pytest.mark.parametrize("act", ACTIVATIONS[:3])
@pytest.mark.parametrize("fmt", ["q8g", "q4g", "mxfp4", "f32", "bf16"])
@pytest.mark.parametrize("inner", [64, 512])
def test_gated_experts_on_their_rows_equal_one_by_one(fmt: str, act, inner: int) -> None:
    """A prefill's experts, each on its own run of rows (one row, several, more than a tile),
    in three kernel calls: each expert's rows bit for bit its own MLP on those rows. At inner
    512 the 40 rows' activations run on all cores (PARALLEL_ACTIVATION, SITU_BLOCK)."""
    assert 40 * 512 > max(PARALLEL_ACTIVATION, SITU_BLOCK) > 40 * 64
    rng = np.random.default_rng(61)
    experts = _experts(rng, fmt, 5, inner, 96)
    x = (4 * rng.standard_normal((40, 96))).astype(np.float32)
    count = np.array([1, 7, 17, 3, 12], np.int64)
    x_start = np.array([0, 5, 20, 30, 28], np.int64)
    got = gated_experts(x, experts, x_start, count, act)
    first = np.concatenate([[0], np.cumsum(count)[:-1]])
    for e, expert in enumerate(experts):
        rows = x[x_start[e]:x_start[e] + count[e]]
        want = swiglu(rows, *expert) if act is None else situ_mlp(rows, *expert, *act)
        np.testing.assert_array_equal(got[first[e]:first[e] + count[e]], want)


@pytest.mark.parametrize("fmt", ["q8g", "q4g", "mxfp4", "f32", "bf16"])
def test_gated_experts_take_rows_equal_gathered_rows(fmt: str) -> None:
    """A prefill hands the chunk's tokens and, per routed row, which token it is (`take`): the
    experts then quantise (or round to bf16) each token once and gather its rows. The same bits
    as gathering the float rows first, with tokens routed to several experts and rows in any
    order; and with one row each (a decode step's driver)."""
    rng = np.random.default_rng(62)
    experts = _experts(rng, fmt, 4, 64, 96)
    z = (4 * rng.standard_normal((9, 96))).astype(np.float32)
    count = np.array([5, 3, 8, 6], np.int64)
    x_start = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    take = rng.integers(0, len(z), int(count.sum())).astype(np.int64)
    want = gated_experts(z[take], experts, x_start, count, None)
    np.testing.assert_array_equal(gated_experts(z, experts, x_start, count, None, take=take), want)
    kept: dict = {}  # z as prepared, kept across calls as a prefill's chunk keeps it
    for _ in range(2):
        np.testing.assert_array_equal(gated_experts(z, experts, x_start, count, None, take=take, prepared=kept),
                                      want)
    ones = np.ones(4, np.int64)
    np.testing.assert_array_equal(gated_experts(z, experts, np.arange(4), ones, None, take=take[:4]),
                                  gated_experts(z[take[:4]], experts, np.arange(4), ones, None))


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("fmt", ["q8g", "q4g", "mxfp4"])
def test_gated_experts_one_token_match_reference(fmt: str, act) -> None:
    """Against the float64 oracle of the same products (int8 activations, exact group sums):
    1e-5 of the output scale, for the float32 scaling, sums and activation (measured at most
    3.7e-7 over four seeds). A hidden value whose float32 and float64 forms straddle a rounding
    tie of its int8 code would move one code (about 1e-3); none does here (about 1 in 1e5)."""
    rng = np.random.default_rng(41)
    experts = _experts(rng, fmt, 6, 64, 96)
    x = rng.standard_normal((1, 96)).astype(np.float32)
    got = gated_experts_one_token(x, experts, act)
    for e, (gate, up, down) in enumerate(experts):
        g, u = qref.reference_matmul(gate, x), qref.reference_matmul(up, x)
        h = ref.silu(g) * u if act is None else k3ref.situ(g, u, *act)
        assert_close(got[e], qref.reference_matmul(down, h)[0], 1e-5)


def test_gated_experts_one_token_leave_other_formats_to_the_caller() -> None:
    rng = np.random.default_rng(43)
    q8, f32 = _experts(rng, "q8g", 2, 32, 32), _experts(rng, "f32", 1, 32, 32)
    assert gated_experts_one_token(np.ones((1, 32), np.float32), [*q8, *f32], None) is None
    one = np.ones((1, 32), np.float32)
    assert gated_experts_one_token(one, [*f32, *_experts(rng, "bf16", 1, 32, 32)], None) is None
    assert gated_experts_one_token(one, [*f32, *_experts(rng, "f32", 1, 64, 32)], None) is None
    q4 = _experts(rng, "q4g", 1, 32, 32)
    mx = _experts(rng, "mxfp4", 1, 32, 32)
    assert gated_experts_one_token(np.ones((1, 32), np.float32), [*q8, *q4, *mx], None) is None
    assert gated_experts_one_token(np.ones((1, 32), np.float32), [*q8, *_experts(rng, "q8g", 1, 64, 32)], None) is None


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize(("routed", "shared"), [("q4g", "q8g"), ("mxfp4", "q8g"), ("q8g", "q4g")])
def test_gated_experts_one_token_two_formats_equal_one_by_one(routed: str, shared: str, act) -> None:
    """A q4 layer's q4g routed experts with its q8g shared expert (and the other pairs) in one
    batch: every row bit for bit the expert's own MLP, wherever the shared expert sits."""
    rng = np.random.default_rng(47)
    experts = [*_experts(rng, routed, 5, 64, 96), *_experts(rng, shared, 1, 64, 96)]
    x = (4 * rng.standard_normal((1, 96))).astype(np.float32)
    for order in (np.arange(6), rng.permutation(6)):
        got = gated_experts_one_token(x, [experts[i] for i in order], act)
        for row, want in zip(got, _one_by_one(x, [experts[i] for i in order], act), strict=True):
            np.testing.assert_array_equal(row, want)


@pytest.mark.parametrize("act", ACTIVATIONS[:2])
@pytest.mark.parametrize(("routed", "shared", "n_shared"),
                         [("q4g", "q8g", 1), ("mxfp4", "mxfp4", 0), ("q8g", "q8g", 2), ("f32", "f32", 1),
                          ("bf16", "bf16", 1)])
def test_gated_experts_sum_one_token_equals_the_rows_added(routed: str, shared: str, n_shared: int, act) -> None:
    """The one-call sum of a decode step: the weighted rows in order, then the unweighted ones,
    bit for bit add_weighted and += over gated_experts_one_token's rows (large, mixed-sign
    outputs, so a sum taken in another order or with a fused multiply-add would differ)."""
    rng = np.random.default_rng(53)
    experts = [*_experts(rng, routed, 6, 64, 96), *_experts(rng, shared, n_shared, 64, 96)]
    x = (8 * rng.standard_normal((1, 96))).astype(np.float32)
    weights = rng.uniform(0, 3, 6).astype(np.float32)
    rows = gated_experts_one_token(x, experts, act)
    want = np.zeros(96, np.float32)
    add_weighted(want, rows[:6], weights)
    for row in rows[6:]:
        want += row
    got = gated_experts_sum_one_token(x, experts, weights, act)
    assert got.shape == (96,) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    other = "q8g" if routed in ("f32", "bf16") else "f32"  # a format the others cannot run with
    assert gated_experts_sum_one_token(x, [*experts, *_experts(rng, other, 1, 64, 96)], weights, act) is None
    with pytest.raises(WasteError, match="weights for"):
        gated_experts_sum_one_token(x, experts[:3], weights, act)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("routed", "shared", "act"), [("q4g", "q8g", None), ("mxfp4", None, (4.0, 25.0)),
                                                   ("f32", "f32", None), ("bf16", None, (2.0, None))])
def test_expert_tables_route_and_sum_equals_routing_then_summing(routed: str, shared: str | None, act, threads: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step from the tables, in one call: the ids and weights of router_logits and
    route (grouped, biased choice), and the sum of gated_experts_sum_one_token over the chosen
    experts in id order (then the shared ones), bit for bit; routed on x, run on z. While a
    chosen expert has no rows, the routing alone, and no sum. The q formats' call is one
    parallel region whatever the threads it is given (3: more than the cores, whose work the
    others take: `waste.kernels.steal`)."""
    monkeypatch.setattr(moe_step, "num_threads", lambda: threads)
    rng = np.random.default_rng(61)
    E, k, D, I = 21, 4, 96, 64  # 21 experts: router work items of 8, 8 and 5
    experts = _experts(rng, routed, E, I, D)
    shared_expert = _experts(rng, shared, 1, I, D)[0] if shared else None
    router_weight = rng.standard_normal((E, 48)).astype(np.float32)
    bias = rng.uniform(-0.1, 0.1, E).astype(np.float32)
    router = (router_weight, bias, k, 3, 2, True, np.float32(2.5), True)  # 3 groups keep 2; biased weights
    tables = ExpertTables(E, shared_expert, act)
    for e in range(E - 1):  # the last expert has no rows yet
        tables.add(e, experts[e])
    seen = 0
    for _ in range(12):
        x = rng.standard_normal((1, 48)).astype(np.float32)
        z = (4 * rng.standard_normal((1, D))).astype(np.float32)
        want_ids, want_weights = route(router_logits(x, router_weight), bias, top_k=k, num_groups=3, topk_group=2,
                                       scaling=2.5, router_weights="biased")
        ids, weights, unique, y = tables.route_and_sum(x, z, router)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(weights, want_weights)
        np.testing.assert_array_equal(unique, np.sort(want_ids[0]))
        if E - 1 in unique:
            assert y is None
            continue
        seen += 1
        chosen = [experts[e] for e in unique] + ([shared_expert] if shared_expert else [])
        want = gated_experts_sum_one_token(z, chosen, want_weights[0, np.argsort(want_ids[0])], act)
        np.testing.assert_array_equal(y, want)
    assert seen >= 6


def test_add_weighted_equals_numpy_row_by_row() -> None:
    rng = np.random.default_rng(44)
    outs = (rng.standard_normal((7, 50)) * 1e3).astype(np.float32)
    weights = rng.uniform(0, 1, 7).astype(np.float32)
    want = np.zeros(50, np.float32)
    for e in range(7):
        want += weights[e] * outs[e]
    got = np.zeros(50, np.float32)
    add_weighted(got, outs, weights)
    np.testing.assert_array_equal(got, want)


def test_add_weighted_rows_gives_numpys_bits() -> None:
    """A prefill adds each expert's outputs to its tokens' rows: the float32 products rounded
    before the sums, as NumPy's `y[rows] += w[:, None] * outs` (no fused multiply-add), onto
    rows an earlier expert already wrote; outputs given as a view of wider rows, as the
    experts' kernels return them."""
    rng = np.random.default_rng(71)
    y = rng.standard_normal((30, 96)).astype(np.float32)
    want = y.copy()
    for n in (7, 12, 1):
        rows = np.sort(rng.choice(30, n, replace=False)).astype(np.int64)
        w = rng.uniform(0, 1, n).astype(np.float32)
        outs = rng.standard_normal((n, 112)).astype(np.float32)[:, :96]
        want[rows] += w[:, None] * outs
        add_weighted_rows(y, rows, w, outs)
    np.testing.assert_array_equal(y, want)
    with pytest.raises(WasteError, match="add_weighted_rows"):
        add_weighted_rows(y, np.arange(2), np.ones(2, np.float32), np.ones((3, 96), np.float32))
