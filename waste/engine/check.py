"""Engine against the float64 oracle: per-layer hidden-state error, logits error, greedy agreement.

The engine prefills the prompt, then greedily decodes `new` tokens; the oracle runs once
over prompt + generated tokens with no cache. Every position is compared: prompt positions
come from prefill, the rest from decode steps, so this also checks that prefill then
decode equals one full pass.

Routing is discrete: on a quantised container a near-tie between two experts can go the
other way in the engine, and one such flip moves a hidden state by far more than the
rounding that caused it. For quantised schemes the oracle therefore applies the experts
the engine chose (its own router still computes the weights), and the report gives how
often the oracle's own choice agrees. On f32 containers nothing is forced, unless their routed
experts are stored quantised (K3's MXFP4 experts kept as stored, or `--experts q8|q4`): then
routing is forced too and the tolerance counts the expert products only (`check_tolerance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from waste.engine.model import DEFAULT_PREFILL_CHUNK, Model
from waste.engine.runner import generate
from waste.engine.sampling import Sampler

# Relative L2 error allowed by default, per container scheme (`scheme_tolerance`).
UNIT_ROUNDOFF_F32 = 2.0**-24
# int8 activations, per group of 32 with scale amax / 127: each element is off by at most half a
# step, amax / 254, uniformly, so the RMS error is amax / (127 sqrt(12)); for a group of 32 normal
# values amax is about 2.5 times the RMS, so one product's relative error is 2.5 / (127 sqrt(12)).
INT8_ACTIVATION_REL_ERROR = 2.5 / (127 * 12**0.5)  # 5.7e-3
PRODUCTS_PER_LAYER = 4  # in series along the residual: attention in and out, FFN in and out
# bf16 activations: round to nearest with an 8-bit significand, at most 2**-9 relative per value.
BF16_ACTIVATION_REL_ERROR = 2.0**-9  # 2.0e-3
FORCE_ROUTING = {"f32": False, "bf16": True, "q8": True, "q4": True, "q4all": True}
# Routed experts stored in a quantised format while the trunk is f32 (K3's MXFP4 experts kept as
# stored, or `convert --experts q8|q4`): the expert products round activations to int8, two in
# series per MoE layer (the experts' input for gate and up at once, then the down projection's).
QUANTISED_EXPERTS = ("q8g", "q4g", "mxfp4")
EXPERT_PRODUCTS_PER_MOE_LAYER = 2


def scheme_tolerance(scheme: str, num_layers: int) -> float:
    """Relative L2 error of the engine against the oracle that a correct engine stays within.

    f32: the engine computes in float32 what the oracle computes in float64 from the same
    weights. Rounding errors of a few u = 2**-24 per operation, compounded through reductions
    and layers, stay far below the 1e-5 the issue set (the seed's C engine reached 1.6e-6):
    1e-5 is about 170 u.

    q8 and q4: the oracle dequantises the very weights the container stores (exactly: code x
    scale x tscale), so the weight format's own error bound (q8g: half a step of amax / 127
    per weight, q4g: up to a step of amax / 8) is in both sides and cancels; it is *not* what
    this check measures, which is why q8 and q4 get the same figure. What differs is that
    the engine rounds every activation vector to int8 per group of 32 before each quantised
    product (both formats), a relative error of INT8_ACTIVATION_REL_ERROR = 5.7e-3 per product.
    Independent errors of the PRODUCTS_PER_LAYER x L products in series add in quadrature:
    tolerance = 5.7e-3 sqrt(4 L), 2.5e-2 for the 5 layers of tiny (where q8 and q4 measure
    1.2e-2 at the logits).

    bf16: the weights are the oracle's too; the engine rounds every activation vector to
    bfloat16 before each product (as vdpbf16ps does), at most BF16_ACTIVATION_REL_ERROR = 2**-9
    relative per value, compounded the same way: 8.7e-3 for tiny (which measures 3.6e-3).
    """
    if scheme == "f32":
        return 1e-5
    if scheme in ("q8", "q4", "q4all"):
        return INT8_ACTIVATION_REL_ERROR * (PRODUCTS_PER_LAYER * num_layers) ** 0.5
    if scheme == "bf16":
        return BF16_ACTIVATION_REL_ERROR * (PRODUCTS_PER_LAYER * num_layers) ** 0.5
    raise ValueError(f"no tolerance for scheme {scheme!r}")


def quantised_experts(container) -> bool:  # noqa: ANN001 - an open container
    """Whether an f32-trunk container's routed experts are stored quantised."""
    return container.scheme == "f32" and getattr(container, "expert_storage", "f32") in QUANTISED_EXPERTS


def check_tolerance(container) -> float:  # noqa: ANN001 - an open container
    """`scheme_tolerance` of the container's trunk scheme; for an f32 trunk with quantised experts
    the int8 activation error of their products alone: 5.7e-3 sqrt(2 x MoE layers), 1.6e-2 for
    the 4 MoE layers of k3-tiny."""
    cfg = container.config
    if quantised_experts(container):
        return INT8_ACTIVATION_REL_ERROR * (EXPERT_PRODUCTS_PER_MOE_LAYER * len(cfg.moe_layers)) ** 0.5
    return scheme_tolerance(container.scheme, cfg.num_layers)


def clear_margin(logits: np.ndarray, tolerance: float) -> np.ndarray:
    """Positions [T] whose top-2 logit margin no error within `tolerance` is expected to overturn.

    Spread evenly, a relative L2 error of `tolerance` moves each of a row's V logits by about
    tolerance x RMS(row); the largest of V such independent errors is about sqrt(2 ln V) times
    that, and a margin shrinks by at most twice the largest. So a margin is clear above
    2 sqrt(2 ln V) tolerance RMS(row).
    """
    vocab = logits.shape[-1]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    rms = np.sqrt(np.mean(np.square(logits), axis=-1))
    return top2[:, 1] - top2[:, 0] > 2 * np.sqrt(2 * np.log(vocab)) * tolerance * rms


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
    experts: str  # storage of the routed experts
    tolerance: float
    ids: list[int]
    prompt_len: int
    layer_kinds: list[str]
    layer_errors: list[float]
    logits_error: float
    logits_max_abs: float
    greedy_agree: int  # positions (of all) where the engine's argmax is the oracle's
    greedy_clear: int  # positions whose oracle margin is clear (`clear_margin`)
    greedy_clear_agree: int  # of those, positions where the argmaxes agree
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
                 f"decode), scheme {self.scheme}, experts {self.experts}, tolerance {self.tolerance:.1e} (relative L2)",
                 f"  {'layer':>5} {'kind':<4} {'rel. L2 error':>14}"]
        for i, (kind, err) in enumerate(zip(self.layer_kinds, self.layer_errors, strict=True)):
            flag = "" if err <= self.tolerance else "  ABOVE TOLERANCE"
            lines.append(f"  {i:>5} {kind:<4} {err:>14.3e}{flag}")
        lines.append(f"  {'logits':>10} {self.logits_error:>14.3e}   (max |diff| {self.logits_max_abs:.3e})")
        lines.append(f"  greedy agreement: {self.greedy_agree}/{len(self.ids)} of all positions, "
                     f"{self.greedy_clear_agree}/{self.greedy_clear} of positions with a clear top-2 margin")
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
    force = FORCE_ROUTING[container.scheme] or quantised_experts(container)
    ref = oracle.forward(ids, forced_routing=capture.routing if force else None)
    agreement = [np.mean(np.all(np.sort(capture.routing[layer], axis=1) == np.sort(own, axis=1), axis=1))
                 for layer, own in ref.routing.items()]
    layer_errors = [relative_l2(capture.hidden[i], ref.hidden_states[i + 1]) for i in range(cfg.num_layers)]
    want = np.stack([np.asarray(ref.hidden_states[i + 1], np.float64) for i in range(cfg.num_layers)])  # [L, T, D]
    by_position = (np.linalg.norm(capture.hidden.astype(np.float64) - want, axis=-1)
                   / np.maximum(np.linalg.norm(want, axis=-1), 1e-300)).max(axis=0)
    ref_logits = ref.logits
    tol = check_tolerance(container) if tolerance is None else tolerance
    clear = clear_margin(ref_logits, tol)
    agree = np.argmax(engine_logits, axis=-1) == np.argmax(ref_logits, axis=-1)
    return CheckReport(
        scheme=container.scheme,
        experts=getattr(container, "expert_storage", container.scheme),
        tolerance=tol,
        ids=ids,
        prompt_len=len(prompt),
        layer_kinds=list(cfg.layer_kinds),
        layer_errors=layer_errors,
        logits_error=relative_l2(engine_logits, ref_logits),
        logits_max_abs=float(np.max(np.abs(engine_logits - ref_logits))),
        greedy_agree=int(agree.sum()),
        greedy_clear=int(clear.sum()),
        greedy_clear_agree=int((clear & agree).sum()),
        greedy_disagreements=[int(p) for p in np.flatnonzero(clear & ~agree)],
        routing_forced=force,
        routing_agreement=float(np.mean(agreement)) if agreement else 1.0,
        position_errors=[float(e) for e in by_position],
    )
