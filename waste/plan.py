"""The memory planner: what a model needs in RAM and on disk, itemised in bytes.

Attention-side state comes from the config (it is a property of the shape); weight
bytes come from the container's manifest when the target is a container, and otherwise
from the expected tensor table (`waste.container.format.expected_tensors`) priced with the
storage formats' own buffer layouts (`waste.qformat.buffer_layout`), so the figures
follow the code that writes containers rather than a separate formula.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from waste.config import PRESETS, ModelConfig, load_config_file, load_preset
from waste.errors import WasteError
from waste.qformat import SCHEMES, buffer_layout
from waste.units import human_bytes, human_count, parse_count, parse_size

STATE_DTYPE_BYTES = {"f32": 4, "bf16": 2}
DEFAULT_SCHEME = "q4"
# RAM sizes `waste plan` prices the expert cache at when no --ram is given: a 24 GiB laptop and a
# 512 GiB server.
DEFAULT_BUDGETS = (24 << 30, 512 << 30)


def matrix_bytes(fmt: str, shape: tuple[int, int]) -> int:
    """Bytes one matrix takes in a storage format, read off the format's buffer layout."""
    return sum(int(np.prod(bshape)) * np.dtype(dtype).itemsize for _, dtype, bshape in buffer_layout(fmt, shape))


def tensor_bytes(name: str, shape: tuple[int, ...], scheme: str) -> int:
    """Bytes of one trunk tensor once stored under `scheme` (the container's storage_of)."""
    from waste.container.format import storage_of

    kind, storage = storage_of(name, shape, scheme)
    if kind == "matrix":
        return matrix_bytes(storage, (shape[0], shape[1]))
    return int(np.prod(shape)) * 4


@dataclass(frozen=True)
class StateBytes:
    """Session state that does not live in the weights, at one context length."""

    kda_state: int  # L_kda x [H, K, V]
    conv_rings: int  # L_kda x 3 projections x (kernel - 1) x H*K
    mla_latent: int  # L_mla x context x (kv_lora + rope)

    @property
    def total(self) -> int:
        return self.kda_state + self.conv_rings + self.mla_latent


def state_bytes(cfg: ModelConfig, context: int, state_dtype: str = "f32") -> StateBytes:
    """KDA recurrent state, short-conv rings and MLA latent cache at `context` tokens."""
    if state_dtype not in STATE_DTYPE_BYTES:
        raise WasteError(f"unknown state dtype {state_dtype!r}; expected f32 or bf16")
    b = STATE_DTYPE_BYTES[state_dtype]
    n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    return StateBytes(
        kda_state=n_kda * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * b,
        conv_rings=n_kda * 3 * (cfg.short_conv_kernel - 1) * cfg.kda_proj_size * b,
        mla_latent=n_mla * context * cfg.mla_latent_size * b,
    )


def kda_pending_bytes(cfg: ModelConfig) -> int:
    """The decode's deferred rank-1 update, kept beside each KDA layer's recurrent state until the
    next token's pass folds it in (`waste.engine.kda_layer.KDAState`): H x (K + V) float32 a layer.
    Held by every session, at any context; not part of the seed's state figures (`state_bytes`)."""
    return len(cfg.kda_layers) * cfg.kda_num_heads * 2 * cfg.kda_head_dim * 4


def row_read_bytes(cfg: ModelConfig, weights: WeightBytes) -> int:
    """Trunk bytes a run reads a row at a time from the container's file instead of holding them:
    the embedding of a model whose lm_head is a matrix of its own (`waste.container.reader.ROW_READ`);
    a tied one is the lm_head too, read whole every token."""
    return 0 if cfg.tie_word_embeddings else weights.by_class.get("embedding", 0)


def all_mla_state_bytes(cfg: ModelConfig, context: int, state_dtype: str = "f32") -> int:
    """The attention-side state the same model would need with every layer MLA."""
    return cfg.num_layers * context * cfg.mla_latent_size * STATE_DTYPE_BYTES[state_dtype]


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of the weights: the trunk stays in RAM, routed experts stream from disk."""

    trunk: int
    experts_total: int
    expert_layers: int
    per_expert: int  # one expert's w1 + w3 + w2 (a container blob, padding included)
    expert_storage: str  # f32, bf16, q8g, q4g or mxfp4
    by_class: dict[str, int] = field(default_factory=dict)
    source: str = "formula"  # "formula" or "container"

    @property
    def per_expert_layer(self) -> int:
        return self.experts_total // max(self.expert_layers, 1)


def planned_expert_storage(cfg: ModelConfig, scheme: str, experts: str | None = None) -> str:
    """Storage the routed experts are priced in: as convert would store them; under "bf16" (the
    checkpoint as shipped) bf16, or MXFP4 when the checkpoint's experts are MXFP4."""
    from waste.container.format import expert_storage

    if scheme == "bf16" and experts is None:
        return "mxfp4" if cfg.expert_quant == "mxfp4" else "bf16"
    return expert_storage(cfg, "q8" if scheme == "bf16" else scheme, experts)


def formula_weight_bytes(cfg: ModelConfig, scheme: str, experts: str | None = None) -> WeightBytes:
    """Weight bytes priced from the expected tensor table and the formats' layouts; one routed expert
    as the container's blob (`plan_experts`: w1, w3, w2 aligned, the blob padded to 4096 bytes),
    which is what the expert cache holds and the disk reads."""
    from waste.container.format import expected_tensors, plan_experts, tensor_class

    if scheme not in SCHEMES:
        raise WasteError(f"unknown quantisation scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    by_class: dict[str, int] = {}
    for name, shape in expected_tensors(cfg).items():
        cls = tensor_class(name, cfg)
        by_class[cls] = by_class.get(cls, 0) + tensor_bytes(name, shape, scheme)
    storage = planned_expert_storage(cfg, scheme, experts)
    per_expert = plan_experts(cfg, storage).blob_bytes
    n_layers = len(cfg.moe_layers)
    return WeightBytes(
        trunk=sum(by_class.values()),
        experts_total=per_expert * cfg.num_experts * n_layers,
        expert_layers=n_layers,
        per_expert=per_expert,
        expert_storage=storage,
        by_class=by_class,
        source="formula",
    )


def container_weight_bytes(container: Any) -> WeightBytes:
    """Weight bytes as the container's manifest records them."""
    counts = container.byte_counts()
    cfg = container.config
    return WeightBytes(
        trunk=int(counts["trunk_bytes"]),
        experts_total=int(counts["expert_bytes"]),
        expert_layers=len(cfg.moe_layers),
        per_expert=int(counts["expert_blob_bytes"]),
        expert_storage=str(counts["expert_storage"]),
        by_class={k: int(v) for k, v in counts.get("per_class", {}).items()},
        source="container",
    )


@dataclass(frozen=True)
class Plan:
    """Everything `waste plan` prints, as numbers."""

    name: str
    config: ModelConfig
    context: int
    state_dtype: str
    scheme: str
    state: StateBytes
    weights: WeightBytes
    ram: int | None

    @property
    def touched_per_token(self) -> int:
        """Expert bytes one decoded token needs: top-k experts in every MoE layer."""
        return self.config.num_experts_per_token * self.weights.expert_layers * self.weights.per_expert

    @property
    def resident(self) -> int:
        """RAM that must be resident whatever the cache: the trunk weights, but an untied embedding
        (read a row at a time from the container: `row_read_bytes`), plus the session state."""
        return self.weights.trunk - row_read_bytes(self.config, self.weights) + self.state.total

    def cache_room_at(self, ram: int) -> int:
        """RAM left for the expert cache under a budget of `ram` bytes (negative: does not fit)."""
        return ram - self.resident

    def experts_fit_fraction_at(self, ram: int) -> float | None:
        """Fraction of the routed experts that fit under `ram` (None: the model has none)."""
        total = self.config.num_experts * self.weights.expert_layers
        return self.experts_fit_at(ram) / total if total else None

    def experts_fit_at(self, ram: int) -> int:
        """Routed experts (blobs) an expert cache holds under a budget of `ram` bytes."""
        total = self.config.num_experts * self.weights.expert_layers
        return int(min(max(self.cache_room_at(ram), 0) // self.weights.per_expert, total))

    @property
    def cache_room(self) -> int | None:
        """RAM left for the expert cache under the budget (negative: does not fit)."""
        return None if self.ram is None else self.cache_room_at(self.ram)

    @property
    def experts_fit(self) -> int | None:
        return None if self.ram is None else self.experts_fit_at(self.ram)

    def as_dict(self) -> dict[str, Any]:
        total_experts = self.config.num_experts * self.weights.expert_layers
        return {
            "name": self.name,
            "model_type": self.config.model_type,
            "context": self.context,
            "state_dtype": self.state_dtype,
            "scheme": self.scheme,
            "weights_source": self.weights.source,
            "kda_state_bytes": self.state.kda_state,
            "conv_ring_bytes": self.state.conv_rings,
            "mla_latent_bytes": self.state.mla_latent,
            "state_total_bytes": self.state.total,
            "trunk_bytes": self.weights.trunk,
            "trunk_by_class": dict(self.weights.by_class),
            "experts_total_bytes": self.weights.experts_total,
            "experts_per_layer_bytes": self.weights.per_expert_layer,
            "expert_bytes": self.weights.per_expert,
            "experts_count": total_experts,
            "expert_bytes_per_token": self.touched_per_token,
            "ram_bytes": self.ram,
            "expert_cache_room_bytes": self.cache_room,
            "experts_fit": self.experts_fit,
            "experts_fit_fraction": None if self.ram is None else self.experts_fit_fraction_at(self.ram),
            "expert_storage": self.weights.expert_storage,
            "weights_total_bytes": self.weights.trunk + self.weights.experts_total,
            "budgets": [{"ram_bytes": ram, "expert_cache_room_bytes": self.cache_room_at(ram),
                         "experts_fit": self.experts_fit_at(ram),
                         "experts_fit_fraction": self.experts_fit_fraction_at(ram)}
                        for ram in (DEFAULT_BUDGETS if self.ram is None else (self.ram,))],
        }


def load_target(target: str) -> tuple[str, ModelConfig, Any | None]:
    """Resolve a preset name, config.json (or its directory) or container; (name, config, container)."""
    path = Path(target)
    if target in PRESETS and not path.exists():
        return target, load_preset(target), None
    if (path / "manifest.json").is_file():
        from waste.container.reader import open_container

        container = open_container(path, verify=False)  # sizes only: the manifest is enough
        return path.name, container.config, container
    if path.is_file() or (path / "config.json").is_file():
        return path.stem if path.is_file() else path.name, load_config_file(path), None
    raise WasteError(
        f"plan target {target!r}: not a preset ({', '.join(PRESETS)}), a config.json or a .waste container"
    )


def make_plan(
    target: str,
    *,
    context: int | str = 4096,
    state_dtype: str = "f32",
    scheme: str | None = None,
    ram: int | str | None = None,
    experts: str | None = None,
) -> Plan:
    """Plan a preset, config.json or container at one context length."""
    name, cfg, container = load_target(target)
    ctx = parse_count(context, "context")
    if ctx < 1:
        raise WasteError(f"context {context!r}: a run holds at least one token")
    if ctx > cfg.max_position_embeddings:
        raise WasteError(f"context {ctx} exceeds the model's maximum of {cfg.max_position_embeddings} tokens")
    ram_bytes = None if ram is None else parse_size(ram, "--ram")
    if container is not None and scheme not in (None, container.scheme):
        raise WasteError(f"container {name} is stored as {container.scheme!r}; --quant {scheme} does not apply")
    if container is not None and experts is not None:
        raise WasteError(f"container {name} stores its experts as {container.expert_storage!r}; --experts does "
                         "not apply")
    if container is not None:
        weights, used_scheme = container_weight_bytes(container), container.scheme
        container.close()
    else:
        used_scheme = scheme or DEFAULT_SCHEME
        weights = formula_weight_bytes(cfg, used_scheme, experts)
    return Plan(name, cfg, ctx, state_dtype, used_scheme, state_bytes(cfg, ctx, state_dtype), weights, ram_bytes)


def sweep_contexts(cfg: ModelConfig, start: int = 1024) -> list[int]:
    """Powers of two from `start` up to the model's maximum context (inclusive)."""
    out, ctx = [], start
    while ctx < cfg.max_position_embeddings:
        out.append(ctx)
        ctx *= 2
    out.append(cfg.max_position_embeddings)
    return out


def _row(label: str, n: int, note: str = "") -> str:
    return f"  {label:<34} {human_bytes(n):>11} {n:>18,d} B  {note}".rstrip()


def format_plan(plan: Plan) -> str:
    """The human-readable plan table."""
    cfg, s, w = plan.config, plan.state, plan.weights
    n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    total_experts = cfg.num_experts * w.expert_layers
    lines = [
        f"plan: {plan.name} ({cfg.model_type}, {cfg.num_layers} layers: {n_kda} KDA + {n_mla} MLA), "
        f"context {human_count(plan.context)} = {plan.context:,d} token{'s' * (plan.context != 1)}, "
        f"state {plan.state_dtype}, "
        f"weights {plan.scheme} ({w.source})",
        "session state",
        _row("KDA recurrent state", s.kda_state, f"{n_kda} x {cfg.kda_num_heads} x {cfg.kda_head_dim} x "
             f"{cfg.kda_head_dim}"),
        _row("short-conv rings", s.conv_rings, f"{n_kda} x 3 x {cfg.short_conv_kernel - 1} x {cfg.kda_proj_size}"),
        _row(f"MLA latent at {human_count(plan.context)}", s.mla_latent,
             f"{n_mla} x {plan.context} x {cfg.mla_latent_size}"),
        _row("state total", s.total),
        "weights",
        _row("trunk (non-expert)", w.trunk),
    ]
    for cls, n in sorted(w.by_class.items(), key=lambda kv: -kv[1]):
        lines.append(_row(f"  {cls}", n))
    lines += [
        _row(f"routed experts ({w.expert_storage}), total", w.experts_total, f"{total_experts:,d} experts"),
        _row("routed experts, per layer", w.per_expert_layer, f"{cfg.num_experts} experts x {w.expert_layers} layers"),
        _row("one expert (w1 + w3 + w2)", w.per_expert),
        _row("expert bytes touched per token", plan.touched_per_token,
             f"top-{cfg.num_experts_per_token} x {w.expert_layers} layers"),
        _row("weights total (trunk + experts)", w.trunk + w.experts_total),
        _row("resident (trunk + state)", plan.resident, "embedding read from disk" if row_read_bytes(cfg, w) else ""),
    ]
    for ram in DEFAULT_BUDGETS if plan.ram is None else (plan.ram,):
        room, fit, fraction = plan.cache_room_at(ram), plan.experts_fit_at(ram), plan.experts_fit_fraction_at(ram)
        lines += [
            f"RAM budget {human_bytes(ram)}",
            _row("left for the expert cache", max(room, 0), "" if room >= 0 else
                 f"does NOT fit: short by {human_bytes(-room)}"),
            "  experts that fit: none (no routed experts)" if fraction is None else
            f"  experts that fit: {fit:,d} of {total_experts:,d} ({100.0 * fraction:.1f}%)",
        ]
    return "\n".join(lines)


def format_sweep(cfg: ModelConfig, plans: list[Plan]) -> str:
    """Context-dependent lines, one row per context."""
    header = f"  {'context':>8} {'MLA latent':>11} {'state total':>11} {'all-MLA would be':>16}"
    has_ram = plans and plans[0].ram is not None
    if has_ram:
        header += f" {'cache room':>11} {'experts fit':>12}"
    lines = [f"sweep: {plans[0].name}, state {plans[0].state_dtype}", header]
    for p in plans:
        row = (f"  {human_count(p.context):>8} {human_bytes(p.state.mla_latent):>11} {human_bytes(p.state.total):>11} "
               f"{human_bytes(all_mla_state_bytes(cfg, p.context, p.state_dtype)):>16}")
        if has_ram:
            row += f" {human_bytes(max(p.cache_room or 0, 0)):>11} {p.experts_fit or 0:>12,d}"
        lines.append(row)
    return "\n".join(lines)


def run_prediction(plan: Plan, args: Any) -> Any:
    """What `waste plan CONTAINER --ram R` predicts for a `waste run` of it on a machine with R
    available (`waste.analysis.budget.predict_run`); None for a preset or config.json (the
    runtime and the disk are measured on a container) or without --ram.

    The runtime is measured as `waste run` measures it (`measure_runtime`: the model loaded and
    a few tokens run through it with each kind of expert store, which costs a few seconds and the
    trunk in RAM), then a decode step's compute on the same model with its experts pooled
    (`waste.analysis.compute`: top-k + 1 experts a MoE layer read, a few more seconds); the
    bandwidths are given, cached or measured (`waste.analysis.machine`)."""
    from waste.analysis.budget import predict_run
    from waste.analysis.compute import measure_decode_compute
    from waste.analysis.machine import bandwidths
    from waste.container.format import EXPERTS
    from waste.container.reader import open_container
    from waste.engine.memory import measure_runtime
    from waste.engine.model import DEFAULT_PREFILL_CHUNK

    target = Path(args.target)
    if plan.ram is None or not (target / "manifest.json").is_file():
        return None
    trace = None
    if args.trace:
        from waste.engine.trace import load

        trace = load(args.trace)
        if trace.num_experts != plan.config.num_experts or set(trace.moe_layers) - set(plan.config.moe_layers):
            raise WasteError(f"trace {args.trace}: recorded on another model ({trace.num_experts} experts, MoE layers "
                             f"{list(trace.moe_layers)})")
    rates = bandwidths(disk_file=target / EXPERTS, disk_gbps=args.disk_gbps, mem_gbps=args.mem_gbps,
                       measure=args.measure)
    trace_name = str(args.trace)
    with open_container(target) as container:
        if trace is not None:
            trace_name += _trace_origin(trace.metadata, container.manifest_sha256)
        model, runtime = measure_runtime(container, chunk=DEFAULT_PREFILL_CHUNK)
        compute = measure_decode_compute(model)
        del model
    return predict_run(plan, plan.ram, rates, runtime=runtime, trace=trace, trace_name=trace_name,
                       compute=compute)


def _trace_origin(metadata: dict[str, Any], container_sha256: str) -> str:
    """What the prediction says of a trace's origin when it is not this container: a trace of
    another model of the same shape replays that model's routing, which a user may want (a
    sibling conversion) or not (another seed), so the prediction names it."""
    if metadata.get("synthetic"):
        return " (synthetic)"
    recorded = metadata.get("container_sha256")
    if recorded is None:
        return " (recorded without naming its container)"
    if recorded != container_sha256:
        return f" (recorded on another container, {metadata.get('container', '?')}: that model's routing)"
    return ""


def cmd_plan(args: Any) -> int:
    """`waste plan TARGET [--context N] [--ram SIZE] [--state-dtype] [--quant] [--experts] [--sweep] [--json]
    [--disk-gbps G] [--mem-gbps G] [--measure] [--trace F.npz]`."""
    plan = make_plan(args.target, context=args.context, state_dtype=args.state_dtype, scheme=args.quant, ram=args.ram,
                     experts=args.experts)
    if plan.ram is None or plan.weights.source != "container":
        given = [name for name, value in (("--trace", args.trace), ("--disk-gbps", args.disk_gbps),
                                          ("--mem-gbps", args.mem_gbps), ("--measure", args.measure)) if value]
        if given:
            raise WasteError(f"{', '.join(given)}: only a run's prediction uses them, and it needs a container "
                             "and --ram")
    elif plan.state_dtype != "f32":
        # The prediction is of `waste run`, whose session keeps its state in float32.
        raise WasteError(f"--state-dtype {plan.state_dtype}: waste run keeps its state in f32, so a run's "
                         "prediction (a container with --ram) cannot price it; leave out --ram or the option")
    prediction = run_prediction(plan, args)
    sweep = None
    if args.sweep:
        sweep = [
            make_plan(args.target, context=ctx, state_dtype=args.state_dtype, scheme=args.quant, ram=args.ram,
                      experts=args.experts)
            for ctx in sweep_contexts(plan.config)
        ]
    if args.json:
        out: dict[str, Any] = plan.as_dict()
        if prediction is not None:
            out["run"] = prediction.as_dict()
        if sweep is not None:
            out["sweep"] = [
                {k: p.as_dict()[k] for k in ("context", "mla_latent_bytes", "state_total_bytes",
                                             "expert_cache_room_bytes", "experts_fit")} for p in sweep
            ]
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(plan))
        if prediction is not None:
            print("(the RAM budget lines above price the model's bytes alone; the run below also holds its runtime, "
                  "working buffers and headroom)")
            print(prediction.describe())
        if sweep is not None:
            print(format_sweep(plan.config, sweep))
    return 0
