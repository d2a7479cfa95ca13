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
import importlib.metadata
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def mlx_side(ckpt: Path, prompt_len: int, new: int, out: Path) -> None:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    config = json.loads((ckpt / "config.json").read_text())
    if "text_config" not in config:  # mlx-lm's kimi_linear asks for these; NoPE MLA with its dimensions uses neither
        config.update(head_dim=config["v_head_dim"], rope_theta=10000.0)
        (ckpt / "config.json").write_text(json.dumps(config))
    model, _ = load_model(ckpt, strict=True)
    ids = np.random.default_rng(0).integers(0, config.get("text_config", config)["vocab_size"], prompt_len)
    prefill = model(mx.array(ids)[None])[0]
    cache = model.make_cache()
    last = model(mx.array(ids)[None], cache=cache)[0, -1]
    generated, steps = [], []
    for _ in range(new):
        token = int(mx.argmax(last).item())
        last = model(mx.array([[token]]), cache=cache)[0, -1]
        generated.append(token)
        steps.append(np.array(last.astype(mx.float32)))
    versions = {n: importlib.metadata.version(n) for n in ("mlx", "mlx-lm")}
    np.savez(out, ids=ids, logits=np.array(prefill.astype(mx.float32)), generated=np.array(generated, np.int64),
             decode_logits=np.stack(steps), versions=np.array(json.dumps(versions)))


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
        golden = Path(tmp) / "mlx.npz"
        mlx_side(ckpt, args.prompt_len, args.new, golden)
        print(f"{args.preset}, mlx-lm against waste's engine:", flush=True)
        subprocess.run([str(args.venv / "bin" / "python"), __file__, args.preset, "--engine-side", str(ckpt),
                        str(golden), str(Path(tmp) / "work")], check=True)


if __name__ == "__main__":
    sys.exit(main())
