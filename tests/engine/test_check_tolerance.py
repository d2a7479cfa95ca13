"""`waste check`'s tolerance follows from the rounding model propagated through the model (the
oracle with the engine's activation rounding), it passes correct engines (K3's AttnRes included)
and fails a broken one; against the source checkpoint (`--source`) the same model also carries the
weights' own error, tells q8 from q4, and every stored matrix is held to its format's estimate."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from waste.cli import main
from waste.container.reader import open_container
from waste.container.source import CheckpointSource
from waste.engine.check import (
    SAFETY_FACTOR,
    WEIGHT_BOUND_FACTOR,
    WEIGHT_REL_ERROR,
    CheckReport,
    WeightCheck,
    check_against_oracle,
    weight_check,
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
    """Against the unquantised checkpoint q8 and q4 pass their tolerances (the rounding model over
    the stored weights against the exact oracle over the checkpoint's), q8's is well below q4's,
    and q4 held to q8's tolerance fails: the check tells the formats apart."""
    reports = {}
    for quant, path in tiny_pair.items():
        source = CheckpointSource(tiny_checkpoint(path))
        with open_container(path) as c:
            reports[quant] = check_against_oracle(c, _prompt(c.config.vocab_size), 4, source=source)
    for r in reports.values():
        assert r.passed and r.oracle.startswith("checkpoint "), r.format()
        assert r.tolerance == pytest.approx(SAFETY_FACTOR * r.modelled_error, rel=1e-6)
        assert r.weights is not None and r.weights.passed and "weights against the checkpoint" in r.format()
    assert reports["q8"].tolerance < reports["q4"].tolerance / 4
    worst_q4 = max(*reports["q4"].layer_errors, reports["q4"].logits_error)
    assert worst_q4 > reports["q8"].tolerance, reports["q4"].format()
    # The source check sees more than the stored-weights check: the weight format's own error.
    with open_container(tiny_pair["q4"]) as c:
        own = check_against_oracle(c, reports["q4"].ids[:40], 4)
    assert reports["q4"].logits_error > 2 * own.logits_error


def test_k3_source_check_passes_with_margin(tmp_path):
    """K3's default conversion from a bfloat16 checkpoint (q8 trunk, MXFP4 experts kept verbatim).
    Counting products in series put its tolerance at 4.4e-2 while this seed measures 5.8e-2; the
    model propagated through AttnRes predicts the engine (measured within 1.00-1.12 over seeds 0-2)."""
    path = tiny_container(tmp_path, quant="q8", preset="k3-tiny", dtype="bf16", expert_format="mxfp4", seed=0)
    source = CheckpointSource(tiny_checkpoint(path))
    with open_container(path) as c:
        report = check_against_oracle(c, _prompt(c.config.vocab_size), 4, source=source)
    worst = max(*report.layer_errors, report.logits_error)
    assert report.passed and worst < 0.8 * report.tolerance, report.format()
    assert worst > 4.4e-2, report.format()  # the case the count could not hold
    assert report.weights.storage == "q8g"  # the MXFP4 experts equal the checkpoint's: never the worst


class _Altered:
    """A checkpoint source whose matrix `name` reads as `change(values)`."""

    def __init__(self, source, name, change):
        self.source, self.name, self.change = source, name, change

    def matrix(self, name):
        m = self.source.matrix(name)
        if name != self.name:
            return m
        return type(m)(m.fmt, m.shape, {"w": self.change(m.buffers["w"])})

    def expert(self, layer, e):
        return self.source.expert(layer, e)


def test_weight_check_catches_a_bad_conversion(tiny_pair, tmp_path):
    """A stored matrix 2% off its checkpoint (a wrong scale) is 3.5x q8g's estimate: the check fails
    and names it. An exact storage (f32) must reproduce the checkpoint bit for bit: one changed
    value fails it."""
    path = tiny_pair["q8"]
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    source = CheckpointSource(tiny_checkpoint(path))
    with open_container(path) as c:
        good = weight_check(c, source)
        bad = weight_check(c, _Altered(source, name, lambda w: w * np.float32(1.02)))
    assert good.passed and good.error <= WEIGHT_BOUND_FACTOR * WEIGHT_REL_ERROR["q8g"]
    assert not bad.passed and bad.name == name and bad.error > 0.015
    f32 = tiny_container(tmp_path, quant="f32")
    f32_source = CheckpointSource(tiny_checkpoint(f32))

    def one_value_off(w):
        w = w.copy()
        w[0, 0] = np.nextafter(w[0, 0], np.float32(np.inf))
        return w

    with open_container(f32) as c:
        exact = weight_check(c, f32_source)
        off = weight_check(c, _Altered(f32_source, name, one_value_off))
    assert exact.passed and exact.error == 0.0 and exact.estimate == 0.0
    assert not off.passed and off.name == name and "ABOVE BOUND" in off.format()


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


def test_a_failed_check_names_what_failed():
    """The failure line names each failed criterion and no other (a weight check failing with the
    logits within tolerance once read 'relative error ... above tolerance')."""
    weights_off = WeightCheck(name="model.layers.1.mlp.up_proj.weight", storage="q8g", error=0.02,
                              estimate=WEIGHT_REL_ERROR["q8g"], matrices=12)
    report = CheckReport(scheme="q8", experts="q8g", tolerance=1e-2, ids=[1, 2, 3], prompt_len=2,
                         layer_kinds=["kda"], layer_errors=[1e-3], logits_error=2e-3, logits_max_abs=5.0,
                         greedy_agree=3, greedy_clear=3, greedy_clear_agree=3, weights=weights_off)
    assert not report.passed
    (only,) = report.failures()
    assert only.startswith("stored weights unlike the checkpoint's: model.layers.1.mlp.up_proj.weight (q8g)")
    worse = dataclasses.replace(report, logits_error=0.5, greedy_disagreements=[2])
    assert [f.split()[0] for f in worse.failures()] == ["relative", "greedy", "stored"]
    good = dataclasses.replace(report, weights=dataclasses.replace(weights_off, error=1e-3))
    assert good.passed and good.failures() == []


def test_a_clear_margin_disagreement_fails_the_check(tmp_path_factory):
    """An engine whose greedy choice differs where the oracle's margin is clear (the logits
    negated: every argmax becomes the argmin) fails on that alone, naming the positions."""
    q4 = tiny_container(tmp_path_factory.mktemp("greedy") / "q4", quant="q4")
    with open_container(q4) as c:
        model = Model(c)
        model.final_norm = -model.final_norm
        prompt = [int(t) for t in np.random.default_rng(2).integers(0, c.config.vocab_size, 20)]
        report = check_against_oracle(c, prompt, 4, model=model)
    assert report.greedy_clear > 0 and len(report.greedy_disagreements) == report.greedy_clear
    assert any(f.startswith("greedy disagreement at positions") for f in report.failures())
