"""The batch-1 forward of Kimi-Linear and K3 over a container: prefill (layer-major chunks) and decode.

    h = embed(ids)
    per layer: h += attn(RMSNorm(h))   attn = KDA (recurrent state) or MLA (latent cache)
               h += ffn(RMSNorm(h))    ffn = dense MLP (first_k_dense_replace) or MoE
    logits = lm_head(RMSNorm(h))

K3 differs in three places, each in its own module: the residual stream is AttnRes (every
RMSNorm reads a depth-attention mix of block summaries instead of h; `waste.engine.residual`),
the MoE is latent (`waste.engine.latent_moe`), and every MLP uses the SiTU activation.

Prefill is layer-major over passes of up to PREFILL_PASS_TOKENS prompt tokens: each layer
takes the whole pass before the next layer starts. KDA walks the pass in chunks of `chunk`
tokens (its state carries from chunk to chunk; the chunk sets how many rows its projections
take at once, and the lm_head's when every position's logits are asked for). MLA takes the
whole pass in one call (it expands the cached keys and values once per call), and so does the
FFN, so each routed expert the pass uses is fetched once per layer (one store `get` per layer
and pass): a prompt of up to PREFILL_PASS_TOKENS tokens never reads more expert bytes than the
model holds, whatever the cache budget. Every position's output is the same whatever the
chunk and the pass boundaries (issue 13). Decode runs one token with the recurrent KDA step
and MLA attention in the latent space. While a decode step's MoE layer computes, the store reads
ahead the experts the next GUESS_LAYERS MoE layers are guessed to route to (`guess_experts`): each
one's router applied to this layer's FFN input normalised by that layer's norm (the residual
stream moves little from layer to layer). A guess changes when blobs are read, never what is
computed.

A streaming store hands out expert blobs before their CRC checks finish (`waste.engine.experts`);
every decode step and prefill pass waits for them (`_checked_experts`) before its logits are
returned, and before any other error of the step is reported, so a damaged blob is reported as
the ContainerError naming experts.bin, never as a NaN in some layer or as a token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from waste.container.reader import ROW_READ
from waste.engine.expert_store import ExpertStore, MmapExpertStore
from waste.engine.experts import GUESS_LAYERS
from waste.engine.kda_layer import KDALayer
from waste.engine.latent_moe import LatentMoELayer
from waste.engine.mla_layer import MLALayer
from waste.engine.moe_layer import DenseFFN, MoELayer
from waste.engine.residual import AttnResResidual, AttnResWeights, PlainResidual
from waste.engine.session import Session, read_session_file, restore_session
from waste.engine.trace import expand_hits
from waste.errors import NonFiniteError, WasteError
from waste.kernels.norm import all_finite, rms_norm

# Tokens per KDA prefill call (and lm_head call when every position's logits are kept). On `mini`
# (bench/engine.py --sweep-chunks 16 32 64 128 256 2048, 512 tokens, shared machine at load 8-11,
# 2026-11-30; to be confirmed quietly) 16 and 32 were the slowest in f32, q8 and q4; 256 had the
# best median in q8 and was within 20% of the best round in f32 and q4.
DEFAULT_PREFILL_CHUNK = 256
# Tokens a prefill pass takes through each layer at once: the residual stream of a pass is
# PREFILL_PASS_TOKENS x hidden floats (19 MB at 2048 x 2304), its MoE reads each expert once.
PREFILL_PASS_TOKENS = 2048
# A prefill pass reads the next MoE layer's experts ahead (`ExpertStore.read_ahead`) when it makes at
# least this many routing picks per expert: with uniform routing an expert is then left unpicked with
# probability about exp(-4) = 2% (512 tokens x 8 of 256 experts: 16 picks per expert).
READ_AHEAD_PICKS_PER_EXPERT = 4


def check_finite(x: np.ndarray, where: str, positions: np.ndarray) -> None:
    """Raise NonFiniteError if x [T, N] holds a NaN or an infinity (one pass, `all_finite`)."""
    if all_finite(x):
        return
    row = int(np.flatnonzero(~np.isfinite(x).all(axis=-1))[0])
    raise NonFiniteError(f"NaN or infinite values first appeared in {where} at position {int(positions[row])}; "
                         "the container's weights (or the session) produce them")


def _added_normed(stream: PlainResidual, delta: np.ndarray, weight: np.ndarray, eps: float, where: str,
                  positions: np.ndarray) -> np.ndarray:
    """stream.add_normed(delta, weight, eps), raising NonFiniteError as check_finite does."""
    x = stream.add_normed(delta, weight, eps)
    if x is None:
        check_finite(delta, where, positions)
        raise AssertionError("add_normed found a non-finite value that check_finite did not")
    return x


@contextmanager
def _checked_experts(store: ExpertStore) -> Iterator[None]:
    """Wait for the checks of the experts a step used when it ends; when it fails, a failed
    check is the error reported (the other error is its context)."""
    try:
        yield
    except Exception:
        store.verify_pending()
        raise
    store.verify_pending()


class Observer(Protocol):
    """Receives what happens inside a forward pass (per-layer outputs, routing).

    `hidden` is the layer's output residual stream (for K3 the plain sum of the AttnRes blocks and
    the partial sum: the embedding plus every output so far). An observer
    may also define `on_attn_res(layer, site, positions, weights, mixed)` to see the AttnRes
    depth-attention weights of every mix (K3 only; documented in `waste.engine.residual`).
    """

    def on_layer(self, layer: int, positions: np.ndarray, hidden: np.ndarray) -> None: ...

    def on_routing(self, layer: int, positions: np.ndarray, phase: str, routing: Any, hits: np.ndarray) -> None: ...


@dataclass
class LayerTimes:
    """Wall time spent per layer kind, for benchmarks and `waste run`."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("kda", "mla", "dense", "moe", "attn_res",
                                                                             "lm_head", "embed"), 0.0))
    # Prefill passes' MoE requests: token-expert pairs routed and unique experts asked for (decode
    # steps, one token each, ask for every pair: they would only pull the ratio towards 1).
    prefill_pairs: int = 0
    prefill_unique: int = 0

    def add(self, kind: str, t0: float) -> float:
        now = time.perf_counter()
        self.seconds[kind] += now - t0
        return now

    @property
    def prefill_dedup(self) -> float | None:
        """Token-expert pairs per unique expert fetched over every prefill pass's MoE layers (the
        ratio of the sums), or None before any prefill."""
        return self.prefill_pairs / self.prefill_unique if self.prefill_unique else None


class Model:
    """A Kimi-Linear or K3 model held over an open container."""

    def __init__(self, container: Any, *, store: ExpertStore | None = None, router_weights: str = "unbiased"):
        cfg = container.config
        self.container = container
        self.config = cfg
        self.router_weights = router_weights
        container.hold_trunk_in_memory()  # every view below from the copy on huge pages
        self.store = store if store is not None else MmapExpertStore(container)
        self.read_ahead = True  # a long prefill pass reads the next MoE layer's experts ahead (_read_ahead)
        self.guess_experts = True  # a decode step reads the next MoE layer's guessed experts ahead (_guess)
        self.times = LayerTimes()
        get_matrix, get_tensor = container.matrix, container.tensor
        # A token reads one row of an untied embedding: its rows come from the file as asked for
        # (Container.rows), the memory a copy would take left to the expert cache. Tied embeddings
        # (docs/CONTAINER.md): the output projection is the embedding matrix itself, read whole.
        self.embed = get_matrix(ROW_READ) if cfg.tie_word_embeddings else container.rows(ROW_READ)
        self.lm_head = self.embed if cfg.tie_word_embeddings else get_matrix("lm_head.weight")
        self.final_norm = get_tensor("model.norm.weight")
        self.input_norms, self.post_norms, self.attn, self.ffn = [], [], [], []
        for i, kind in enumerate(cfg.layer_kinds):
            p = f"model.layers.{i}."
            self.input_norms.append(get_tensor(p + "input_layernorm.weight"))
            self.post_norms.append(get_tensor(p + "post_attention_layernorm.weight"))
            attn_cls = KDALayer if kind == "kda" else MLALayer
            self.attn.append(attn_cls.from_weights(cfg, get_matrix, get_tensor, p + "self_attn."))
            if i < cfg.first_k_dense_replace:
                self.ffn.append(DenseFFN.from_weights(cfg, get_matrix, get_tensor, p + "mlp."))
            else:
                moe_cls = LatentMoELayer if cfg.routed_expert_hidden_size is not None else MoELayer
                self.ffn.append(moe_cls.from_weights(cfg, get_matrix, get_tensor, p + "block_sparse_moe.", i,
                                                     router_weights=router_weights))
        self.attn_res = AttnResWeights.from_weights(cfg, get_tensor) if cfg.attn_res_block_size else None
        moe = [i for i, ffn in enumerate(self.ffn) if isinstance(ffn, MoELayer)]
        self._next_moe = dict(zip(moe, moe[1:], strict=False))  # MoE layer -> the next one

    # sessions -----------------------------------------------------------------------------

    def new_session(self, capacity: int = 256) -> Session:
        """An empty session whose MLA caches start with room for `capacity` tokens."""
        cfg = self.config
        return Session(
            kda={i: self.attn[i].new_state() for i in cfg.kda_layers},
            mla={i: self.attn[i].new_cache(capacity) for i in cfg.mla_layers},
            container_hash=self.container.manifest_sha256,
            router_weights=self.router_weights,
        )

    def load_session(self, path: str) -> Session:
        """Restore a saved session; refuses one written against another container, and any field
        whose type, shape or values this model could not have produced (`restore_session`)."""
        meta, arrays = read_session_file(path)
        saved_hash = meta.get("container_hash")
        if not isinstance(saved_hash, str):
            raise WasteError(f"session file {path}: container_hash is missing or not a string")
        if saved_hash != self.container.manifest_sha256:
            raise WasteError(f"session file {path} belongs to another container (manifest "
                             f"{saved_hash[:12]}, this one {self.container.manifest_sha256[:12]})")
        # Sessions written before the key existed ran with the default.
        saved_routing = meta.get("router_weights", "unbiased")
        if saved_routing != self.router_weights:
            raise WasteError(f"session file {path} was run with --router-weights {saved_routing}, this run has "
                             f"{self.router_weights}: continuing would not be the run it started")
        return restore_session(self.new_session(capacity=1), meta, arrays, self.config.vocab_size, path)

    # forward ------------------------------------------------------------------------------

    def _check_ids(self, ids: Sequence[int], session: Session) -> np.ndarray:
        a = np.asarray(ids, dtype=np.int64)
        if a.ndim != 1:
            raise WasteError("token ids must be a flat list")
        bad = a[(a < 0) | (a >= self.config.vocab_size)]
        if bad.size:
            raise WasteError(f"token id {int(bad[0])} is outside the vocabulary 0..{self.config.vocab_size - 1}")
        limit = self.config.max_position_embeddings
        if session.position + a.size > limit:
            raise WasteError(f"context of {session.position + a.size} tokens exceeds the model's capacity of {limit}")
        return a

    def _layers(self, h: np.ndarray, positions: np.ndarray, session: Session, phase: str,
                observer: Observer | None, chunk: int = 1) -> np.ndarray:
        """Run the embedding h [T, hidden] through every layer, layer-major -> what the final norm
        reads; KDA takes `chunk` rows at a time (in order, so its state carries over), MLA and the
        FFN all T rows at once. T == 1 with phase 'decode' uses the decode paths."""
        cfg, times, eps = self.config, self.times, self.config.rms_norm_eps
        decode = phase == "decode"
        stream = PlainResidual(h) if self.attn_res is None else AttnResResidual(self.attn_res, h)
        # A plain stream adds each output and normalises the next input in one call (add_normed):
        # no observer sees anything between the two.
        plain = isinstance(stream, PlainResidual)
        last = len(cfg.layer_kinds) - 1
        x = None  # layer i's normed attention input, when the step before made it
        for i, kind in enumerate(cfg.layer_kinds):
            t0 = time.perf_counter()
            if x is None:
                attn_in = stream.attn_input(i, positions, observer)
                t0 = times.add("attn_res", t0)
                x = rms_norm(attn_in, self.input_norms[i], eps)
            state = session.kda[i] if kind == "kda" else session.mla[i]
            if decode:
                a = self.attn[i].decode(x[0], state)[None, :]
            elif kind == "mla":
                # The whole pass at once: MLA prefill expands the cached keys and values once per call.
                a = self.attn[i].prefill(x, state)
            else:
                a = np.empty_like(x)
                for start in range(0, x.shape[0], chunk):
                    a[start:start + chunk] = self.attn[i].prefill(x[start:start + chunk], state)
            if plain:
                x = _added_normed(stream, a, self.post_norms[i], eps, f"layer {i} ({kind} attention)", positions)
                ffn_in = stream.hidden
                t0 = times.add(kind, t0)
            else:
                stream.add(a)
                check_finite(a, f"layer {i} ({kind} attention)", positions)
                t0 = times.add(kind, t0)
                ffn_in = stream.ffn_input(i, positions, observer)
                t0 = times.add("attn_res", t0)
                x = rms_norm(ffn_in, self.post_norms[i], eps)
            ffn = self.ffn[i]
            if isinstance(ffn, MoELayer):
                f, routing = ffn.forward(x, self.store, self._guess(i, ffn_in) if decode else None)
                if not decode:
                    times.prefill_pairs += routing.ids.size
                    times.prefill_unique += len(routing.unique)
                if observer is not None:
                    hits = expand_hits(routing.ids, routing.unique, self.store.last_hits)
                    observer.on_routing(i, positions, phase, routing, hits)
            else:
                f = ffn.forward(x)
            where = f"layer {i} ({'MoE' if isinstance(ffn, MoELayer) else 'dense'} FFN)"
            if plain and i < last:
                x = _added_normed(stream, f, self.input_norms[i + 1], eps, where, positions)
            else:
                stream.add(f)
                check_finite(f, where, positions)
                x = None
            times.add("moe" if isinstance(ffn, MoELayer) else "dense", t0)
            if observer is not None:
                observer.on_layer(i, positions, stream.hidden)
        t0 = time.perf_counter()
        h = stream.output(positions, observer)
        times.add("attn_res", t0)
        return h

    def _guess(self, layer: int, ffn_in: np.ndarray) -> Callable[[], None] | None:
        """For a decode step at MoE layer `layer` whose FFN reads `ffn_in` [1, hidden]: what tells
        the store the experts the next GUESS_LAYERS MoE layers will likely route to, once this
        layer's reads are issued (see the module doc); None when no MoE layer follows or guessing
        is off."""
        if layer not in self._next_moe or not self.guess_experts or not self.store.takes_guesses:
            return None

        def guess() -> None:
            # Each layer is guessed from each of the GUESS_LAYERS layers before it: the nearer
            # guess, from a fresher residual stream, adds the experts the farther one missed (the
            # store skips those already read or under way).
            nxt = self._next_moe.get(layer)
            for _ in range(GUESS_LAYERS):
                if nxt is None:
                    break
                ids, _ = self.ffn[nxt].route(rms_norm(ffn_in, self.post_norms[nxt], self.config.rms_norm_eps))
                self.store.guess(nxt, np.sort(ids[0]))
                nxt = self._next_moe.get(nxt)

        return guess

    def _logits(self, h: np.ndarray, positions: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        x = rms_norm(h, self.final_norm, self.config.rms_norm_eps)
        logits = self.lm_head.matmul(x) if x.shape[0] > 1 else self.lm_head.matvec(x[0])[None, :]
        check_finite(logits, "the logits (final norm and lm_head)", positions)
        self.times.add("lm_head", t0)
        return logits

    def prefill(self, session: Session, ids: Sequence[int], *, chunk: int = DEFAULT_PREFILL_CHUNK,
                observer: Observer | None = None, all_logits: bool = True) -> np.ndarray:
        """Consume prompt tokens (layer-major passes, see the module doc); returns float32 logits
        [T, vocab] for every position, or [1, vocab] for the last one only when `all_logits` is
        False.

        Only the last position's logits are needed to continue, and at a real vocabulary
        (163840 x 2304) the lm_head over every prompt position costs more than a layer. The last
        position is always computed on its own (a matvec), so the session's next token does not
        depend on whether the other rows were asked for.
        """
        if chunk < 1:
            raise WasteError(f"--prefill-chunk {chunk}: must be at least 1")
        a = self._check_ids(ids, session)
        if a.size == 0:
            raise WasteError("the prompt is empty: give at least one token id")
        session.ensure_capacity(session.position + a.size)
        out = np.empty((a.size if all_logits else 1, self.config.vocab_size), np.float32)
        with self.store.prefilling():  # the cache keeps to its prefill budget (waste.engine.experts)
            for start in range(0, a.size, PREFILL_PASS_TOKENS):
                part = a[start:start + PREFILL_PASS_TOKENS]
                positions = np.arange(session.position, session.position + part.size)
                with _checked_experts(self.store):
                    t0 = time.perf_counter()
                    h = self.embed.take_rows(part)
                    check_finite(h, "the token embeddings", positions)
                    self.times.add("embed", t0)
                    with self._read_ahead(part.size):
                        h = self._layers(h, positions, session, "prefill", observer, chunk)
                    last_pass = start + part.size >= a.size
                    rows = part.size - 1 if last_pass else part.size
                    if all_logits:
                        # The lm_head over `chunk` rows at a time: its output is [rows, vocab].
                        for r in range(0, rows, chunk):
                            r1 = min(rows, r + chunk)
                            out[start + r:start + r1] = self._logits(h[r:r1], positions[r:r1])
                    if last_pass:
                        out[-1] = self._logits(h[-1:], positions[-1:])[0]
                session.tokens.extend(int(t) for t in part)
        session.last_logits = out[-1].copy()
        return out

    def _read_ahead(self, tokens: int) -> AbstractContextManager[None]:
        """The store's read-ahead over the MoE layers for a pass of `tokens` prompt tokens, when
        the pass is long enough that every expert is likely routed (READ_AHEAD_PICKS_PER_EXPERT)."""
        cfg = self.config
        if not self.read_ahead or tokens * cfg.num_experts_per_token < READ_AHEAD_PICKS_PER_EXPERT * cfg.num_experts:
            return nullcontext()
        return self.store.read_ahead(cfg.moe_layers)

    def decode(self, session: Session, token: int, *, observer: Observer | None = None) -> np.ndarray:
        """Consume one token; returns float32 logits [vocab] for the next position."""
        a = self._check_ids([token], session)
        session.ensure_capacity(session.position + 1)
        positions = np.array([session.position])
        with _checked_experts(self.store):
            t0 = time.perf_counter()
            h = self.embed.take_rows(a)
            check_finite(h, "the token embeddings", positions)
            self.times.add("embed", t0)
            h = self._layers(h, positions, session, "decode", observer)
            logits = self._logits(h, positions)[0]
        session.tokens.append(int(token))
        session.last_logits = logits.copy()
        return logits
