"""The FFN half of a block: routed MoE with shared experts, or the dense MLP of the first layers.

A MoE forward over a chunk of T tokens routes all of them, fetches each unique routed expert
of the chunk once (one store request, ids sorted) and applies it to every token that chose
it with one matmul per projection over those rows. The dedup ratio T*k / unique says how much
expert traffic the chunk saved against token-by-token execution.

The expert store interface (`waste.engine.experts` implements it):
`store.get(layer_index, expert_ids: list[int]) -> list[(w1 gate, w3 up, w2 down)]` of QMatrix,
and optionally `store.fetch(layer_index, expert_ids)`, which yields (index, expert) as each
arrives: the layer then computes the experts it has while the others are still being read,
and adds their outputs in id order whatever the order of arrival (the same bits as `get`).
`fetch`'s iterator may say in `ready` how many of its first pairs come without waiting (the
hits of a cache; everything for `get`): a decode step runs those together, in one kernel call
for all of them (`waste.kernels.moe.gated_experts_one_token`; with the shared experts and the
weighted sum when all are ready, `gated_experts_sum_one_token`), and each later one as it
arrives. A store that maps every expert (`maps_every_expert`: the memory map) is asked only to
count a decode step's request once the layer holds the step's experts as rows of that call's
tables (`waste.kernels.moe_step.ExpertTables`, filled as experts first come through `fetch`): the
step then routes and runs its experts in one kernel call (`ExpertTables.route_and_sum`).

Every MLP here (dense, shared and routed experts) is gated: down(act(gate x, up x)), with
act = SiLU(g) * u (SwiGLU, `hidden_act` "silu") or SiTU (K3, "situ"; see `waste.kernels.moe`).
The latent MoE of K3 lives beside this in `waste.engine.latent_moe`.

Input x is the residual stream after post_attention_layernorm; shapes x, y [T, hidden].
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

import numpy as np

from waste.config import ModelConfig
from waste.engine.expert_cache import Expert
from waste.errors import WasteError
from waste.kernels.moe import (
    add_weighted,
    add_weighted_rows,
    gated_experts,
    gated_experts_one_token,
    gated_experts_sum_one_token,
    run_together,
    situ_mlp,
    swiglu,
)
from waste.kernels.moe_step import ExpertTables
from waste.kernels.quant import QMatrix
from waste.kernels.routing import ROUTER_WEIGHTS, check_routing, route_checked, router_logits

GetMatrix = Callable[[str], QMatrix]
GetTensor = Callable[[str], np.ndarray]
ExpertMLP = Callable[[np.ndarray, QMatrix, QMatrix, QMatrix], np.ndarray]  # (x, gate, up, down) -> y


# Routed rows (token picks) a prefill runs through its experts in one group (`MoELayer._chunk`):
# the group's inputs, gate and up (and their unpadded copies), activations and outputs take
# 4 x GROUP_ROWS x (2 in + 5 inner) bytes (20 MB at the 48B's 2304 and 1024), counted in
# `waste.engine.memory`'s working buffers. Measured on a 256-token chunk, 2 threads, an AMD EPYC
# with AVX-512 VNNI and BF16 (2026-12-02, 60 interleaved runs of one layer): k3-mini's MoE (64
# MXFP4 256 x 512 experts, 13 MB, which stay in the 32 MB L3 between runs) took 7.6 ms at 512
# rows against 10.0 one expert at a time, 8.7 at 1024 and 9.7 at 2048 (larger groups outgrow the
# core's 1 MiB L2, we think); mini's (q8 256 x 1024, 53 MB, read from DRAM) 8.5 against 8.2, and
# 9.5 at 1024: fewer calls save less where one product is longer. In the whole engine (weights
# from DRAM) k3-mini's prefill rose 19-21% (docs/MEASURED.md).
GROUP_ROWS = 512


class ExpertSource(Protocol):
    def get(self, layer_index: int, expert_ids: list[int]) -> Sequence[Expert]: ...


@dataclass
class RoutingInfo:
    """What the router chose for one chunk of one layer."""

    ids: np.ndarray  # [T, k] int64, rank order
    weights: np.ndarray  # [T, k] float32
    unique: np.ndarray  # [U] int64, sorted unique expert ids of the chunk
    dedup_ratio: float  # T*k / U


def situ_params(cfg: ModelConfig) -> tuple[float | None, float | None] | None:
    """None for SwiGLU (`hidden_act` "silu"), (situ_beta, situ_linear_beta) for SiTU ("situ")."""
    if cfg.hidden_act == "silu":
        return None
    if cfg.hidden_act != "situ":
        raise WasteError(f"hidden_act {cfg.hidden_act!r} is not supported (expected 'silu' or 'situ')")
    return cfg.situ_beta, cfg.situ_linear_beta


def expert_mlp(cfg: ModelConfig) -> ExpertMLP:
    """The gated MLP product of the config's `hidden_act`: SwiGLU, or SiTU with its two betas."""
    params = situ_params(cfg)
    if params is None:
        return swiglu
    beta, linear_beta = params

    def situ(x: np.ndarray, gate: QMatrix, up: QMatrix, down: QMatrix) -> np.ndarray:
        return situ_mlp(x, gate, up, down, beta, linear_beta)

    return situ


def _mlp(get_matrix: GetMatrix, prefix: str, hidden: int, inner: int) -> Expert:
    """(gate, up, down) of a gated MLP named `{prefix}{gate,up,down}_proj.weight`, shapes checked."""
    out = []
    for name, shape in (("gate_proj", (inner, hidden)), ("up_proj", (inner, hidden)), ("down_proj", (hidden, inner))):
        m = get_matrix(f"{prefix}{name}.weight")
        if tuple(m.shape) != shape:
            raise WasteError(f"{prefix}{name}.weight: expected shape {list(shape)}, got {list(m.shape)}")
        out.append(m)
    return out[0], out[1], out[2]


class DenseFFN:
    """The dense MLP of layers < first_k_dense_replace: forward(x [T, hidden]) -> y [T, hidden]."""

    def __init__(self, gate: QMatrix, up: QMatrix, down: QMatrix, mlp: ExpertMLP = swiglu):
        self.gate, self.up, self.down = gate, up, down
        self.mlp = mlp

    @classmethod
    def from_weights(cls, cfg: ModelConfig, get_matrix: GetMatrix, get_tensor: GetTensor, prefix: str) -> DenseFFN:
        """Build from a container; prefix like 'model.layers.0.mlp.'."""
        return cls(*_mlp(get_matrix, prefix, cfg.hidden_size, cfg.intermediate_size), mlp=expert_mlp(cfg))

    def forward(self, x: np.ndarray) -> np.ndarray:
        return self.mlp(x, self.gate, self.up, self.down)


class MoELayer:
    """Sigmoid-routed MoE with shared experts; routed experts come from an expert store."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_index: int,
        router_weight: np.ndarray,
        score_bias: np.ndarray,
        shared: Expert | None,
        router_weights: str = "unbiased",
    ):
        if router_weights not in ROUTER_WEIGHTS:
            raise WasteError(f"router_weights must be one of {', '.join(ROUTER_WEIGHTS)}, got {router_weights!r}")
        self.layer_index = layer_index
        self.router_weight = np.ascontiguousarray(router_weight, np.float32)  # [E, hidden]
        self.score_bias = np.ascontiguousarray(score_bias, np.float32)  # [E]
        self.shared = shared
        self.router_weights = router_weights
        self.mlp = expert_mlp(cfg)
        self.situ_params = situ_params(cfg)
        self.top_k = cfg.num_experts_per_token
        self.num_groups = cfg.num_expert_group
        self.topk_group = cfg.topk_group
        self.renormalize = cfg.moe_renormalize
        self.scaling = cfg.routed_scaling_factor
        self.hidden = cfg.hidden_size
        if self.router_weight.shape[0] != len(self.score_bias):
            raise WasteError(f"router weight {self.router_weight.shape} and score bias {self.score_bias.shape} "
                             "disagree on the number of experts")
        check_routing(len(self.score_bias), self.score_bias, top_k=self.top_k, num_groups=self.num_groups,
                      topk_group=self.topk_group, router_weights=router_weights)
        # route_one_token's arguments from the router weight to `biased` (ExpertTables.route_and_sum).
        self._router_args = (self.router_weight, self.score_bias, self.top_k, self.num_groups, self.topk_group,
                             self.renormalize, np.float32(self.scaling), router_weights == "biased")
        # A decode step's experts as table rows, for a store that maps every expert (_tables_for).
        self._tables: ExpertTables | None = None
        self._tables_store: ExpertSource | None = None

    @classmethod
    def from_weights(
        cls,
        cfg: ModelConfig,
        get_matrix: GetMatrix,
        get_tensor: GetTensor,
        prefix: str,
        layer_index: int,
        router_weights: str = "unbiased",
    ) -> MoELayer:
        """Build from a container; prefix like 'model.layers.3.block_sparse_moe.'."""
        if cfg.routed_expert_hidden_size is not None:
            raise WasteError("a latent MoE (routed_expert_hidden_size) is a LatentMoELayer")
        return cls(cfg, layer_index, *router_and_shared(cfg, get_matrix, get_tensor, prefix), router_weights)

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x [T, hidden] -> (ids [T, k] int64 in rank order, weights [T, k] float32)."""
        return route_checked(router_logits(x, self.router_weight), self.score_bias, self.top_k, self.num_groups,
                             self.topk_group, self.renormalize, self.scaling, self.router_weights)

    def _check_input(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        if x.ndim != 2 or x.shape[1] != self.hidden:
            raise WasteError(f"MoE input must be [T, {self.hidden}], got shape {x.shape}")
        return x

    def routed(self, x: np.ndarray, z: np.ndarray, store: ExpertSource, shared: Expert | None = None,
               then: Callable[[], None] | None = None) -> tuple[np.ndarray, RoutingInfo]:
        """Route on x [T, hidden], run the chosen experts on z [T, in] (in = the experts' input
        width) -> (weighted sum of the expert outputs [T, in], RoutingInfo); each unique expert
        fetched once. The `shared` experts, if given, run on z while the routed ones are read;
        their output is added after the routed sum. `then` is called once the store has the
        request (its reads are issued; for a store that maps every expert, once the step ran):
        the model guesses the next layer's experts there."""
        tables = self._tables_for(store, shared)
        if tables is not None and z.shape[0] == 1:
            # Routing and, when every expert has rows, the experts too, in one call.
            ids, weights, unique, y = tables.route_and_sum(x, z, self._router_args)
            if y is not None:
                store.count_request(self.layer_index, unique)  # type: ignore[attr-defined]
                if then is not None:  # a map reads nothing itself: its guesses only advise the kernel, late is fine
                    then()
                return y[None, :], RoutingInfo(ids, weights, unique, ids.size / len(unique))
        else:
            ids, weights = self.route(x)
            # One token's top-k ids are distinct: sorted, they are its unique ids (np.unique costs 3x).
            unique = np.sort(ids[0]) if len(ids) == 1 else np.unique(ids)
        arrivals, ready = _arrivals(store, self.layer_index, unique)
        if then is not None:
            then()
        if z.shape[0] == 1:
            y = self._one_token(z, ids, weights, unique, arrivals, ready, shared)
        else:
            extra = self.mlp(z, *shared) if shared is not None else None
            y = self._chunk(z, ids, weights, unique, arrivals, ready)
            if extra is not None:
                y += extra
        if tables is not None and tables.usable:
            # The prefill's experts too: a decode step finds them in the tables. Added at their
            # first decode instead, `mini` q8's took the slower path in 94 of 448 MoE layer steps
            # over 64 tokens after a 256-token prompt, and those steps cost more than the call.
            for e in unique[~tables.known[unique]]:
                tables.add(int(e), store.handed_out(self.layer_index, int(e)))  # type: ignore[attr-defined]
        return y, RoutingInfo(ids, weights, unique, ids.size / max(len(unique), 1))

    def drop_tables(self) -> None:
        """Forget the decode tables and the store they were made over: they hold that store's
        experts (an MXFP4 expert's repacked copy is process memory), which a closed store's
        would keep alive until the next decode step made new ones."""
        self._tables = None
        self._tables_store = None

    def _tables_for(self, store: ExpertSource, shared: Expert | None) -> ExpertTables | None:
        """The layer's ExpertTables for a store that maps every expert (decode), else None."""
        if not getattr(store, "maps_every_expert", False):
            return None
        if self._tables is None or self._tables_store is not store or self._tables.shared is not shared:
            self._tables = ExpertTables(len(self.score_bias), shared, self.situ_params)
            self._tables_store = store
        return self._tables

    def _chunk(self, z: np.ndarray, ids: np.ndarray, weights: np.ndarray, unique: np.ndarray,
               arrivals: Iterator[tuple[int, Expert]], ready: int) -> np.ndarray:
        """The weighted sum of the routed experts over a chunk of tokens z [T, in], T > 1. The
        `ready` experts the store hands out at once run together (`gated_experts`: three kernel
        calls per group of up to GROUP_ROWS routed rows), each later one as it arrives; the
        outputs are added in id order, the sums of running each expert alone."""
        U, k = len(unique), ids.shape[1]
        # Picks sorted by expert id, tokens ascending within each (a stable sort): expert i's
        # picks are order[start[i]:start[i] + count[i]]. Top-k ids are distinct per token, so
        # each token appears at most once per expert.
        order = np.argsort(ids.reshape(-1), kind="stable")
        count = np.bincount(np.searchsorted(unique, ids.reshape(-1)), minlength=U).astype(np.int64)
        start = np.zeros(U, np.int64)
        np.cumsum(count[:-1], out=start[1:])
        tokens = order // k
        scale = weights.reshape(-1)[order]
        y = np.zeros_like(z)
        # Outputs are added in id order as soon as every lower id's is in: the sums of `get`.
        done: dict[int, np.ndarray] = {}
        added = 0
        prepared: dict = {}  # z as the experts' products read it, made by the first batch

        def run(batch: list[tuple[int, Expert]]) -> None:
            nonlocal added
            experts = [expert for _, expert in batch]
            picked = np.array([i for i, _ in batch], np.int64)
            n = count[picked]
            first_row = np.zeros(len(batch), np.int64)  # of each expert's rows in the batch's
            np.cumsum(n[:-1], out=first_row[1:])
            rows = np.repeat(start[picked] - first_row, n) + np.arange(int(n.sum()))  # into `order`
            out = gated_experts(z, experts, first_row, n, self.situ_params, take=tokens[rows], prepared=prepared)
            if out is None:  # experts that cannot run together: one by one
                for i, expert in batch:
                    done[i] = self.mlp(z[tokens[start[i]:start[i] + count[i]]], *expert)
            else:
                for j, (i, _) in enumerate(batch):
                    done[i] = out[first_row[j]:first_row[j] + n[j]]
            while added in done:
                picks = slice(start[added], start[added] + count[added])
                add_weighted_rows(y, tokens[picks], scale[picks], done.pop(added))
                added += 1

        batch: list[tuple[int, Expert]] = []
        rows = 0
        for i, expert in islice(arrivals, ready):
            if batch and rows + count[i] > GROUP_ROWS:
                run(batch)
                batch, rows = [], 0
            batch.append((i, expert))
            rows += int(count[i])
        if batch:
            run(batch)
        for arrival in arrivals:
            run([arrival])
        if added != U:
            raise WasteError(f"expert store returned {added} experts for {U} requested ids")
        return y

    def _one_token(self, z: np.ndarray, ids: np.ndarray, weights: np.ndarray, unique: np.ndarray,
                   arrivals: Iterator[tuple[int, Expert]], ready: int, shared: Expert | None) -> np.ndarray:
        """The routed experts' weighted sum plus the shared experts' output for one token z [1, in]
        (decode). When the store hands out every expert at once, they and the shared experts run
        in one call that also sums them (`gated_experts_sum_one_token`), if formats and shapes
        allow. Otherwise the `ready` ones run in one batch (`gated_experts_one_token`), with the
        shared experts when they allow, then each later one as it arrives, while the store reads
        the rest. The outputs are added in id order: the bits of the chunk path's sums."""
        U = len(unique)
        first = list(islice(arrivals, ready))
        if len(first) == U:  # every expert at hand: all of them and the sum in one call, if they allow
            experts: list[Expert] = [None] * U  # type: ignore[list-item]
            for i, expert in first:
                experts[i] = expert
            y = gated_experts_sum_one_token(z, experts if shared is None else [*experts, shared],
                                            weights[0, np.argsort(ids[0])], self.situ_params)
            if y is not None:
                for _ in arrivals:  # none left; running the iterator out ends the store's request
                    raise WasteError(f"expert store handed out more than the {U} experts asked for")
                return y[None, :]
        outs = np.empty((U + 1, z.shape[1]), np.float32)  # row U: the shared experts'
        computed = np.zeros(U + 1, bool)

        def run(batch: list[tuple[int, Expert]]) -> None:
            together = gated_experts_one_token(z, [expert for _, expert in batch], self.situ_params)
            rows = [i for i, _ in batch]
            if together is not None:
                outs[rows] = together
            else:
                for i, expert in batch:
                    outs[i] = self.mlp(z, *expert)[0]
            computed[rows] = True

        if shared is None:
            computed[U] = True
        elif first and run_together([*(expert for _, expert in first), shared]):
            first.append((U, shared))
        else:
            run([(U, shared)])
        if first:
            run(first)
        for arrival in arrivals:
            run([arrival])
        if not computed.all():
            raise WasteError(f"expert store returned {int(computed[:U].sum())} experts for {U} requested ids")
        y = np.zeros_like(z)
        # unique is ids[0] sorted: the weights in id order
        add_weighted(y[0], outs[:U], weights[0, np.argsort(ids[0])])
        if shared is not None:
            y += outs[U]
        return y

    def forward(self, x: np.ndarray, store: ExpertSource,
                then: Callable[[], None] | None = None) -> tuple[np.ndarray, RoutingInfo]:
        """x [T, hidden] -> (y [T, hidden], RoutingInfo): routed experts plus the shared ones
        (computed while the routed experts are read, added after them); `then` as in `routed`."""
        x = self._check_input(x)
        return self.routed(x, x, store, self.shared, then)


def _arrivals(store: ExpertSource, layer: int, unique: np.ndarray) -> tuple[Iterator[tuple[int, Expert]], int]:
    """((index into unique, expert) as the store hands them out, how many of the first ones come
    without waiting): `fetch` if the store has one (its reads start now), else `get`."""
    ids = [int(e) for e in unique]
    fetch = getattr(store, "fetch", None)
    if fetch is not None:
        arrivals = fetch(layer, ids)
        return arrivals, int(getattr(arrivals, "ready", 0))
    experts = store.get(layer, ids)
    if len(experts) != len(ids):
        raise WasteError(f"expert store returned {len(experts)} experts for {len(ids)} requested ids")
    return enumerate(experts), len(ids)


def router_and_shared(cfg: ModelConfig, get_matrix: GetMatrix, get_tensor: GetTensor, prefix: str
                      ) -> tuple[np.ndarray, np.ndarray, Expert | None]:
    """(router weight [E, hidden], score bias [E], shared experts or None) of a MoE block, shapes checked."""
    E, hidden = cfg.num_experts, cfg.hidden_size
    w = np.asarray(get_tensor(prefix + "gate.weight"), np.float32)
    if w.shape != (E, hidden):
        raise WasteError(f"{prefix}gate.weight: expected shape {[E, hidden]}, got {list(w.shape)}")
    b = np.asarray(get_tensor(prefix + "gate.e_score_correction_bias"), np.float32).reshape(-1)
    if b.shape != (E,):
        raise WasteError(f"{prefix}gate.e_score_correction_bias: expected {E} values, got {list(b.shape)}")
    shared = None
    if cfg.num_shared_experts:
        inner = cfg.moe_intermediate_size * cfg.num_shared_experts
        shared = _mlp(get_matrix, prefix + "shared_experts.", hidden, inner)
    return w, b, shared
