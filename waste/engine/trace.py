"""Routing traces: which experts every token chose in every MoE layer, and whether the
expert store had them cached.

A trace is a table of rows, one per (token, MoE layer), kept in the order the engine made
its expert requests. Each row holds the token's position, the phase (prefill or decode),
the step (one prefill chunk or one decode token), the k selected expert ids in rank order,
their routing weights and whether each was a cache hit. Rows of one (step, layer) form one
store request: the unique ids of those rows, sorted. The file format and the request and
cache semantics are documented in docs/TRACE.md.

Shapes: N rows, k experts per token, R requests, M lookups (unique ids summed over requests).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from waste.errors import WasteError
from waste.fileio import write_atomic

TRACE_FORMAT = "waste-trace"
TRACE_VERSION = 1
PHASES = ("prefill", "decode")
_ARRAYS = ("position", "layer", "phase", "step", "ids", "weights", "hit")


@dataclass(frozen=True)
class Requests:
    """A trace regrouped as the expert store saw it: R requests, M lookups in total.

    Request r is (layer[r], step[r]) and looked up ids[start[r]:start[r+1]] (unique, sorted);
    hit holds the recorded outcome of each lookup.
    """

    layer: np.ndarray  # [R] int64
    step: np.ndarray  # [R] int64
    phase: np.ndarray  # [R] int8, 0 prefill / 1 decode
    start: np.ndarray  # [R + 1] int64 offsets into ids
    ids: np.ndarray  # [M] int64
    hit: np.ndarray  # [M] bool

    def __len__(self) -> int:
        return len(self.layer)

    @property
    def lookup_layer(self) -> np.ndarray:
        """[M] the layer of each lookup."""
        return np.repeat(self.layer, np.diff(self.start))


@dataclass(frozen=True)
class Trace:
    """A routing trace held in memory (see the module docstring for the row layout)."""

    position: np.ndarray  # [N] int64
    layer: np.ndarray  # [N] int64
    phase: np.ndarray  # [N] int8, 0 prefill / 1 decode
    step: np.ndarray  # [N] int64
    ids: np.ndarray  # [N, k] int64, rank order
    weights: np.ndarray  # [N, k] float32
    hit: np.ndarray  # [N, k] bool
    num_layers: int
    moe_layers: tuple[int, ...]
    top_k: int
    num_experts: int
    metadata: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.position)

    @classmethod
    def from_arrays(
        cls,
        ids: np.ndarray,
        *,
        layer: np.ndarray | int = 0,
        position: np.ndarray | None = None,
        phase: np.ndarray | str = "decode",
        step: np.ndarray | None = None,
        weights: np.ndarray | None = None,
        hit: np.ndarray | None = None,
        num_layers: int | None = None,
        moe_layers: Sequence[int] | None = None,
        num_experts: int | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Trace:
        """Build a trace from arrays, filling what is left out (for notebooks and tests).

        ids [N, k] (or [N] for k = 1). Defaults: every row in layer `layer`, positions
        0..N-1, decode phase, each row its own step, uniform weights, no hits.
        """
        ids = np.asarray(ids, np.int64)
        if ids.ndim == 1:
            ids = ids[:, None]
        if ids.ndim != 2:
            raise WasteError(f"trace ids must be [N, k], got shape {ids.shape}")
        n, k = ids.shape
        layer_a = np.broadcast_to(np.asarray(layer, np.int64), (n,)).copy()
        if isinstance(phase, str):
            if phase not in PHASES:
                raise WasteError(f"trace phase {phase!r}: expected 'prefill' or 'decode'")
            phase = np.full(n, PHASES.index(phase), np.int8)
        if moe_layers is None:
            moe_layers = sorted({int(x) for x in layer_a})
        if num_layers is None:
            num_layers = max(moe_layers, default=-1) + 1
        trace = cls(
            position=np.arange(n, dtype=np.int64) if position is None else np.asarray(position, np.int64),
            layer=layer_a,
            phase=np.asarray(phase, np.int8),
            step=np.arange(n, dtype=np.int64) if step is None else np.asarray(step, np.int64),
            ids=ids,
            weights=np.full((n, k), 1 / max(k, 1), np.float32) if weights is None else np.asarray(weights, np.float32),
            hit=np.zeros(ids.shape, bool) if hit is None else np.asarray(hit, bool),
            num_layers=int(num_layers),
            moe_layers=tuple(int(x) for x in moe_layers),
            top_k=k,
            num_experts=int(ids.max(initial=-1) + 1 if num_experts is None else num_experts),
            metadata=dict(metadata or {}),
        )
        trace.validate()
        return trace

    @classmethod
    def synthetic(
        cls,
        *,
        prompt: int,
        decode: int,
        moe_layers: Sequence[int],
        num_experts: int,
        top_k: int,
        chunk: int = 32,
        skew: float = 1.0,
        seed: int = 0,
    ) -> Trace:
        """A random trace with Zipf-like expert popularity (weight of rank r is (r+1)^-skew,
        a different ranking per layer): `prompt` tokens prefilled in chunks of `chunk`, then
        `decode` tokens one at a time, each step passing through every MoE layer in order.
        """
        if top_k > num_experts or chunk < 1:
            raise WasteError(f"synthetic trace: need top_k <= num_experts and chunk >= 1, got {top_k}, {chunk}")
        rng = np.random.default_rng(seed)
        logp = {
            lay: -skew * np.log1p(rng.permutation(num_experts).astype(np.float64)) for lay in moe_layers
        }
        steps = [(s, min(s + chunk, prompt), 0) for s in range(0, prompt, chunk)]
        steps += [(t, t + 1, 1) for t in range(prompt, prompt + decode)]
        if not steps:
            raise WasteError("synthetic trace: prompt + decode must be at least one token")
        cols: dict[str, list[np.ndarray]] = {name: [] for name in _ARRAYS if name != "hit"}
        for step, (a, b, ph) in enumerate(steps):
            for lay in moe_layers:
                # Gumbel top-k draws k distinct experts with probability proportional to exp(logp).
                keys = logp[lay] + rng.gumbel(size=(b - a, num_experts))
                ids = np.argsort(-keys, axis=1)[:, :top_k]
                w = rng.random((b - a, top_k)).astype(np.float32) + 0.1
                cols["ids"].append(ids)
                cols["weights"].append(-np.sort(-w / w.sum(axis=1, keepdims=True), axis=1))
                cols["position"].append(np.arange(a, b))
                cols["layer"].append(np.full(b - a, lay))
                cols["phase"].append(np.full(b - a, ph))
                cols["step"].append(np.full(b - a, step))
        cat = {name: np.concatenate(v) for name, v in cols.items()}
        return cls.from_arrays(
            cat.pop("ids"),
            num_experts=num_experts,
            moe_layers=moe_layers,
            metadata={"synthetic": True, "skew": skew, "seed": seed, "chunk": chunk},
            **cat,
        )

    def validate(self) -> None:
        """Raise WasteError unless the arrays are consistent with each other and the config."""
        n = len(self.position)
        k = self.top_k
        for name in ("position", "layer", "phase", "step"):
            if getattr(self, name).shape != (n,):
                raise WasteError(f"trace array {name!r}: shape {getattr(self, name).shape}, expected ({n},)")
        for name in ("ids", "weights", "hit"):
            if getattr(self, name).shape != (n, k):
                raise WasteError(f"trace array {name!r}: shape {getattr(self, name).shape}, expected ({n}, {k})")
        if n and (self.ids.min() < 0 or self.ids.max() >= self.num_experts):
            raise WasteError(f"trace: expert ids outside 0..{self.num_experts - 1}")
        if n and not np.isin(self.phase, (0, 1)).all():
            raise WasteError("trace: phase values must be 0 (prefill) or 1 (decode)")
        if n and not np.isin(self.layer, self.moe_layers).all():
            raise WasteError(f"trace: layer ids outside the MoE layers {list(self.moe_layers)}")
        if any(not 0 <= x < self.num_layers for x in self.moe_layers):
            raise WasteError(f"trace: MoE layers {list(self.moe_layers)} outside 0..{self.num_layers - 1}")
        if n:
            runs = _run_starts(self.step, self.layer)
            pairs = np.unique(np.stack([self.step, self.layer]), axis=1).shape[1]
            if pairs != len(runs):
                raise WasteError("trace: the rows of each (step, layer) request must be contiguous")

    def per_layer(self, layer: int) -> Trace:
        """The rows of one MoE layer, in order."""
        if layer not in self.moe_layers:
            raise WasteError(f"layer {layer} is not a MoE layer of this trace ({list(self.moe_layers)})")
        sel = self.layer == layer
        return self._select(sel)

    def select_phase(self, phase: str) -> Trace:
        """The rows of one phase ("prefill" or "decode"), in order."""
        if phase not in PHASES:
            raise WasteError(f"trace phase {phase!r}: expected 'prefill' or 'decode'")
        return self._select(self.phase == PHASES.index(phase))

    def _select(self, sel: np.ndarray) -> Trace:
        return Trace(
            **{name: getattr(self, name)[sel] for name in _ARRAYS},
            num_layers=self.num_layers,
            moe_layers=self.moe_layers,
            top_k=self.top_k,
            num_experts=self.num_experts,
            metadata=dict(self.metadata),
        )

    def requests(self) -> Requests:
        """Regroup the rows into store requests: for each (step, layer) run of rows, in row
        order, the unique expert ids sorted, with the recorded hit of each."""
        n, k = self.ids.shape
        if n == 0:
            empty = np.zeros(0, np.int64)
            return Requests(empty, empty, np.zeros(0, np.int8), np.zeros(1, np.int64), empty, np.zeros(0, bool))
        starts = _run_starts(self.step, self.layer)
        run = np.zeros(n, np.int64)
        run[starts] = 1
        run = np.cumsum(run) - 1  # [N] request index of each row
        flat_key = np.repeat(run, k) * self.num_experts + self.ids.ravel()
        keys, first = np.unique(flat_key, return_index=True)
        req = keys // self.num_experts
        start = np.searchsorted(req, np.arange(len(starts) + 1))
        return Requests(
            layer=self.layer[starts],
            step=self.step[starts],
            phase=self.phase[starts],
            start=start.astype(np.int64),
            ids=(keys % self.num_experts).astype(np.int64),
            hit=self.hit.ravel()[first],
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace as a versioned .npz (atomic: temporary name, then rename)."""
        header = {
            "num_layers": self.num_layers,
            "moe_layers": list(self.moe_layers),
            "top_k": self.top_k,
            "num_experts": self.num_experts,
        }
        arrays = {
            "format": np.array(TRACE_FORMAT),
            "version": np.array(TRACE_VERSION, np.int64),
            "config": np.array(json.dumps(header)),
            "metadata": np.array(json.dumps(self.metadata, default=str)),
            "position": self.position.astype(np.int64),
            "layer": self.layer.astype(np.int16),
            "phase": self.phase.astype(np.int8),
            "step": self.step.astype(np.int64),
            "ids": self.ids.astype(np.int32),
            "weights": self.weights.astype(np.float32),
            "hit": self.hit.astype(bool),
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda f: np.savez_compressed(f, **arrays))


class TraceRecorder:
    """Collects the rows of a trace while the engine runs.

    `record` is called once per MoE layer per step with that step's tokens. The step index
    is inferred: a call starts a new step unless an earlier call had the same phase and
    positions and has not yet recorded this layer (so both token-major and layer-major
    prefill orders group correctly). Pass `step=` to set it explicitly.
    """

    def __init__(
        self,
        num_layers: int,
        moe_layers: Sequence[int],
        top_k: int,
        *,
        num_experts: int | None = None,
        metadata: dict[str, Any] | None = None,
    ):
        self.num_layers = int(num_layers)
        self.moe_layers = tuple(int(x) for x in moe_layers)
        self.top_k = int(top_k)
        self.num_experts = num_experts
        self.metadata: dict[str, Any] = dict(metadata or {})
        self._rows: dict[str, list[np.ndarray]] = {name: [] for name in _ARRAYS}
        # (phase, first position, T) -> (step, layers recorded so far)
        self._open: dict[tuple[int, int, int], tuple[int, set[int]]] = {}
        self._next_step = 0

    def record(
        self,
        layer: int,
        positions: np.ndarray,
        phase: str,
        ids: np.ndarray,
        weights: np.ndarray,
        hits: np.ndarray,
        *,
        step: int | None = None,
    ) -> None:
        """One MoE layer's routing for one step: positions [T], ids/weights/hits [T, k]."""
        if layer not in self.moe_layers:
            raise WasteError(f"trace: layer {layer} is not a MoE layer ({list(self.moe_layers)})")
        if phase not in PHASES:
            raise WasteError(f"trace phase {phase!r}: expected 'prefill' or 'decode'")
        positions = np.asarray(positions, np.int64).reshape(-1)
        t = len(positions)
        for name, a in (("ids", ids), ("weights", weights), ("hits", hits)):
            if np.shape(a) != (t, self.top_k):
                raise WasteError(f"trace: {name} has shape {np.shape(a)}, expected ({t}, {self.top_k})")
        ph = PHASES.index(phase)
        if step is None:
            step = self._infer_step(layer, ph, positions)
        self._rows["position"].append(positions)
        self._rows["layer"].append(np.full(t, layer, np.int64))
        self._rows["phase"].append(np.full(t, ph, np.int8))
        self._rows["step"].append(np.full(t, step, np.int64))
        self._rows["ids"].append(np.array(ids, np.int64))
        self._rows["weights"].append(np.array(weights, np.float32))
        self._rows["hit"].append(np.array(hits, bool))

    def on_layer(self, layer: int, positions: np.ndarray, hidden: np.ndarray) -> None:
        """Engine observer hook: hidden states are not part of a trace."""

    def on_routing(self, layer: int, positions: np.ndarray, phase: str, routing: Any, hits: np.ndarray) -> None:
        """Engine observer hook: one MoE layer's routing (a RoutingInfo) for one step."""
        self.record(layer, positions, phase, routing.ids, routing.weights, hits)

    def _infer_step(self, layer: int, phase: int, positions: np.ndarray) -> int:
        key = (phase, int(positions[0]) if len(positions) else -1, len(positions))
        found = self._open.get(key)
        if found is not None and layer not in found[1]:
            found[1].add(layer)
            return found[0]
        step = self._next_step
        self._next_step += 1
        self._open[key] = (step, {layer})
        return step

    def trace(self) -> Trace:
        """The rows recorded so far as a Trace."""
        cat = {
            name: np.concatenate(v) if v else np.zeros((0, self.top_k) if name in ("ids", "weights", "hit") else 0)
            for name, v in self._rows.items()
        }
        num_experts = self.num_experts
        if num_experts is None:
            num_experts = int(cat["ids"].max(initial=-1)) + 1
        return Trace.from_arrays(
            cat.pop("ids").reshape(-1, self.top_k),
            num_layers=self.num_layers,
            moe_layers=self.moe_layers,
            num_experts=num_experts,
            metadata=self.metadata,
            **cat,
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write what was recorded (see Trace.save)."""
        self.trace().save(path)


def expand_hits(ids: np.ndarray, unique_ids: np.ndarray, unique_hits: np.ndarray) -> np.ndarray:
    """Per-token hits [T, k] from a store request: ids [T, k], the sorted unique ids asked
    for and the store's `last_hits` parallel to them."""
    unique_ids = np.asarray(unique_ids)
    pos = np.searchsorted(unique_ids, ids)
    if unique_ids.size == 0 or not np.array_equal(unique_ids[np.minimum(pos, len(unique_ids) - 1)], ids):
        raise WasteError("expand_hits: ids contain experts that were not in the request")
    return np.asarray(unique_hits, bool)[pos]


def is_trace_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path` holds a waste routing trace (an earlier --trace-out may be replaced)."""
    try:
        load(path)
    except WasteError:
        return False
    return True


def load(path: str | os.PathLike[str]) -> Trace:
    """Read a trace written by Trace.save; refuses unknown versions and damaged files."""
    path = Path(path)
    if path.is_dir():
        raise WasteError(f"trace {path}: is a directory, not a .npz file")
    try:
        loaded = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise WasteError(f"trace {path}: no such file") from None
    except Exception as e:  # NumPy's reasons are its own (a pickle, a bad header): name the file's kind
        raise WasteError(f"trace {path}: not a readable .npz archive, as waste run --trace-out writes "
                         f"({type(e).__name__})") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise WasteError(f"trace {path}: a single .npy array, not the .npz archive waste run --trace-out writes")
    try:
        with loaded as z:
            data = {name: z[name] for name in z.files}
    except Exception as e:
        raise WasteError(f"trace {path}: not a readable .npz ({type(e).__name__}: {e})") from None
    if str(data.get("format", "")) != TRACE_FORMAT:
        raise WasteError(f"trace {path}: not a waste routing trace (format field missing or wrong)")
    try:
        version = int(data["version"])
    except (KeyError, TypeError, ValueError):
        version = -1
    if version != TRACE_VERSION:
        raise WasteError(f"trace {path}: version {version} is not supported (this reader knows {TRACE_VERSION})")
    missing = [name for name in (*_ARRAYS, "config", "metadata") if name not in data]
    if missing:
        raise WasteError(f"trace {path}: missing arrays {', '.join(missing)}")
    try:
        header = json.loads(str(data["config"]))
        metadata = json.loads(str(data["metadata"]))
        trace = Trace(
            position=data["position"].astype(np.int64),
            layer=data["layer"].astype(np.int64),
            phase=data["phase"].astype(np.int8),
            step=data["step"].astype(np.int64),
            ids=data["ids"].astype(np.int64),
            weights=data["weights"].astype(np.float32),
            hit=data["hit"].astype(bool),
            num_layers=int(header["num_layers"]),
            moe_layers=tuple(int(x) for x in header["moe_layers"]),
            top_k=int(header["top_k"]),
            num_experts=int(header["num_experts"]),
            metadata=metadata,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise WasteError(f"trace {path}: damaged header ({type(e).__name__}: {e})") from None
    trace.validate()
    return trace


def _run_starts(step: np.ndarray, layer: np.ndarray) -> np.ndarray:
    """Indices where a new (step, layer) run of rows begins."""
    change = (step[1:] != step[:-1]) | (layer[1:] != layer[:-1])
    return np.concatenate([[0], np.flatnonzero(change) + 1]).astype(np.int64)
