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
includes the weight format's, and the tolerance (`source_tolerance`) adds each format's own error
bound: q8's is well below q4's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from waste.config import ModelConfig
from waste.engine.model import DEFAULT_PREFILL_CHUNK, Model
from waste.engine.runner import generate
from waste.engine.sampling import Sampler

if TYPE_CHECKING:
    from waste.reference.model import ReferenceOutput

# The check against the container's own weights (`check_tolerance`) propagates the engine's rounding
# model through the model itself: the oracle runs a second time with every product's input rounded
# as the engine rounds it (`ReferenceModel(round_activations=True)`), and the tolerance is
# SAFETY_FACTOR times how far that moves it. The check against the source checkpoint adds each
# weight format's own error, which no oracle run holds, by counting (`source_tolerance`): each
# matrix product in series makes one independent relative error (activations and weights
# rounded), and independent relative errors add in quadrature.
F32_TOLERANCE = 1e-5  # float32 against float64 from the same weights (see `rounding_tolerance`)
# Relative RMS error of normal values rounded to a uniform grid of step amax / Q per group of 32,
# where amax is about CREST times the RMS for a group of 32 normal values: off by at most half a
# step, uniformly, so RMS step / sqrt(12) and relative CREST / (Q sqrt(12)).
CREST = 2.5
INT8_ACTIVATION_REL_ERROR = CREST / (127 * 12**0.5)  # 5.7e-3: int8 per group of 32, scale amax / 127
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
# The storage of a scheme's trunk matrices (q4 keeps its trunk in q8g, only its experts are q4g;
# q4all stores its trunk in q4g except the embedding and lm_head, which stay q8g).
TRUNK_STORAGE = {"f32": "f32", "bf16": "bf16", "q8": "q8g", "q4": "q8g", "q4all": "q4g"}
# What a product over each storage does to its activations (relative error per product).
ACTIVATION_REL_ERROR = {"f32": 0.0, "bf16": BF16_REL_ERROR, "q8g": INT8_ACTIVATION_REL_ERROR,
                        "q4g": INT8_ACTIVATION_REL_ERROR, "mxfp4": INT8_ACTIVATION_REL_ERROR}


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


# The weights' own relative error against the checkpoint's (`waste check --source`).
WEIGHT_REL_ERROR = {"f32": 0.0, "bf16": BF16_REL_ERROR, "q8g": CREST / (127 * 12**0.5),
                    "q4g": CREST / (8 * 12**0.5), "mxfp4": mxfp4_weight_rel_error()}


@dataclass(frozen=True)
class SeriesProducts:
    """Matrix products along the deepest path from the embedding to the logits (`products_in_series`)."""

    trunk: int  # trunk products that round their activations (lm_head included)
    experts: int  # routed-expert products
    trunk_weights: int  # trunk matrices whose weights the path reads: `trunk` plus the embedding lookup


def products_in_series(cfg: ModelConfig) -> SeriesProducts:
    """Count the matrix products in series from the embedding to the logits, from the config.

    An input goes through every layer in turn, and within a layer through the longest chain:
    - attention, 3: KDA f_a_proj -> f_b_proj (its decay) -> o_proj (Kimi-Linear's low-rank output
      gate g_a -> g_b -> o_proj is as deep; q/k/v -> o_proj is 2); MLA kv_a_proj -> kv_b_proj ->
      o_proj, or q_a_proj -> q_b_proj -> o_proj with a query LoRA (K3). The engine multiplies kv_b
      in float32 from its dequantised weights, so it rounds no activation, but its weights count.
    - FFN: a dense MLP gate/up -> down, 2 trunk products; a MoE's routed experts w1/w3 -> w2, 2
      expert products (the shared experts beside them are as deep; the router is float32); K3's
      latent MoE adds routed_expert_down_proj before the experts and routed_expert_up_proj after,
      2 trunk + 2 expert products.
    - the logits: lm_head, 1; the embedding is a lookup, so its weights count but no activation.

    `tiny` (5 layers, 1 dense + 4 MoE): trunk 5 x 3 + 2 + 1 = 18, experts 4 x 2 = 8, weights 19.
    `k3-tiny` (5 layers, 1 dense + 4 latent MoE): trunk 5 x 3 + 2 + 4 x 2 + 1 = 26, experts 8,
    weights 27.
    """
    moe = len(cfg.moe_layers)
    dense = cfg.num_layers - moe
    latent = 2 * moe if cfg.routed_expert_hidden_size is not None else 0
    trunk = 3 * cfg.num_layers + 2 * dense + latent + 1
    return SeriesProducts(trunk=trunk, experts=2 * moe, trunk_weights=trunk + 1)


def rounding_tolerance(cfg: ModelConfig, trunk: str, experts: str, *, trunk_weights: float = 0.0,
                       expert_weights: float = 0.0) -> float:
    """Relative L2 error at the logits (and at every layer, which sit on fewer products) that a
    correct engine stays within against an oracle reading the source checkpoint (`source_tolerance`),
    for trunk matrices stored as `trunk` and routed experts as `experts` (f32, bf16, q8g, q4g,
    mxfp4), with the weights' own relative errors against the checkpoint's.

    tolerance**2 = F32_TOLERANCE**2 + sum over the products in series (`products_in_series`) of
    (activation error**2 + weight error**2). Activations: q8g, q4g and mxfp4 products round them to
    int8 per group of 32 (INT8_ACTIVATION_REL_ERROR = 5.7e-3); bf16 products to bfloat16 (2**-9);
    f32 not at all. F32_TOLERANCE = 1e-5: float32 against float64 from the same weights, a few
    u = 2**-24 per operation compounded through reductions and layers, far below it (the seed's C
    engine reached 1.6e-6; 1e-5 is about 170 u). A count cannot see how a model damps or grows
    relative errors (K3's AttnRes grows them), so the stored-weights check (`check_tolerance`)
    propagates the rounding through the model instead; here the weights' own errors dominate.
    """
    n = products_in_series(cfg)
    square = (ACTIVATION_REL_ERROR[trunk] ** 2 * n.trunk + ACTIVATION_REL_ERROR[experts] ** 2 * n.experts
              + trunk_weights**2 * n.trunk_weights + expert_weights**2 * n.experts)
    return (F32_TOLERANCE**2 + square) ** 0.5


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


def check_tolerance(container, modelled: float) -> float:  # noqa: ANN001 - an open container
    """The tolerance of the check against an oracle reading the container's stored weights.

    f32 with f32 experts: F32_TOLERANCE (nothing is rounded but float32 arithmetic). Otherwise
    SAFETY_FACTOR times `modelled`, the error the rounding model makes on the same ids
    (`modelled_error`), with F32_TOLERANCE added in quadrature. The weight format's own error is
    on both sides and cancels, so only the activations' rounding is measured.
    """
    if not rounds_activations(container):
        return F32_TOLERANCE
    return (F32_TOLERANCE**2 + (SAFETY_FACTOR * modelled) ** 2) ** 0.5


def source_tolerance(container, source) -> float:  # noqa: ANN001 - an open container, a CheckpointSource
    """The tolerance when the oracle reads the checkpoint the container came from: the activations'
    rounding as in `check_tolerance`, plus every product's weight error, WEIGHT_REL_ERROR of its
    storage (q8g 5.7e-3, q4g 9.0e-2, mxfp4 0.13, bf16 2**-9), or 0 where the storage holds the
    checkpoint's values exactly (f32 always; bf16 from a bfloat16 checkpoint; MXFP4 experts kept
    verbatim from an MXFP4 checkpoint). q4all's embedding and lm_head are q8g, counted at q4g's bound
    with the rest of its trunk (two of its products, a slight overestimate)."""
    trunk = TRUNK_STORAGE[container.scheme]
    experts = getattr(container, "expert_storage", trunk)
    exact_trunk = trunk == "f32" or (trunk == "bf16" and source.matrix_dtypes() == {"BF16"})
    exact_experts = experts == "f32" or (experts == "mxfp4" and source.expert_format() == "mxfp4") or (
        experts == "bf16" and source.matrix_dtypes() == {"BF16"} and source.expert_format() != "mxfp4")
    return rounding_tolerance(container.config, trunk, experts,
                              trunk_weights=0.0 if exact_trunk else WEIGHT_REL_ERROR[trunk],
                              expert_weights=0.0 if exact_experts else WEIGHT_REL_ERROR[experts])


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

    @property
    def passed(self) -> bool:
        errs = [*self.layer_errors, self.logits_error]
        return max(errs) <= self.tolerance and not self.greedy_disagreements

    def format(self) -> str:
        lines = [f"check: {len(self.ids)} positions ({self.prompt_len} prefill + {len(self.ids) - self.prompt_len} "
                 f"decode), scheme {self.scheme}, experts {self.experts}, tolerance {self.tolerance:.1e} "
                 f"(relative L2), oracle reads {self.oracle}",
                 *([f"  modelled error {self.modelled_error:.2e} (the oracle with the engine's activation rounding "
                    f"against the exact one, worst of layers and logits); tolerance {SAFETY_FACTOR:g} x modelled"]
                   if self.modelled_error is not None else []),
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
    if source is None and rounds_activations(container):
        rounded = ReferenceModel(container, round_activations=True).forward(
            ids, forced_routing=capture.routing if force else None)
        modelled = modelled_error(ref, rounded)
    if tolerance is not None:
        tol = tolerance
    elif source is None:
        tol = check_tolerance(container, modelled or 0.0)
    else:
        tol = source_tolerance(container, source)
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
    )
