"""Synthesis straight to a container: the bytes of synth-then-convert, bounded memory, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from waste.cli import main
from waste.container import open_container
from waste.container.convert import convert
from waste.errors import WasteError
from waste.kernels import mxfp4
from waste.synth import synthesize
from waste.synth_container import synthesize_container
from waste.testing import tiny_config


def _manifest_without_source(path: Path) -> dict:
    """The manifest but its `source` and the checksum over it, which say where the bytes came from."""
    m = json.loads((path / "manifest.json").read_text())
    m.pop("source", None)
    m.pop("checksum", None)
    return m


@pytest.mark.parametrize("quant", ["f32", "q8", "q4", "q4all"])
def test_same_bytes_as_synth_then_convert(tmp_path: Path, quant: str) -> None:
    cfg = tiny_config(q_lora_rank=16)
    hf = synthesize(cfg, tmp_path / "hf", seed=3, dtype="f32")
    via_checkpoint = convert(hf, tmp_path / "a.waste", quant=quant, progress=False)
    # One worker and a pending bound smaller than any tensor, then a pool that runs ahead:
    # the bytes must not depend on the pipeline.
    direct = synthesize_container(cfg, tmp_path / "b.waste", quant=quant, seed=3, progress=False, threads=1,
                                  max_pending_bytes=1)
    pooled = synthesize_container(cfg, tmp_path / "c.waste", quant=quant, seed=3, progress=False, threads=3)
    for name in ("trunk.bin", "experts.bin"):
        expected = (via_checkpoint / name).read_bytes()
        assert (direct / name).read_bytes() == expected, name
        assert (pooled / name).read_bytes() == expected, name
    assert _manifest_without_source(direct) == _manifest_without_source(via_checkpoint)
    side_files = sorted(p.relative_to(via_checkpoint) for p in via_checkpoint.rglob("*") if p.is_file())
    assert side_files == sorted(p.relative_to(direct) for p in direct.rglob("*") if p.is_file())
    for name in side_files:
        if name.name != "manifest.json":
            assert (direct / name).read_bytes() == (via_checkpoint / name).read_bytes(), name
    other_seed = synthesize_container(cfg, tmp_path / "d.waste", quant=quant, seed=4, progress=False)
    assert (other_seed / "experts.bin").read_bytes() != (direct / "experts.bin").read_bytes()
    with open_container(direct) as c:
        c.verify()
        assert c.manifest["source"]["synth"] == {"seed": 3, "dtype": "f32"}


@pytest.mark.parametrize(("preset", "quant"), [("k3-tiny", "q8"), ("k3-tiny", "f32"), ("k3-mini", "q4")])
def test_k3_same_bytes_as_synth_then_convert(tmp_path: Path, preset: str, quant: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A K3 config's routed experts go in as MXFP4, the bytes synth's checkpoint holds and convert
    keeps: the same container as synth then convert, its experts MXFP4 (was refused). Neither
    path repacks them for the kernels: the writer stores the bytes as they are."""
    hf = synthesize(preset, tmp_path / "hf", seed=5, dtype="f32")

    def no_repack(*args: object) -> None:
        raise AssertionError("an MXFP4 expert was repacked for the kernels on its way to the container")

    with monkeypatch.context() as patched:
        patched.setattr(mxfp4, "repack_interleaved", no_repack)
        via_checkpoint = convert(hf, tmp_path / "a.waste", quant=quant, progress=False)
        direct = synthesize_container(preset, tmp_path / "b.waste", quant=quant, seed=5, progress=False,
                                      threads=2, max_pending_bytes=1)
    for name in ("trunk.bin", "experts.bin"):
        assert (direct / name).read_bytes() == (via_checkpoint / name).read_bytes(), name
    assert _manifest_without_source(direct) == _manifest_without_source(via_checkpoint)
    with open_container(direct) as c:
        c.verify()
        assert c.byte_counts()["expert_storage"] == "mxfp4"


def test_cli_writes_a_container(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.waste"
    assert main(["synth", "tiny", str(out), "--quant", "q4", "--seed", "1", "--quiet"]) == 0
    assert "scheme q4" in capsys.readouterr().out
    assert main(["verify", str(out)]) == 0
    assert main(["synth", "tiny", str(out), "--quant", "q4"]) == 2  # exists, no --force
    for flags in (["--dtype", "f32"], ["--dtype", "bf16"], ["--expert-format", "mxfp4"], ["--shard-size", "512M"],
                  ["--attn-res-spelling", "dotted"]):
        assert main(["synth", "tiny", str(tmp_path / "x.waste"), "--quant", "q4", *flags]) == 2
        assert f"{flags[0]} describes a checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "x.waste").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_a_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import waste.synth_container as sc

    def broken(name: str, *args: object) -> np.ndarray:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sc, "synth_values", broken)
    # A write's error without a file name is said with the container's
    with pytest.raises(WasteError, match=r"t\.waste: cannot write the container: No space left on device"):
        synthesize_container("tiny", tmp_path / "t.waste", quant="q8", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_router_spreads_over_the_experts(tmp_path: Path) -> None:
    """Random weights must not route every token to a few experts: over a 96-token prompt and 8
    decoded tokens each MoE layer of a wider tiny (16 experts, top-2) uses them all, with an
    entropy near uniform's and no expert above 2.5x its uniform share. (On `mini`, 64 experts
    top-8, 256 + 16 tokens: normalised entropy 0.99 and at most 1.6x uniform in every layer.)"""
    from waste.analysis.trace_stats import entropy, popularity
    from waste.engine.model import Model
    from waste.engine.trace import TraceRecorder

    out = synthesize_container(tiny_config(num_experts=16), tmp_path / "t.waste", quant="q8", progress=False)
    with open_container(out) as c:
        cfg = c.config
        model = Model(c)
        recorder = TraceRecorder(cfg.num_layers, cfg.moe_layers, cfg.num_experts_per_token)
        session = model.new_session(128)
        model.prefill(session, np.random.default_rng(0).integers(0, cfg.vocab_size, 96), observer=recorder,
                      all_logits=False)
        token = int(np.argmax(session.last_logits))
        for _ in range(8):
            token = int(np.argmax(model.decode(session, token, observer=recorder)))
        counts = popularity(recorder.trace())
    uniform = counts.sum(1) / cfg.num_experts
    assert (counts > 0).all(), counts
    assert (entropy(counts, normalized=True) > 0.9).all(), entropy(counts, normalized=True)
    assert (counts.max(1) < 2.5 * uniform).all(), counts.max(1) / uniform
