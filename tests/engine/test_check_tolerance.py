"""`waste check`'s tolerance follows from the rounding model propagated through the model (the
oracle with the engine's activation rounding), it passes correct engines (K3's AttnRes included)
and fails a broken one; the check against the source checkpoint (`--source`) counts the formats'
error bounds and tells q8 from q4."""

from __future__ import annotations

import numpy as np
import pytest

from waste.cli import main
from waste.config import load_preset
from waste.container.reader import open_container
from waste.container.source import CheckpointSource
from waste.engine.check import (
    INT8_ACTIVATION_REL_ERROR,
    SAFETY_FACTOR,
    WEIGHT_REL_ERROR,
    check_against_oracle,
    products_in_series,
    source_tolerance,
)
from waste.engine.model import Model
from waste.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from waste.kernels.quant import quantize
from waste.reference.quant import reference_dequantize
from waste.testing import tiny_checkpoint, tiny_container


def _prompt(vocab, n=40, seed=2):
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


@pytest.fixture(scope="module")
def k3_q8(tmp_path_factory):
    """K3's default conversion: q8 trunk, MXFP4 experts kept as stored."""
    return tiny_container(tmp_path_factory.mktemp("k3"), quant="q8", preset="k3-tiny", expert_format="mxfp4")


def test_k3_default_conversion_passes_at_the_modelled_tolerance(k3_q8):
    """AttnRes does not damp relative errors as a residual stream does: the rounding model sees
    that (k3-tiny's modelled error is above tiny's) and the check passes at SAFETY_FACTOR times it."""
    with open_container(k3_q8) as c:
        report = check_against_oracle(c, _prompt(c.config.vocab_size), 4)
    assert report.passed, report.format()
    assert report.tolerance == pytest.approx(SAFETY_FACTOR * report.modelled_error, rel=1e-6)
    assert report.modelled_error > 2e-2, report.format()
    assert "modelled error" in report.format()


@pytest.mark.parametrize("preset", ["tiny", "k3-tiny"])
def test_a_broken_engine_fails(tiny_pair, k3_q8, preset):
    """Logits 5% too large (the final norm's weights scaled by 1.05) fail the check."""
    path = tiny_pair["q8"] if preset == "tiny" else k3_q8
    with open_container(path) as c:
        model = Model(c)
        model.final_norm = model.final_norm * np.float32(1.05)
        report = check_against_oracle(c, _prompt(c.config.vocab_size), 4, model=model)
    assert not report.passed and report.logits_error > report.tolerance, report.format()


@pytest.mark.parametrize("quant", ["q8", "q4"])
def test_rounding_model_matches_the_engine_error(tiny_pair, quant):
    """The rounding-model oracle moves from the exact one by about what the engine does (measured:
    the same within 2%), and tiny q8 and q4 pass."""
    with open_container(tiny_pair[quant]) as c:
        report = check_against_oracle(c, _prompt(c.config.vocab_size), 4)
    assert report.passed, report.format()
    assert 0.3 < report.logits_error / report.modelled_error < 3, report.format()
    assert 5e-3 < report.modelled_error < 5e-2, report.format()


def test_products_in_series_counted_from_the_config():
    # tiny: 5 layers x 3 (attention) + 2 (the dense FFN) + 1 (lm_head) trunk; 4 MoE layers x 2 expert products.
    tiny = products_in_series(load_preset("tiny"))
    assert (tiny.trunk, tiny.experts, tiny.trunk_weights) == (18, 8, 19)
    # k3-tiny: the latent MoE adds its down and up projections around the experts of 4 layers.
    k3 = products_in_series(load_preset("k3-tiny"))
    assert (k3.trunk, k3.experts, k3.trunk_weights) == (26, 8, 27)


@pytest.mark.parametrize("fmt", ["q8g", "q4g", "mxfp4"])
def test_weight_error_bounds_hold_on_normal_weights(fmt):
    """Each format's WEIGHT_REL_ERROR is an estimate for normal weights: the measured relative RMS
    error of quantising N(0, 1) weights lies below it and not far below (within a factor 2)."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((256, 1024)).astype(np.float32)
    if fmt == "mxfp4":
        back = dequantize_mxfp4(*quantize_mxfp4(w)).astype(np.float64)
    else:
        back = reference_dequantize(quantize(w, fmt))
    measured = np.linalg.norm(back - w) / np.linalg.norm(w)
    assert WEIGHT_REL_ERROR[fmt] / 2 < measured <= WEIGHT_REL_ERROR[fmt], (fmt, measured)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """q8 and q4 containers converted from one float32 checkpoint."""
    root = tmp_path_factory.mktemp("source")
    return {quant: tiny_container(root, quant=quant) for quant in ("q8", "q4")}


def test_source_check_separates_q8_from_q4(tiny_pair):
    """Against the unquantised checkpoint q8 passes its bound and q4 its own, q8's is well below
    q4's, and q4 held to q8's bound fails: the bounds tell the formats apart."""
    reports, bounds = {}, {}
    for quant, path in tiny_pair.items():
        source = CheckpointSource(tiny_checkpoint(path))
        with open_container(path) as c:
            prompt = [int(t) for t in np.random.default_rng(2).integers(0, c.config.vocab_size, 40)]
            bounds[quant] = source_tolerance(c, source)
            reports[quant] = check_against_oracle(c, prompt, 4, source=source)
    for quant, r in reports.items():
        assert r.tolerance == bounds[quant] and r.passed, r.format()
        assert r.oracle.startswith("checkpoint ")
    assert bounds["q8"] < bounds["q4"] / 4
    worst_q4 = max(*reports["q4"].layer_errors, reports["q4"].logits_error)
    assert worst_q4 > bounds["q8"], reports["q4"].format()
    # The source check sees more than the stored-weights check: the weight format's own error.
    with open_container(tiny_pair["q4"]) as c:
        own = check_against_oracle(c, reports["q4"].ids[:40], 4)
    assert reports["q4"].logits_error > 2 * own.logits_error


def test_source_bounds_by_format():
    """Weight errors enter where the storage rounds the checkpoint's values, not where it keeps them."""
    cfg = load_preset("k3-tiny")
    n = products_in_series(cfg)

    class Stub:
        config = cfg

        def __init__(self, scheme, experts):
            self.scheme, self.expert_storage = scheme, experts

    class Source:
        def __init__(self, dtypes, experts):
            self._dtypes, self._experts = dtypes, experts

        def matrix_dtypes(self):
            return self._dtypes

        def expert_format(self):
            return self._experts

    a, w8 = INT8_ACTIVATION_REL_ERROR, WEIGHT_REL_ERROR["q8g"]
    # K3's default: q8 trunk, MXFP4 experts kept verbatim from an MXFP4 checkpoint.
    got = source_tolerance(Stub("q8", "mxfp4"), Source({"BF16"}, "mxfp4"))
    assert got == pytest.approx((1e-10 + a**2 * (n.trunk + n.experts) + w8**2 * n.trunk_weights) ** 0.5)
    # The same experts requantised from a float checkpoint carry MXFP4's own error.
    requantised = source_tolerance(Stub("q8", "mxfp4"), Source({"F32"}, "float"))
    assert requantised == pytest.approx((got**2 + WEIGHT_REL_ERROR["mxfp4"] ** 2 * n.experts) ** 0.5)
    # An f32 container is exact whatever the checkpoint; bf16 is exact from bf16 only.
    assert source_tolerance(Stub("f32", "f32"), Source({"BF16"}, "float")) == pytest.approx(1e-5)
    assert source_tolerance(Stub("bf16", "bf16"), Source({"BF16"}, "float")) < source_tolerance(
        Stub("bf16", "bf16"), Source({"F32"}, "float"))


def test_check_cli_source(tiny_pair, tmp_path, capsys):
    path = tiny_pair["q8"]
    hf = tiny_checkpoint(path)
    assert main(["check", str(path), "--source", str(hf), "--prompt-len", "20", "--new", "2"]) == 0
    out = capsys.readouterr().out
    assert "oracle reads checkpoint" in out and "PASS" in out
    assert main(["check", str(path), "--source", str(tmp_path / "absent"), "--prompt-len", "4", "--new", "1"]) == 2
    err = capsys.readouterr().err
    assert "absent" in err and err.count("\n") == 1
    # Another seed's checkpoint has the same config but other weights: refused, not checked.
    other = tiny_checkpoint(tiny_container(tmp_path / "other", quant="q8", seed=5))
    assert main(["check", str(path), "--source", str(other), "--prompt-len", "4", "--new", "1"]) == 2
    err = capsys.readouterr().err
    assert "differs from the container's" in err and err.count("\n") == 1
