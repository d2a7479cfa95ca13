"""Driving the engine from notebooks: the container to work on, a recorded routing trace, and
stepping tokens through the model one layer at a time.

`Stepper` feeds every token, prompt and generated alike, through `Model.decode` with an
observer attached, so each position has its own record. Before each attention layer runs,
the observer hands that layer's input (the previous layer's output after input_layernorm)
and a copy of its session state to the layer's `inspect_decode`, which runs the step on that
copy and returns the intermediates: for KDA the state per head after the token, the decay
exp(g) and beta, for MLA the attention probabilities over the context. From the layer's input
and output it keeps the norms of the attention's and the FFN's updates to the residual stream,
and for a MoE layer every expert's router score besides the chosen ones.

The stepper's cursor (position, layer) says how far the current token has gone: stepping
forward moves it one layer on (the next position's first layer after the last layer, a new
token once the records run out) and back one layer. `state_at(layer)` is that layer's KDA
state as the cursor sees it: after the current token for layers it has passed, before it for
the others, so a step of one layer changes one layer's state.

Shapes: H heads, K key dim, V value dim, E experts, k routed per token, ctx context length.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from waste.env import user_cache_home
from waste.errors import WasteError

WORKDIR_ENV = "WASTE_NOTEBOOK_WORKDIR"


def notebook_workdir() -> Path:
    """Where notebooks write what they build, reused across runs: $WASTE_NOTEBOOK_WORKDIR, else
    waste/notebooks under $XDG_CACHE_HOME (~/.cache)."""
    env = os.environ.get(WORKDIR_ENV)
    path = Path(env) if env else user_cache_home() / "notebooks"
    path.mkdir(parents=True, exist_ok=True)
    return path


def notebook_container(container: str | os.PathLike[str] | None = None, *, preset: str = "tiny",
                       workdir: str | os.PathLike[str] | None = None, seed: int = 0, quant: str = "f32",
                       expert_format: str | None = None) -> Path:
    """The container a notebook works on: `container` when given, otherwise `preset` with
    random weights (`waste synth`) converted to a container in `workdir` (reused when there).
    `expert_format` is synth's (a K3 preset's routed experts are MXFP4 unless it says f32 or bf16)."""
    from waste.container.convert import convert
    from waste.synth import synthesize

    if container is not None:
        path = Path(container)
        if not (path / "manifest.json").is_file():
            raise WasteError(f"{path}: not a .waste container (no manifest.json)")
        return path
    base = Path(workdir) if workdir is not None else notebook_workdir()
    tag = f"{preset}-s{seed}" + (f"-{expert_format}-experts" if expert_format else "")
    out = base / f"{tag}-{quant}.waste"
    if not (out / "manifest.json").is_file():
        hf = synthesize(preset, base / f"{tag}-hf", seed=seed, dtype="f32", force=True, expert_format=expert_format)
        convert(hf, out, quant=quant, force=True, progress=False)
    return out


def random_prompt(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """`length` token ids drawn uniformly (for containers without a tokenizer)."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab_size, length)]


def prompt_ids(text: str, tokenizer: Any | None, vocab_size: int) -> list[int]:
    """A prompt box's ids: the text through the tokenizer, or without one comma/space separated ids."""
    from waste.engine.cli import parse_ids

    if tokenizer is None and re.search(r"[^\d,\s]", text):
        raise WasteError("this container has no tokenizer: type the prompt as token ids, e.g. 1, 2, 3")
    ids = tokenizer.encode(text) if tokenizer is not None else parse_ids(text, "prompt")
    if not ids:
        raise WasteError("the prompt is empty")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise WasteError(f"token id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}")
    return ids


def record_trace(container: str | os.PathLike[str], prompt: Sequence[int], max_new: int, *, chunk: int = 32,
                 cache_experts: int | None = None, policy: str = "lru") -> Any:
    """Run the engine greedily over `prompt` plus `max_new` tokens and return its routing Trace.

    With `cache_experts`, experts stream through a cache of that many blobs under `policy`
    (as `waste run --expert-cache`), so the trace's hits are real store hits; without it the
    container is mapped and every lookup counts as a miss (a map has no cache, docs/TRACE.md).
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


def attn_res_candidates(layer: int, site: str, block_size: int) -> list[str]:
    """What each weight of the AttnRes mix at (`layer`, `site`) weighs, in the order of the engine's
    weights: "emb" (b0, the embedding), "L0-3" (a closed block: the outputs of layers 0..3), ...,
    then the running partial sum p of the current block, "p L4-5" (at an FFN site it includes
    that layer's attention). Site "output" (layer = L) is the mix the final norm reads.

    Blocks close before the attention of every layer l with l % S == 0 (after its mix), so the mix
    before layer l's attention sees ceil(l / S) stored blocks, and the one before its FFN
    l // S + 1. With none stored (layer 0's attention) the only candidate is the embedding.
    """
    S = block_size
    stored = -(-layer // S) if site in ("attn", "output") else layer // S + 1
    if stored == 0:
        return ["emb"]
    last = layer - 1 if site in ("attn", "output") else layer
    first = S * (stored - 1)
    blocks = ["emb"] + [f"L{S * (i - 1)}-{S * i - 1}" for i in range(1, stored)]
    return [*blocks, f"p L{first}" + (f"-{last}" if last > first else "")]


class _AttnResRecorder:
    """Observer keeping the weights of every AttnRes mix of one decode step, by (layer, site)."""

    def __init__(self) -> None:
        self.weights: dict[tuple[int, str], np.ndarray] = {}

    def on_attn_res(self, layer: int, site: str, positions: np.ndarray, weights: np.ndarray,
                    mixed: np.ndarray) -> None:
        self.weights[(layer, site)] = np.asarray(weights[0]).copy()

    def on_layer(self, layer: int, positions: np.ndarray, hidden: np.ndarray) -> None:
        pass

    def on_routing(self, layer: int, positions: np.ndarray, phase: str, routing: Any, hits: np.ndarray) -> None:
        pass


def engine_attn_res(model: Any, tokens: Sequence[int]) -> list[dict[tuple[int, str], np.ndarray]]:
    """The engine's own AttnRes weights for `tokens` decoded one at a time in a fresh session (no
    stepper involved): per position, {(layer, site): weights [n + 1]}, site "output" at layer L."""
    session = model.new_session(capacity=len(tokens))
    out = []
    for token in tokens:
        recorder = _AttnResRecorder()
        model.decode(session, int(token), observer=recorder)
        out.append(recorder.weights)
    return out


@dataclass
class LayerRecord:
    """What one layer did for one token."""

    layer: int
    kind: str  # "kda" or "mla"
    hidden_norm: float = float("nan")  # L2 norm of the layer's output hidden state
    attn_update: float = float("nan")  # L2 norm of what the attention adds to the residual stream
    ffn_update: float = float("nan")  # L2 norm of what the FFN (dense or MoE) adds
    state: np.ndarray | None = None  # KDA: [H, K, V] recurrent state after the token
    decay: np.ndarray | None = None  # KDA: [H, K] exp(g)
    beta: np.ndarray | None = None  # KDA: [H]
    attention: np.ndarray | None = None  # MLA: [H, ctx] probabilities, the current token last
    router_scores: np.ndarray | None = None  # MoE: [E] sigmoid scores of every expert
    expert_ids: np.ndarray | None = None  # MoE: [k] rank order
    expert_weights: np.ndarray | None = None  # MoE: [k]
    update_norm: float = float("nan")  # L2 norm of the layer's whole update (output minus input)
    # K3: AttnRes depth-attention weights [n + 1] of the mixes this layer read, by site "attn" / "ffn":
    # blocks b_0 .. b_{n-1}, then the partial sum p.
    attn_res: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class TokenRecord:
    """One token through every layer: its position, whether it was prompt or generated, the logits out."""

    position: int
    token: int
    generated: bool
    layers: list[LayerRecord]
    logits: np.ndarray = field(repr=False)  # [vocab] float32
    output_attn_res: np.ndarray | None = None  # K3: AttnRes weights of the mix the final norm reads

    @property
    def next_token(self) -> int:
        """The greedy choice for the following position."""
        return int(np.argmax(self.logits))

    @property
    def hidden_norms(self) -> np.ndarray:
        """[L] output hidden-state norm of every layer."""
        return np.array([r.hidden_norm for r in self.layers])

    @property
    def update_norms(self) -> np.ndarray:
        """[L] norm of each layer's update to the residual stream."""
        return np.array([r.update_norm for r in self.layers])

    def top_k(self, k: int = 5) -> list[tuple[int, float]]:
        """The k likeliest next tokens with their softmax probabilities, best first."""
        z = self.logits.astype(np.float64)
        p = np.exp(z - z.max())
        p /= p.sum()
        best = np.argsort(-p, kind="stable")[:k]
        return [(int(i), float(p[i])) for i in best]


class _StepObserver:
    """Collects one token's LayerRecords while Model.decode runs (see the module docstring).

    Each attention layer is inspected on its input before it runs. Kimi-Linear's input is the
    previous layer's output (`on_layer`); K3's is an AttnRes mix, which the engine hands to
    `on_attn_res` just before the attention (site "attn") and before the FFN (site "ffn"),
    together with the depth-attention weights, which are kept too.
    """

    def __init__(self, model: Any, session: Any, first_hidden: np.ndarray):
        from waste.kernels.norm import rms_norm
        from waste.kernels.routing import router_logits

        self.model, self.session, self._rms_norm, self._router_logits = model, session, rms_norm, router_logits
        self._mixed = getattr(model.config, "attn_res_block_size", None) is not None
        self.records = [LayerRecord(i, kind) for i, kind in enumerate(model.config.layer_kinds)]
        self.output_attn_res: np.ndarray | None = None  # K3: weights of the mix the final norm reads
        self._input = first_hidden[0].astype(np.float64)
        if not self._mixed:
            self._inspect(0, first_hidden)

    def _inspect(self, layer: int, attn_input: np.ndarray) -> None:
        """Run the layer's inspect_decode on its input before the layer itself runs."""
        m, rec, eps = self.model, self.records[layer], self.model.config.rms_norm_eps
        x = self._rms_norm(attn_input, m.input_norms[layer], eps)[0]
        # inspect_decode may advance the state it is given (KDA's does), so it gets a copy;
        # the real step then runs on the session's own state.
        if rec.kind == "kda":
            out = m.attn[layer].inspect_decode(x, self.session.kda[layer].copy())
            rec.state, rec.decay, rec.beta = out["state"], out["decay"], out["beta"]
        else:
            out = m.attn[layer].inspect_decode(x, self.session.mla[layer].copy())
            rec.attention = out["probs"]
        y = out["y"].astype(np.float64)
        self._middle = self._input + y
        rec.attn_update = float(np.linalg.norm(y))
        if not self._mixed:
            self._router_scores(layer, self._middle[None, :].astype(np.float32))

    def _router_scores(self, layer: int, ffn_input: np.ndarray) -> None:
        weight = getattr(self.model.ffn[layer], "router_weight", None)
        if weight is not None:
            x = self._rms_norm(ffn_input, self.model.post_norms[layer], self.model.config.rms_norm_eps)
            logits = self._router_logits(x, weight)[0].astype(np.float64)
            self.records[layer].router_scores = 1.0 / (1.0 + np.exp(-logits))

    def on_attn_res(self, layer: int, site: str, positions: np.ndarray, weights: np.ndarray,
                    mixed: np.ndarray) -> None:
        if site == "output":
            self.output_attn_res = np.asarray(weights[0]).copy()
            return
        self.records[layer].attn_res[site] = np.asarray(weights[0]).copy()
        if site == "attn":
            self._inspect(layer, mixed)
        else:
            self._router_scores(layer, mixed)

    def on_layer(self, layer: int, positions: np.ndarray, hidden: np.ndarray) -> None:
        rec = self.records[layer]
        out = hidden[0].astype(np.float64)
        rec.hidden_norm = float(np.linalg.norm(out))
        rec.ffn_update = float(np.linalg.norm(out - self._middle))
        rec.update_norm = float(np.linalg.norm(out - self._input))
        self._input = out
        if layer + 1 < len(self.records) and not self._mixed:
            self._inspect(layer + 1, hidden)

    def on_routing(self, layer: int, positions: np.ndarray, phase: str, routing: Any, hits: np.ndarray) -> None:
        self.records[layer].expert_ids = np.asarray(routing.ids[0]).copy()
        self.records[layer].expert_weights = np.asarray(routing.weights[0]).copy()


class Stepper:
    """Feeds a prompt, then greedy tokens, one token at a time, with a cursor that moves by layers."""

    def __init__(self, model: Any, prompt: Sequence[int]):
        if not len(prompt):
            raise WasteError("the prompt is empty: give at least one token id")
        self.model = model
        self.prompt = [int(t) for t in prompt]
        self.session = model.new_session(capacity=len(prompt) + 64)
        self.records: list[TokenRecord] = []
        self.position, self.layer = -1, -1  # the cursor: nothing fed yet
        self._zero_states = {i: np.zeros_like(s.recurrent) for i, s in self.session.kda.items()}

    @property
    def num_layers(self) -> int:
        return self.model.config.num_layers

    def feed(self) -> TokenRecord:
        """Run the next token (the next prompt token, else the greedy choice) through every layer."""
        position = len(self.records)
        generated = position >= len(self.prompt)
        token = int(np.argmax(self.session.last_logits)) if generated else self.prompt[position]
        self.session.ensure_capacity(position + 1)
        first = self.model.embed.take_rows(np.array([token], np.int64))
        observer = _StepObserver(self.model, self.session, first)
        logits = self.model.decode(self.session, token, observer=observer)
        record = TokenRecord(position, token, generated, observer.records, logits.copy(), observer.output_attn_res)
        self.records.append(record)
        return record

    def forward(self) -> None:
        """Move the cursor one layer on (feeding a new token when it passes the last record)."""
        if 0 <= self.layer < self.num_layers - 1:
            self.layer += 1
            return
        if self.position + 1 == len(self.records):
            self.feed()
        self.position, self.layer = self.position + 1, 0

    def back(self) -> None:
        """Move the cursor one layer back (to the previous position's last layer from layer 0)."""
        if self.layer > 0:
            self.layer -= 1
        elif self.position > 0:
            self.position, self.layer = self.position - 1, self.num_layers - 1

    def goto(self, position: int, layer: int) -> None:
        """Put the cursor at (position, layer), feeding tokens up to `position` as needed."""
        if position < 0 or not 0 <= layer < self.num_layers:
            raise WasteError(f"cursor ({position}, {layer}) is outside positions >= 0, layers 0..{self.num_layers - 1}")
        while len(self.records) <= position:
            self.feed()
        self.position, self.layer = position, layer

    @property
    def current(self) -> TokenRecord:
        if self.position < 0:
            raise WasteError("no token has been fed yet: step forward first")
        return self.records[self.position]

    def state_before(self, layer: int) -> np.ndarray:
        """KDA state [H, K, V] of `layer` before the cursor's token passed through it."""
        if self.position <= 0:
            return self._zero_states[layer]
        return self.records[self.position - 1].layers[layer].state  # type: ignore[return-value]

    def state_after(self, layer: int) -> np.ndarray:
        """KDA state [H, K, V] of `layer` after the cursor's token passed through it."""
        return self.current.layers[layer].state  # type: ignore[return-value]

    def state_at(self, layer: int) -> np.ndarray:
        """KDA state of `layer` as the cursor sees it: after the token for layers already passed."""
        return self.state_after(layer) if layer <= self.layer else self.state_before(layer)
