"""The seed-format kernel comparison: inputs, errors and the table."""

import numpy as np

from waste.analysis.exactness import (
    SEED_FIGURES,
    SEED_SHAPES,
    dims_label,
    format_seed_table,
    kda_errors,
    random_kda_inputs,
)


def test_inputs_have_the_documented_ranges():
    x = random_kda_inputs(5, 2, 8, 4, seed=3)
    assert x["q"].shape == x["k"].shape == x["g"].shape == (5, 2, 8) and x["v"].shape == (5, 2, 4)
    assert all(a.dtype == np.float32 for a in x.values())
    assert (x["g"] < 0).all() and ((x["beta"] > 0) & (x["beta"] < 1)).all()
    again = random_kda_inputs(5, 2, 8, 4, seed=3)
    assert all(np.array_equal(x[n], again[n]) for n in x)


def test_seed_shapes_and_labels():
    # Every seed shape has the seed's figures to compare against (the notebook's table needs both).
    assert set(SEED_FIGURES) == set(SEED_SHAPES)
    assert dims_label(24, 4, 32, 32) == "T=24, H=4, K=V=32"
    assert dims_label(3, 1, 8, 4) == "T=3, H=1, K=8, V=4"


def test_kernels_are_no_worse_than_the_seed_at_its_small_shape():
    """At T=24, H=4, K=V=32 the Numba kernels' errors against the float64 oracle stay within the
    seed C kernel's own figures (output, state), the claim the token-exact notebook makes."""
    shape = SEED_SHAPES[0]
    seed_output, seed_state = SEED_FIGURES[shape]
    for row in (r for r in kda_errors([shape], seed=0) if r.reference.startswith("naive")):
        assert row.output <= seed_output and row.state <= seed_state, row


def test_kernels_agree_with_the_reference_on_small_shapes():
    rows = kda_errors([(7, 2, 8, 8), (20, 3, 16, 8)], seed=1, chunk_size=4)
    assert len(rows) == 10
    assert {r.kernel for r in rows} >= {"kda_decode_step", "kda_decode_step_deferred (engine)"}
    for r in rows:
        assert 0 <= r.output < 1e-5 and 0 <= r.state < 1e-5, r
    table = format_seed_table(rows)
    assert table.count("| dims | output max\\|diff\\| | state max\\|diff\\| |") == 5
    assert "| T=7, H=2, K=V=8 |" in table and "chunk_kda (chunk 4) against recurrent_kda:" in table


def test_decode_steps_follow_the_reference_token_by_token():
    from waste.analysis.exactness import decode_steps
    from waste.reference.kda import naive_recurrent_kda

    x = random_kda_inputs(9, 2, 8, 4, seed=5)
    ref_o, ref_s = naive_recurrent_kda(**x)
    for deferred in (False, True):
        o, s = decode_steps(x, deferred=deferred)
        np.testing.assert_allclose(o, ref_o, atol=1e-6)
        np.testing.assert_allclose(s, ref_s, atol=1e-6)
    # A wrong decay would show: the check can fail.
    bad = dict(x, g=x["g"] * 0.5)
    o, _ = decode_steps(bad, deferred=True)
    assert np.abs(o - ref_o).max() > 1e-3
