"""The engine and the float64 oracle against implementations written by others.

tests/golden/ holds tiny random checkpoints and what other implementations computed from them
(`tools/make_goldens.py` regenerates them; versions inside each file): transformers'
`KimiLinearForCausalLM` (a prompt's logits), and mlx-lm's `kimi_linear` and `kimi_k3` (a
prompt's logits, then greedy tokens decoded through its cache with their logits). Each
checkpoint is converted with float32 weights (K3's MXFP4 experts as their exact float32
values), so the engine is held to float32 rounding; `golden_agreements` runs the engine and the
oracle on each golden's prompt and decode and says how far they are from it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from waste.container import open_container
from waste.container.convert import convert
from waste.engine.model import Model
from waste.errors import WasteError
from waste.reference.model import ReferenceModel

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "tests" / "golden"
# How far from a golden the oracle and the engine may be (relative L2 of the logits). A golden is
# float32 arithmetic through a tiny model's few layers: how far it is from the exact result is
# what the float64 oracle measures, at most 1.25e-6 (mlx-lm's kimi_linear, the longest prompt),
# and that is the same on every machine, so the oracle is held to twice it: a misreading of the
# specification worth a few 1e-6 (MLA's layernorm epsilon at 1e-5 instead of 1e-6: 1.5e-6 to
# 3.1e-6) shows. The float32 engine adds rounding of its own, which moves with its kernels (its
# K3 decode steps 3.1e-6 and 1.9e-6 at two commits of 2026-12-05): about 2.5 times the largest seen.
ORACLE_GOLDEN_RTOL = 2.5e-6
ENGINE_GOLDEN_RTOL = 8e-6
# (golden file, checkpoint directory, whose numbers they are)
GOLDENS = (
    ("kimi_linear_tiny.npz", "kimi_linear_tiny", "transformers KimiLinearForCausalLM"),
    ("kimi_linear_tiny_mlx.npz", "kimi_linear_tiny", "mlx-lm kimi_linear"),
    ("k3_tiny_mlx.npz", "k3_tiny", "mlx-lm kimi_k3"),
    ("k3_tiny_variant_mlx.npz", "k3_tiny_variant", "mlx-lm kimi_k3"),
)


@dataclass
class GoldenAgreement:
    """How far the engine and the oracle are from one golden (relative L2 of the logits)."""

    golden: str
    checkpoint: str
    implementation: str
    versions: dict[str, str]
    prompt_len: int
    prompt_error: float  # the engine's prefill logits
    worst_position: float  # the engine's worst single prompt position
    oracle_error: float | None  # the float64 oracle's logits over the prompt (None: not run)
    decoded: int  # greedy tokens the golden decoded through its cache (0: a prompt only)
    decode_error: float | None  # the engine's decode steps' logits
    tokens_agreed: int | None  # of `decoded`, the engine's greedy choices equal to the golden's


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def _digest(checkpoint: Path) -> str:
    """A short hash of a checkpoint directory's files (names and bytes): the name of its
    conversion, so that a regenerated checkpoint is converted afresh."""
    h = hashlib.sha256()
    for f in sorted(checkpoint.iterdir()):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def golden_agreements(work_dir: Path, golden_dir: Path = GOLDEN_DIR, goldens: Sequence[tuple[str, str, str]] = GOLDENS,
                      *, oracle: bool = True) -> list[GoldenAgreement]:
    """Convert each golden's checkpoint (float32 trunk and experts) into work_dir, once per
    version of its files, and hold the engine (prefill, then the golden's tokens decoded one step
    at a time) and, with `oracle`, the float64 oracle to the golden's logits."""
    missing = [f for name, checkpoint, _ in goldens for f in (name, checkpoint) if not (golden_dir / f).exists()]
    if missing:
        raise WasteError(f"{golden_dir}: no {', '.join(missing)} (the goldens come with the repository's tests; "
                         f"tools/make_goldens.py writes them)")
    work_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, checkpoint, implementation in goldens:
        container = work_dir / f"{checkpoint}-{_digest(golden_dir / checkpoint)}.waste"
        if not container.exists():
            convert(golden_dir / checkpoint, container, quant="f32", experts="f32", progress=False)
        with np.load(golden_dir / name) as f:
            g = {k: f[k] for k in f.files}
        ids = [int(t) for t in g["ids"]]
        generated = [int(t) for t in g.get("generated", [])]
        with open_container(container) as c:
            model = Model(c)
            session = model.new_session(len(ids) + len(generated))
            prompt = model.prefill(session, ids, all_logits=True)
            last, steps, agreed = prompt[-1], [], 0
            for token in generated:  # the golden's own tokens, so a disagreement does not cascade
                agreed += int(np.argmax(last)) == token
                last = model.decode(session, token)
                steps.append(last)
            reference = ReferenceModel(c).forward(np.array(ids)).logits if oracle else None
        rows.append(GoldenAgreement(
            golden=name, checkpoint=checkpoint, implementation=implementation,
            versions=json.loads(str(g["versions"])), prompt_len=len(ids),
            prompt_error=_relative(prompt, g["logits"]),
            worst_position=max(_relative(row, want) for row, want in zip(prompt, g["logits"], strict=True)),
            oracle_error=_relative(reference, g["logits"]) if reference is not None else None,
            decoded=len(generated), decode_error=_relative(np.stack(steps), g["decode_logits"]) if steps else None,
            tokens_agreed=agreed if generated else None))
    return rows


def format_agreements(rows: Sequence[GoldenAgreement]) -> str:
    """A table of `golden_agreements`, one row a golden."""
    head = f"{'implementation':36s} {'checkpoint':16s} {'engine prompt':>13s} {'worst position':>14s} " \
           f"{'oracle prompt':>13s} {'engine decode':>13s} {'tokens':>7s}"
    lines = [head, "-" * len(head)]

    def cell(x: float | None, width: int) -> str:
        return f"{x:{width}.2e}" if x is not None else f"{'-':>{width}s}"

    for r in rows:
        tokens = f"{r.tokens_agreed}/{r.decoded}" if r.tokens_agreed is not None else "-"
        lines.append(f"{r.implementation:36s} {r.checkpoint:16s} {r.prompt_error:13.2e} {r.worst_position:14.2e} "
                     f"{cell(r.oracle_error, 13)} {cell(r.decode_error, 13)} {tokens:>7s}")
    return "\n".join(lines)
