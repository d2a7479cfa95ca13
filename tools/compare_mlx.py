"""The engine against mlx-lm on a preset larger than the stored goldens (not needed for `make test`).

tests/golden/ holds tiny checkpoints only; this checks a preset at its own shape once, without
storing anything: `waste synth PRESET --dtype f32` into a temporary directory, mlx-lm's model
(kimi_linear or kimi_k3, loaded by its own `load_model`) on a random prompt and greedy tokens
decoded through its cache, then waste's engine on the same checkpoint converted with float32
weights (K3's MXFP4 experts as their exact values), fed the same prompt and tokens. Prints the
relative L2 of the logits over the prompt and over the decode steps, the worst prompt position,
and how many of mlx-lm's greedy tokens the engine chose.

Run it with the mlx environment of tools/make_goldens.py; it calls the repository's venv for
waste's side:

    /work/mlx-venv/bin/python tools/compare_mlx.py k3-mini --prompt-len 200 --new 16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from make_goldens import mlx_outputs, mlx_readable  # tools/, beside this file

ROOT = Path(__file__).resolve().parents[1]


def engine_side(preset: str, ckpt: Path, golden: Path, work: Path) -> None:
    from waste.analysis.goldens import format_agreements, golden_agreements

    rows = golden_agreements(work, ckpt.parent, goldens=[(golden.name, ckpt.name, f"mlx-lm, {preset}")], oracle=False)
    print(format_agreements(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset")
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv", help="the repository's venv (waste's side)")
    parser.add_argument("--engine-side", nargs=3, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_side:
        engine_side(args.preset, *args.engine_side)
        return
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        subprocess.run([str(args.venv / "bin" / "waste"), "synth", args.preset, str(ckpt), "--dtype", "f32"],
                       check=True, stdout=subprocess.DEVNULL)
        readable = mlx_readable(ckpt, Path(tmp) / "mlx-ckpt")
        vocab = json.loads((ckpt / "config.json").read_text())
        ids = np.random.default_rng(0).integers(0, vocab.get("text_config", vocab)["vocab_size"], args.prompt_len)
        golden = Path(tmp) / "mlx.npz"
        np.savez(golden, **mlx_outputs(readable, ids, args.new))
        print(f"{args.preset}, mlx-lm against waste's engine:", flush=True)
        subprocess.run([str(args.venv / "bin" / "python"), __file__, args.preset, "--engine-side", str(ckpt),
                        str(golden), str(Path(tmp) / "work")], check=True)


if __name__ == "__main__":
    sys.exit(main())
