"""Driving the engine from notebooks: the container to work on, a recorded routing trace, and
stepping one token at a time while collecting what every layer did.

`Stepper` prefills a prompt, then feeds one token per `step()` through `Model.decode` with
an observer attached. Before each attention layer runs, the observer hands that layer's
input (the previous layer's output after input_layernorm) and a copy of its session state
to the layer's `inspect_decode`, which runs the step on that copy and returns the
intermediates: for KDA the state per head after the token, the decay exp(g) and beta,
for MLA the attention probabilities over the context. The observer also keeps each layer's
output hidden-state norm and each MoE layer's routing.

Shapes: H heads, K key dim, V value dim, k routed experts per token, ctx context length.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from waste.errors import WasteError

WORKDIR_ENV = "WASTE_NOTEBOOK_WORKDIR"


def notebook_workdir() -> Path:
    """Where notebooks write what they build: $WASTE_NOTEBOOK_WORKDIR, else a new temporary directory."""
    env = os.environ.get(WORKDIR_ENV)
    path = Path(env) if env else Path(tempfile.mkdtemp(prefix="waste-notebook-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def notebook_container(container: str | os.PathLike[str] | None = None, *, preset: str = "tiny",
                       workdir: str | os.PathLike[str] | None = None, seed: int = 0, quant: str = "f32") -> Path:
    """The container a notebook works on: `container` when given, otherwise `preset` with
    random weights (`waste synth`) converted to a container in `workdir` (reused when there)."""
    from waste.container.convert import convert
    from waste.synth import synthesize

    if container is not None:
        path = Path(container)
        if not (path / "manifest.json").is_file():
            raise WasteError(f"{path}: not a .waste container (no manifest.json)")
        return path
    base = Path(workdir) if workdir is not None else notebook_workdir()
    out = base / f"{preset}-s{seed}-{quant}.waste"
    if not (out / "manifest.json").is_file():
        hf = synthesize(preset, base / f"{preset}-s{seed}-hf", seed=seed, dtype="f32", force=True)
        convert(hf, out, quant=quant, force=True, progress=False)
    return out


def random_prompt(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """`length` token ids drawn uniformly (models with random weights have no tokenizer)."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab_size, length)]


def record_trace(container: str | os.PathLike[str], prompt: Sequence[int], max_new: int, *, chunk: int = 32,
                 cache_experts: int | None = None, policy: str = "lru") -> Any:
    """Run the engine greedily over `prompt` plus `max_new` tokens and return its routing Trace.

    With `cache_experts`, experts stream through a cache of that many blobs under `policy`
    (as `waste run --expert-cache`), so the trace's hits are real store hits; without it the
    container is mapped and every lookup counts as a hit.
    """
    from waste.container.reader import open_container
    from waste.engine.experts import open_expert_store
    from waste.engine.model import Model
    from waste.engine.runner import generate
    from waste.engine.sampling import Sampler
    from waste.engine.trace import TraceRecorder

    with open_container(container) as c:
        cfg = c.config
        budget = None if cache_experts is None else cache_experts * int(c.byte_counts()["expert_blob_bytes"])
        store = open_expert_store(c, budget, policy, read_threads=1)
        try:
            model = Model(c, store=store)
            recorder = TraceRecorder(cfg.num_layers, cfg.moe_layers, cfg.num_experts_per_token,
                                     num_experts=cfg.num_experts,
                                     metadata={"container": Path(container).name, "cache_experts": cache_experts,
                                               "policy": policy, "chunk": chunk})
            session = model.new_session(capacity=len(prompt) + max_new)
            generate(model, session, prompt, max_new, Sampler(), chunk=chunk, observer=recorder)
        finally:
            store.close()
    return recorder.trace()


@dataclass
class LayerRecord:
    """What one layer did for one decoded token."""

    layer: int
    kind: str  # "kda" or "mla"
    hidden_norm: float = float("nan")  # L2 norm of the layer's output hidden state
    state: np.ndarray | None = None  # KDA: [H, K, V] recurrent state after the token
    decay: np.ndarray | None = None  # KDA: [H, K] exp(g)
    beta: np.ndarray | None = None  # KDA: [H]
    attention: np.ndarray | None = None  # MLA: [H, ctx] probabilities, the current token last
    expert_ids: np.ndarray | None = None  # MoE: [k] rank order
    expert_weights: np.ndarray | None = None  # MoE: [k]


@dataclass
class TokenRecord:
    """One decode step: the token fed, its position, every layer's record and the logits out."""

    position: int
    token: int
    layers: list[LayerRecord]
    logits: np.ndarray = field(repr=False)  # [vocab] float32

    @property
    def next_token(self) -> int:
        """The greedy choice for the following position."""
        return int(np.argmax(self.logits))

    @property
    def hidden_norms(self) -> np.ndarray:
        """[L] output hidden-state norm of every layer."""
        return np.array([r.hidden_norm for r in self.layers])

    def plot(self, layer: int) -> Figure:
        """The step-through figure of this token at `layer` (see plots.plot_token_layer)."""
        from waste.analysis.plots import plot_token_layer

        if not 0 <= layer < len(self.layers):
            raise WasteError(f"layer {layer} is outside 0..{len(self.layers) - 1}")
        r = self.layers[layer]
        routing = None if r.expert_ids is None else (r.expert_ids, r.expert_weights)
        return plot_token_layer(
            self.hidden_norms, [x.kind for x in self.layers], layer,
            title=f"token {self.token} at position {self.position}, layer {layer} ({r.kind.upper()})",
            state=r.state, decay=r.decay, beta=r.beta, attention=r.attention, routing=routing,
        )


class _StepObserver:
    """Collects one token's LayerRecords while Model.decode runs (see the module docstring)."""

    def __init__(self, model: Any, session: Any, first_hidden: np.ndarray):
        from waste.engine.model import rms_norm

        self.model, self.session, self._rms_norm = model, session, rms_norm
        kinds = model.config.layer_kinds
        self.records = [LayerRecord(i, kind) for i, kind in enumerate(kinds)]
        self._inspect(0, first_hidden)

    def _inspect(self, layer: int, hidden: np.ndarray) -> None:
        """Run layer's inspect_decode on its input before the layer itself runs."""
        m, rec = self.model, self.records[layer]
        x = self._rms_norm(hidden, m.input_norms[layer], m.config.rms_norm_eps)[0]
        # inspect_decode may advance the state it is given (KDA's does), so it gets a copy;
        # the real step then runs on the session's own state.
        if rec.kind == "kda":
            out = m.attn[layer].inspect_decode(x, self.session.kda[layer].copy())
            rec.state, rec.decay, rec.beta = out["state"], out["decay"], out["beta"]
        else:
            rec.attention = m.attn[layer].inspect_decode(x, self.session.mla[layer].copy())["probs"]

    def on_layer(self, layer: int, positions: np.ndarray, hidden: np.ndarray) -> None:
        self.records[layer].hidden_norm = float(np.linalg.norm(hidden[0].astype(np.float64)))
        if layer + 1 < len(self.records):
            self._inspect(layer + 1, hidden)

    def on_routing(self, layer: int, positions: np.ndarray, phase: str, routing: Any, hits: np.ndarray) -> None:
        self.records[layer].expert_ids = np.asarray(routing.ids[0]).copy()
        self.records[layer].expert_weights = np.asarray(routing.weights[0]).copy()


class Stepper:
    """Prefill a prompt, then decode one token per `step()`, keeping a TokenRecord of each."""

    def __init__(self, model: Any, prompt: Sequence[int], *, chunk: int = 32):
        if not len(prompt):
            raise WasteError("the prompt is empty: give at least one token id")
        self.model = model
        self.session = model.new_session(capacity=len(prompt) + 64)
        model.prefill(self.session, prompt, chunk=chunk, all_logits=False)
        self.records: list[TokenRecord] = []

    def step(self, token: int | None = None) -> TokenRecord:
        """Feed `token` (default: the greedy choice after what came before) through every layer."""
        if token is None:
            token = int(np.argmax(self.session.last_logits))
        if not 0 <= token < self.model.config.vocab_size:
            raise WasteError(f"token id {token} is outside the vocabulary 0..{self.model.config.vocab_size - 1}")
        position = self.session.position
        self.session.ensure_capacity(position + 1)
        first = self.model.embed.take_rows(np.array([token], np.int64))
        observer = _StepObserver(self.model, self.session, first)
        logits = self.model.decode(self.session, token, observer=observer)
        record = TokenRecord(position, int(token), observer.records, logits.copy())
        self.records.append(record)
        return record
