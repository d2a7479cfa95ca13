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
routing is forced too and the tolerance models the expert products' rounding only (`check_tolerance`).

The tolerance against the container's own weights comes from a second oracle run, the engine's
rounding model (`ReferenceModel(round_activations=True)`: each quantised product's input rounded
to int8 per group of 32, bf16 products' to bfloat16), on the same ids and routing: SAFETY_FACTOR
times its error against the exact oracle (`modelled_error`), printed beside the tolerance.

By default the oracle reads the container's stored weights, so a weight format's own rounding is
on both sides and the check measures the engine's arithmetic alone. With `source` (`waste check
--source CHECKPOINT_DIR`) it reads the checkpoint the container was converted from, so the error
includes the weight format's. Then two things are checked: every stored matrix (`weight_check`)
against the checkpoint's (its relative error within WEIGHT_BOUND_FACTOR times its format's
estimate, WEIGHT_REL_ERROR: this is what catches a bad conversion), and the engine against the
checkpoint's oracle at SAFETY_FACTOR times the error of the rounding-model oracle over the stored
weights against that same exact oracle: the weights' error and the activations' rounding
propagated through the model together, so q8's tolerance is well below q4's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from waste.engine.model import DEFAULT_PREFILL_CHUNK, Model
from waste.engine.runner import generate
from waste.engine.sampling import Sampler

if TYPE_CHECKING:
    from waste.reference.model import ReferenceOutput

# The tolerance propagates the engine's rounding model through the model itself: the oracle runs
# a second time with every product's input rounded as the engine rounds it
# (`ReferenceModel(round_activations=True)`), over the container's stored weights, and the
# tolerance is SAFETY_FACTOR times how far that moves it from the exact oracle (over the stored
# weights, or with `source` over the checkpoint's, when the weights' own error moves it too).
# float32 against float64 from the same weights: a few u = 2**-24 per operation compounded through
# reductions and layers, far below it (the seed's C engine reached 1.6e-6; 1e-5 is about 170 u).
F32_TOLERANCE = 1e-5
# Relative RMS error of normal values rounded to a uniform grid of step amax / Q per group of 32,
# where amax is about CREST times the RMS for a group of 32 normal values: off by at most half a
# step, uniformly, so RMS step / sqrt(12) and relative CREST / (Q sqrt(12)).
CREST = 2.5
# bf16: round to nearest with an 8-bit significand, at most 2**-9 relative per value.
BF16_REL_ERROR = 2.0**-9  # 2.0e-3
# The rounding model rounds the oracle's activations exactly as the engine's products round theirs,
# but the engine's activations already carry float32 arithmetic and earlier rounding, so a few codes
# can round the other way and move later layers. Measured on tiny q8 / q4 / bf16 and k3-tiny q8 +
# MXFP4 (seeds 0-2, 40 + 4 tokens), the engine's worst error over the modelled one was 1.00-1.02:
# the model reproduces the engine's error. 1.5 leaves room for prompts where differing codes do
# matter, and still fails an engine whose logits are 5% off on k3-tiny (modelled 3.6e-2).
SAFETY_FACTOR = 1.5
FORCE_ROUTING = {"f32": False, "bf16": True, "q8": True, "q4": True, "q4all": True}
QUANTISED_EXPERTS = ("q8g", "q4g", "mxfp4")


def mxfp4_weight_rel_error() -> float:
    """Relative RMS error of MXFP4 (E2M1 values, one power-of-two scale s per 32) on normal weights.

    compressed-tensors' scale rule (waste.kernels.mxfp4) puts a group's largest |w| = amax in
    [3.5 s, 7 s), and amax is about CREST sigma for normal weights of RMS sigma, so sigma / s lies
    in [3.5 / CREST, 7 / CREST) = [1.4, 2.8). In units of s the E2M1 grid is 0, .5, 1, 1.5, 2, 3, 4,
    6: steps of 0.5 up to 2, of 1 up to 4 and of 2 up to 6; values past 6 (up to 7) clip to 6, at
    most 1 off, as within a step of 2. Rounding to nearest is off uniformly within a step, a mean
    square of step**2 / 12, so E[err**2] = sum over the bands of P(|w| in band) step**2 / 12 with
    normal probabilities; relative to sigma that is 0.10 at sigma / s = 2.8 and 0.13 at 1.4; the
    worst over the range (sampled every 0.01) is the figure: 0.127.
    """
    bands = ((0.0, 2.0, 0.5), (2.0, 4.0, 1.0), (4.0, math.inf, 2.0))  # [lo, hi) in units of s, step

    def two_sided(x: float) -> float:  # P(|z| > x) for a standard normal z
        return math.erfc(x / 2**0.5)

    worst = 0.0
    for i in range(141):
        sigma = 3.5 / CREST + i * (7.0 - 3.5) / CREST / 140
        mean_square = sum((two_sided(lo / sigma) - two_sided(hi / sigma)) * step**2 / 12 for lo, hi, step in bands)
        worst = max(worst, mean_square**0.5 / sigma)
    return worst


# A stored matrix's relative RMS error against the checkpoint's (`waste check --source`), estimated
# for normal weights (tests/engine/test_check_tolerance.py measures each within a factor 2 below).
WEIGHT_REL_ERROR = {"f32": 0.0, "bf16": BF16_REL_ERROR, "q8g": CREST / (127 * 12**0.5),
                    "q4g": CREST / (8 * 12**0.5), "mxfp4": mxfp4_weight_rel_error()}
# How far above its format's estimate a stored matrix may err. Trained weights are not normal: a
# heavier-tailed group has a larger crest factor (its largest |w| further above its RMS), hence a
# coarser grid; a crest of 3x the normal one's 2.5 is far out, while a conversion bug (a wrong
# scale, swapped rows, another tensor's data) errs by tens of percent, 20-100x q8g's estimate.
WEIGHT_BOUND_FACTOR = 3.0


def quantised_experts(container) -> bool:  # noqa: ANN001 - an open container
    """Whether an f32-trunk container's routed experts are stored quantised."""
    return container.scheme == "f32" and getattr(container, "expert_storage", "f32") in QUANTISED_EXPERTS


def rounds_activations(container) -> bool:  # noqa: ANN001 - an open container
    """Whether any of the container's products rounds its activations (all but f32 with f32 experts)."""
    return container.scheme != "f32" or quantised_experts(container)


def modelled_error(exact: ReferenceOutput, rounded: ReferenceOutput) -> float:
    """The worst relative L2 error, over every layer's hidden states and the logits, of the
    rounding-model oracle (`ReferenceModel(round_activations=True)`) against the exact one on the
    same ids: the error the engine's activation rounding is expected to make, propagated through
    this model (with K3's AttnRes, whose block summaries do not damp relative errors as a residual
    stream dominated by the exact embedding does, as well as through Kimi-Linear)."""
    layers = [relative_l2(r, e) for r, e in zip(rounded.hidden_states[1:], exact.hidden_states[1:], strict=True)]
    return max(*layers, relative_l2(rounded.logits, exact.logits))


def check_tolerance(modelled: float | None) -> float:
    """The tolerance from the rounding model's error `modelled` (`modelled_error`), or None where
    nothing was modelled (an f32 container with f32 experts against its own weights): then
    F32_TOLERANCE, as nothing is rounded but float32 arithmetic. Otherwise SAFETY_FACTOR times
    `modelled`, with F32_TOLERANCE added in quadrature. Against the container's own weights the
    weight format's error is on both sides and cancels, so only the activations' rounding counts;
    against the source checkpoint the weights' own error is in `modelled` too."""
    if modelled is None:
        return F32_TOLERANCE
    return (F32_TOLERANCE**2 + (SAFETY_FACTOR * modelled) ** 2) ** 0.5


@dataclass(frozen=True)
class WeightCheck:
    """The container's stored matrices against the checkpoint's (`weight_check`, `waste check
    --source`): the one furthest above its format's estimate, and how many were compared."""

    name: str  # the worst matrix: its error over its format's estimate is the largest
    storage: str  # its storage format
    error: float  # its relative RMS error against the checkpoint's values
    estimate: float  # WEIGHT_REL_ERROR of its storage (0: the storage keeps the checkpoint's values)
    matrices: int

    @property
    def passed(self) -> bool:
        return self.error <= WEIGHT_BOUND_FACTOR * self.estimate

    def format(self) -> str:
        bound = f"{self.error / self.estimate:.2f} x" if self.estimate else "exact storage, bound"
        return (f"  weights against the checkpoint: {self.matrices} matrices, worst {self.name} ({self.storage}) "
                f"{self.error:.2e} relative = {bound} its format's estimate {self.estimate:.1e} "
                f"(bound {WEIGHT_BOUND_FACTOR:g} x){'' if self.passed else '  ABOVE BOUND'}")


def weight_check(container, source) -> WeightCheck:  # noqa: ANN001 - an open container, a CheckpointSource
    """Every trunk matrix and routed expert of the container, dequantised by the oracle's own
    dequantisers, against the checkpoint's values: the relative RMS error of each over its storage's
    WEIGHT_REL_ERROR. A storage that keeps the checkpoint's values (f32; bf16 from bfloat16; MXFP4
    experts kept as the checkpoint stores them) must reproduce them exactly, and does."""
    from waste.reference.quant import reference_dequantize

    worst: tuple[float, str, str, float, float] = (-1.0, "", "", 0.0, 0.0)
    count = 0

    def compare(name: str, stored, original) -> None:  # noqa: ANN001 - QMatrix, SourceMatrix
        nonlocal worst, count
        a, b = reference_dequantize(stored), reference_dequantize(original)
        error = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))
        estimate = WEIGHT_REL_ERROR[stored.fmt]
        # Over the estimate; an exact storage with any error at all ranks above every other.
        score = error / estimate if estimate else (math.inf if error else 0.0)
        count += 1
        if score > worst[0]:
            worst = (score, name, stored.fmt, error, estimate)

    for name in container.names():
        if container.entry(name).kind == "matrix":
            compare(name, container.matrix(name), source.matrix(name))
    cfg = container.config
    for layer in cfg.moe_layers:
        for e in range(cfg.num_experts):
            for part, stored, original in zip(("w1", "w3", "w2"), container.expert(layer, e),
                                              source.expert(layer, e), strict=True):
                compare(f"layer {layer} expert {e} {part}", stored, original)
    _, name, storage, error, estimate = worst
    return WeightCheck(name, storage, error, estimate, count)


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
    oracle: str = "the container's weights"  # or "checkpoint DIR" (`source`)
    routing_forced: bool = False
    routing_agreement: float = 1.0  # fraction of (token, MoE layer) where both chose the same expert set
    position_errors: list[float] = field(default_factory=list)  # per position: worst layer's relative L2 error
    modelled_error: float | None = None  # the rounding model's error the tolerance came from (`check_tolerance`)
    weights: WeightCheck | None = None  # the stored matrices against the checkpoint's (`source` only)

    @property
    def passed(self) -> bool:
        return not self.failures()

    def failures(self) -> list[str]:
        """What failed, each as a phrase (empty when the check passed)."""
        out = []
        worst = max([*self.layer_errors, self.logits_error])
        if worst > self.tolerance:
            out.append(f"relative error {worst:.3e} above tolerance {self.tolerance:.1e}")
        if self.greedy_disagreements:
            out.append(f"greedy disagreement at positions {self.greedy_disagreements[:5]}")
        if self.weights is not None and not self.weights.passed:
            w = self.weights
            out.append(f"stored weights unlike the checkpoint's: {w.name} ({w.storage}) {w.error:.2e} relative, above "
                       f"{WEIGHT_BOUND_FACTOR:g} x its format's estimate {w.estimate:.1e}")
        return out

    def format(self) -> str:
        lines = [f"check: {len(self.ids)} positions ({self.prompt_len} prefill + {len(self.ids) - self.prompt_len} "
                 f"decode), scheme {self.scheme}, experts {self.experts}, tolerance {self.tolerance:.1e} "
                 f"(relative L2), oracle reads {self.oracle}",
                 *([f"  modelled error {self.modelled_error:.2e} (the oracle with the engine's activation rounding "
                    f"over the stored weights against the exact one over {self.oracle}, worst of layers and "
                    f"logits); tolerance {SAFETY_FACTOR:g} x modelled"]
                   if self.modelled_error is not None else []),
                 *([self.weights.format()] if self.weights is not None else []),
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
    source=None,  # noqa: ANN001 - a CheckpointSource: the oracle reads the checkpoint instead
) -> CheckReport:
    """Run engine and oracle on the same ids and compare every layer at every position."""
    from waste.reference.model import ReferenceModel

    cfg = container.config
    model = model or Model(container)
    oracle = oracle or ReferenceModel(container if source is None else source)
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
    modelled = None
    if rounds_activations(container) or source is not None:
        # The engine's rounding model over the stored weights, against the exact oracle: with
        # `source` that one reads the checkpoint, so the weights' own error is propagated too.
        rounded = ReferenceModel(container, round_activations=True).forward(
            ids, forced_routing=capture.routing if force else None)
        modelled = modelled_error(ref, rounded)
    tol = tolerance if tolerance is not None else check_tolerance(modelled)
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
        oracle="the container's weights" if source is None else f"checkpoint {source.path}",
        routing_forced=force,
        routing_agreement=float(np.mean(agreement)) if agreement else 1.0,
        position_errors=[float(e) for e in by_position],
        modelled_error=modelled,
        weights=weight_check(container, source) if source is not None else None,
    )
