"""Engine against the float64 oracle: per-layer hidden-state error, logits error, greedy agreement.

The engine prefills the prompt, then greedily decodes `new` tokens; the oracle runs once
over prompt + generated tokens with no cache. Every position is compared: prompt positions
come from prefill, the rest from decode steps, so this also checks that prefill then
decode equals one full pass.

Routing is discrete: on a quantised container a near-tie between two experts can go the
other way in the engine, and one such flip moves a hidden state by far more than the
rounding that caused it. For quantised schemes the oracle therefore applies the experts
the engine chose (its own router still computes the weights), and the report gives how
often the oracle's own choice agrees. On f32 containers nothing is forced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from waste.engine.model import DEFAULT_PREFILL_CHUNK, Model
from waste.engine.runner import generate
from waste.engine.sampling import Sampler

# Relative L2 error allowed by default, per container scheme. f32 is the 1e-5 (the
# seed's C engine reached 1.58e-06 end to end). Quantised schemes store the same weights
# the oracle dequantises, but the engine also rounds activations to int8 per group of 32
# before each quantised product (about 0.3% per product on tiny) and the error compounds
# through the layers.
DEFAULT_TOLERANCE = {"f32": 1e-5, "q8": 3e-2, "q4": 3e-2}
FORCE_ROUTING = {"f32": False, "q8": True, "q4": True}


class HiddenCapture:
    """Observer that keeps every layer's output hidden state and routing, by position."""

    def __init__(self, num_layers: int, hidden: int, total_positions: int, top_k: int):
        self.hidden = np.full((num_layers, total_positions, hidden), np.nan, np.float32)
        self.routing: dict[int, np.ndarray] = {}
        self.total_positions, self.top_k = total_positions, top_k

    def on_layer(self, layer: int, positions: np.ndarray, hidden: np.ndarray) -> None:
        self.hidden[layer, positions] = hidden

    def on_routing(self, layer, positions, phase, routing, hits) -> None:  # noqa: ANN001
        ids = self.routing.setdefault(layer, np.full((self.total_positions, self.top_k), -1, np.int64))
        ids[positions] = routing.ids


def relative_l2(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| in float64."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(b64), 1e-300))


@dataclass
class CheckReport:
    """Per-layer and logits errors of the engine against the oracle."""

    scheme: str
    tolerance: float
    ids: list[int]
    prompt_len: int
    layer_kinds: list[str]
    layer_errors: list[float]
    logits_error: float
    logits_max_abs: float
    greedy_agree: int
    greedy_required: int
    greedy_disagreements: list[int] = field(default_factory=list)  # positions with a clear margin that disagree
    routing_forced: bool = False
    routing_agreement: float = 1.0  # fraction of (token, MoE layer) where both chose the same expert set
    position_errors: list[float] = field(default_factory=list)  # per position: worst layer's relative L2 error

    @property
    def passed(self) -> bool:
        errs = [*self.layer_errors, self.logits_error]
        return max(errs) <= self.tolerance and not self.greedy_disagreements

    def format(self) -> str:
        lines = [f"check: {len(self.ids)} positions ({self.prompt_len} prefill + {len(self.ids) - self.prompt_len} "
                 f"decode), scheme {self.scheme}, tolerance {self.tolerance:.1e} (relative L2)",
                 f"  {'layer':>5} {'kind':<4} {'rel. L2 error':>14}"]
        for i, (kind, err) in enumerate(zip(self.layer_kinds, self.layer_errors, strict=True)):
            flag = "" if err <= self.tolerance else "  ABOVE TOLERANCE"
            lines.append(f"  {i:>5} {kind:<4} {err:>14.3e}{flag}")
        lines.append(f"  {'logits':>10} {self.logits_error:>14.3e}   (max |diff| {self.logits_max_abs:.3e})")
        lines.append(f"  greedy agreement: {self.greedy_agree}/{len(self.ids)} positions; "
                     f"{self.greedy_required} have a top-2 margin above tolerance, "
                     f"{len(self.greedy_disagreements)} of those disagree")
        forced = " (the oracle applied the engine's experts)" if self.routing_forced else ""
        lines.append(f"  routing agreement: {100 * self.routing_agreement:.2f}% of token-layer expert sets{forced}")
        lines.append("  PASS" if self.passed else "  FAIL")
        return "\n".join(lines)


def check_against_oracle(
    container,  # noqa: ANN001 - an open container
    prompt: Sequence[int],
    new: int,
    *,
    chunk: int = DEFAULT_PREFILL_CHUNK,
    tolerance: float | None = None,
    model: Model | None = None,
    oracle=None,  # noqa: ANN001 - a ReferenceModel, built here when not given
) -> CheckReport:
    """Run engine and oracle on the same ids and compare every layer at every position."""
    from waste.reference.model import ReferenceModel

    cfg = container.config
    model = model or Model(container)
    oracle = oracle or ReferenceModel(container)
    total = len(prompt) + new
    capture = HiddenCapture(cfg.num_layers, cfg.hidden_size, total, cfg.num_experts_per_token)
    session = model.new_session(capacity=total)
    run = generate(model, session, prompt, new, Sampler(), chunk=chunk, observer=capture)
    ids = list(prompt) + run.generated
    engine_logits = run.all_logits()
    force = FORCE_ROUTING[container.scheme]
    ref = oracle.forward(ids, forced_routing=capture.routing if force else None)
    agreement = [np.mean(np.all(np.sort(capture.routing[layer], axis=1) == np.sort(own, axis=1), axis=1))
                 for layer, own in ref.routing.items()]
    layer_errors = [relative_l2(capture.hidden[i], ref.hidden_states[i + 1]) for i in range(cfg.num_layers)]
    want = np.stack([np.asarray(ref.hidden_states[i + 1], np.float64) for i in range(cfg.num_layers)])  # [L, T, D]
    by_position = (np.linalg.norm(capture.hidden.astype(np.float64) - want, axis=-1)
                   / np.maximum(np.linalg.norm(want, axis=-1), 1e-300)).max(axis=0)
    ref_logits = ref.logits
    # A position's greedy choice is only well defined when its top-2 margin exceeds what an
    # error within tolerance could move: each logit by at most tol * ||row||, a margin by twice that.
    tol = DEFAULT_TOLERANCE[container.scheme] if tolerance is None else tolerance
    top2 = np.sort(ref_logits, axis=-1)[:, -2:]
    required = top2[:, 1] - top2[:, 0] > 2 * tol * np.linalg.norm(ref_logits, axis=-1)
    agree = np.argmax(engine_logits, axis=-1) == np.argmax(ref_logits, axis=-1)
    return CheckReport(
        scheme=container.scheme,
        tolerance=tol,
        ids=ids,
        prompt_len=len(prompt),
        layer_kinds=list(cfg.layer_kinds),
        layer_errors=layer_errors,
        logits_error=relative_l2(engine_logits, ref_logits),
        logits_max_abs=float(np.max(np.abs(engine_logits - ref_logits))),
        greedy_agree=int(agree.sum()),
        greedy_required=int(required.sum()),
        greedy_disagreements=[int(p) for p in np.flatnonzero(required & ~agree)],
        routing_forced=force,
        routing_agreement=float(np.mean(agreement)) if agreement else 1.0,
        position_errors=[float(e) for e in by_position],
    )
