"""Numbers behind the planning notebooks: a plan split into parts, the state curve against
context, and the decode speed bound that an expert cache of a given hit rate allows.

Decode speed bound. One decoded token reads, at the least:
- the trunk weights it multiplies by (everything resident except the embedding table, of
  which it reads one row) plus the session state (KDA states and conv rings read and
  written, the MLA latent read over the whole context): from RAM at `mem_gbps`;
- the routed experts it selects, `plan.touched_per_token` bytes: the fraction `1 - hit_rate`
  missing from the RAM cache is read from NVMe at `nvme_gbps` into RAM; all of them, cached
  or just read, then pass through the cores from RAM at `mem_gbps`. (The DMA writes of the
  missed experts into RAM are left out: leaving traffic out keeps the figure a bound.)
With the two transfers perfectly overlapped the token takes max(nvme, memory) seconds;
done one after the other it takes their sum. `DecodeBound.tokens_per_second` is the
overlapped figure, an upper bound no engine on that hardware can beat; `serial_tokens_per_second`
is the no-overlap figure. Compute is left out on purpose: on CPU at batch 1 the step is
bandwidth-bound, and leaving compute out keeps the figure a bound. Bandwidths are in
decimal GB/s (1e9 bytes per second), as drive and memory vendors quote them. What a run reaches
is lower (its kernels do not stream at the memory's bandwidth): `RunPrediction.decode_estimate`
puts the disk's time beside a step's compute measured on the model (`waste.analysis.compute`).

Prefill speed bound. A prompt of P tokens runs in layer-major passes of up to
PREFILL_PASS_TOKENS tokens (`waste.engine.model`), and each pass of T tokens fetches, in every
MoE layer, each expert its tokens route to once: with uniform routing E * (1 - (1 - k/E)^T)
experts, all E for a long pass. From a cold cache they come from disk: once per pass with the
streaming store (its LRU cache, smaller than the experts, has evicted a layer's experts by the
time the next pass reaches that layer), once in all when every expert fits in RAM (a later
pass reads only the experts no earlier pass routed to). The kernels then read those experts
and the trunk from RAM, once per pass. The bound is P over the larger of the two transfer
times; compute is left out again, which on 2 cores is far from free at prefill (the bound is
what the disk allows, not a prediction of the run).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from waste.config import ModelConfig
from waste.errors import WasteError
from waste.jit import parallel_kernel, prange
from waste.plan import Plan, all_mla_state_bytes, row_read_bytes, state_bytes

# Segment names of a plan in the order the stacked bars draw them.
# "trunk": what RAM holds of it; "row_read": an untied embedding, read a row at a time from disk
# (`waste.plan.row_read_bytes`); "experts": all of them, on disk.
PLAN_PARTS = ("kda_state", "conv_rings", "mla_latent", "trunk", "row_read", "experts")
PLAN_PART_LABELS = {
    "kda_state": "KDA state",
    "conv_rings": "conv rings",
    "mla_latent": "MLA latent",
    "trunk": "trunk weights",
    "row_read": "embedding (on disk)",
    "experts": "routed experts",
    "expert_cache": "expert cache",
    "free": "unused",
}
GB = 1e9
# Tokens the run `waste plan` predicts generates (each keeps its logits row); the rest of the
# context is prompt.
PREDICT_DECODE_TOKENS = 64


def plan_breakdown(plan: Plan) -> dict[str, int]:
    """Bytes of each part of a plan, keyed by PLAN_PARTS."""
    row_read = row_read_bytes(plan.config, plan.weights)
    return {
        "kda_state": plan.state.kda_state,
        "conv_rings": plan.state.conv_rings,
        "mla_latent": plan.state.mla_latent,
        "trunk": plan.weights.trunk - row_read,
        "row_read": row_read,
        "experts": plan.weights.experts_total,
    }


def ram_breakdown(plan: Plan) -> dict[str, int]:
    """What RAM holds under the plan's budget: state parts, trunk, the expert cache (whole
    experts that fit) and what is left unused. Needs `plan.ram`; when the resident part does
    not fit, the cache is empty and `free` is negative (the shortfall)."""
    if plan.ram is None:
        raise WasteError("ram_breakdown needs a plan made with a RAM budget (ram=...)")
    cache = (plan.experts_fit or 0) * plan.weights.per_expert
    parts = {k: v for k, v in plan_breakdown(plan).items() if k not in ("row_read", "experts")}
    parts["expert_cache"] = cache
    parts["free"] = plan.ram - plan.resident - cache
    return parts


def cache_fraction(plan: Plan) -> float:
    """Fraction of all routed experts the plan's RAM budget can cache (0 without a budget)."""
    total = plan.config.num_experts * plan.weights.expert_layers
    return (plan.experts_fit or 0) / total if total else 0.0


@dataclass(frozen=True)
class DecodeBound:
    """Bytes one decoded token moves and the speed bounds that follow (see the module docstring)."""

    hit_rate: float
    nvme_bytes: int  # expert bytes missed, read from NVMe
    memory_bytes: int  # trunk + state + every expert byte of the token, read from RAM
    nvme_seconds: float
    memory_seconds: float

    @property
    def tokens_per_second(self) -> float:
        """Upper bound with NVMe reads and RAM reads fully overlapped."""
        return 1.0 / max(self.nvme_seconds, self.memory_seconds)

    @property
    def serial_tokens_per_second(self) -> float:
        """Bound with no overlap: NVMe time plus RAM time."""
        return 1.0 / (self.nvme_seconds + self.memory_seconds)

    @property
    def limited_by(self) -> str:
        return "nvme" if self.nvme_seconds >= self.memory_seconds else "memory"


def copy_buffers(nbytes: int = 512 << 20) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) float32 buffers of `nbytes` for `copy_bandwidth`, to measure the copy
    again and again without new memory each time (on some VMs new memory costs seconds per GB)."""
    src = np.ones(nbytes // 4, np.float32)
    return src, np.empty_like(src)


def copy_bandwidth(nbytes: int = 512 << 20, rounds: int = 5, threads: int = 1,
                   buffers: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, float]:
    """This machine's memory copy bandwidth on `threads` cores: the best of `rounds` copies of a
    float32 buffer of `nbytes` (or of `buffers`, from `copy_buffers`), split into `threads`
    slices copied at once (np.copyto releases the GIL), counting the bytes read plus the bytes
    written (2 * nbytes per copy): {buffer_bytes, threads, best_seconds, gbps}. A measured
    stand-in for `mem_gbps`; a kernel's bandwidth is compared with the copy on as many threads as
    the kernel ran on, since one core alone may not reach what two do."""
    if threads < 1:
        raise WasteError(f"threads must be at least 1, got {threads}")
    src, dst = buffers if buffers is not None else copy_buffers(nbytes)
    edges = np.linspace(0, src.size, threads + 1).astype(np.int64)
    parts = [slice(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]

    def copy_all(pool: ThreadPoolExecutor) -> None:
        for done in [pool.submit(np.copyto, dst[p], src[p]) for p in parts]:
            done.result()

    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        copy_all(pool)  # fault the destination's pages in and start the threads before timing
        for _ in range(rounds):
            t0 = time.perf_counter()
            copy_all(pool)
            best = min(best, time.perf_counter() - t0)
    return {"buffer_bytes": int(src.nbytes), "threads": threads, "best_seconds": best,
            "gbps": 2 * src.nbytes / best / 1e9}


# Floats each thread of `read_bandwidth` sums side by side: four 512-bit registers of partial
# sums, so that the loop waits on memory rather than on one chain of additions.
READ_LANES = 64


@parallel_kernel
def _read_all(a, parts):
    """Sum of a [R, READ_LANES] float32, its rows split into `parts` runs read at once."""
    per = (a.shape[0] + parts - 1) // parts
    sums = np.zeros((parts, a.shape[1]), np.float32)
    for p in prange(parts):
        acc = np.zeros(a.shape[1], np.float32)
        for i in range(p * per, min(a.shape[0], (p + 1) * per)):
            for j in range(a.shape[1]):
                acc[j] += a[i, j]
        sums[p] = acc
    return sums.sum()


def read_bandwidth(buffer: np.ndarray, rounds: int = 5, threads: int = 1) -> dict[str, float]:
    """This machine's plain read of memory on `threads` cores: the best of `rounds` sums of a
    float32 `buffer` (a `copy_buffers` source), counting its bytes once: {buffer_bytes, threads,
    best_seconds, gbps}. What a kernel that only reads its weights (a decode step) could reach
    from memory, beside `copy_bandwidth`, which counts a copy's reads and writes: on a 2-core VM
    whose copy of 512 MB ran at 47 GB/s, this read ran at 32. Weights that stay in the last-level
    cache between calls can stream faster (a 35 MB matvec there ran at 57 GB/s, called again and
    again), so it bounds a model larger than that cache, not a smaller one."""
    if threads < 1:
        raise WasteError(f"threads must be at least 1, got {threads}")
    rows = np.ascontiguousarray(buffer, np.float32).reshape(-1)
    rows = rows[: rows.size // READ_LANES * READ_LANES].reshape(-1, READ_LANES)
    _read_all(rows[:threads], threads)  # compile (cached) and start the threads before timing
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        _read_all(rows, threads)
        best = min(best, time.perf_counter() - t0)
    return {"buffer_bytes": int(rows.nbytes), "threads": threads, "best_seconds": best,
            "gbps": rows.nbytes / best / 1e9}


def trunk_read_bytes(plan: Plan) -> int:
    """Trunk bytes a token's products read: all of the trunk but the embedding table, of which a
    token reads one row, unless the lm_head is that table (tied embeddings)."""
    if plan.config.tie_word_embeddings:
        return plan.weights.trunk
    return plan.weights.trunk - plan.weights.by_class.get("embedding", 0)


def decode_speed_bound(plan: Plan, hit_rate: float, nvme_gbps: float, mem_gbps: float) -> DecodeBound:
    """Speed bound of one decoded token at an expert-cache hit rate in [0, 1]; bandwidths in GB/s
    (`waste plan` measures the memory's by the decode's own q8g matvec, `machine.measure_memory`)."""
    if not 0.0 <= hit_rate <= 1.0:
        raise WasteError(f"hit rate {hit_rate}: expected a fraction between 0 and 1")
    if nvme_gbps <= 0 or mem_gbps <= 0:
        raise WasteError(f"bandwidths must be positive, got NVMe {nvme_gbps} GB/s and memory {mem_gbps} GB/s")
    experts = plan.touched_per_token
    missed = int(round((1.0 - hit_rate) * experts))
    trunk_read = trunk_read_bytes(plan)
    # KDA state and conv rings are read and written back; the latent cache is only read.
    state_traffic = 2 * (plan.state.kda_state + plan.state.conv_rings) + plan.state.mla_latent
    memory = trunk_read + state_traffic + experts
    return DecodeBound(
        hit_rate=float(hit_rate),
        nvme_bytes=missed,
        memory_bytes=memory,
        nvme_seconds=missed / (nvme_gbps * GB),
        memory_seconds=memory / (mem_gbps * GB),
    )


@dataclass(frozen=True)
class PrefillBound:
    """Bytes a cold prefill moves and the speed bound that follows (see the module docstring)."""

    prompt_tokens: int
    nvme_bytes: int  # routed expert bytes read from disk
    memory_bytes: int  # trunk and routed expert bytes the kernels read from RAM
    nvme_seconds: float
    memory_seconds: float

    @property
    def tokens_per_second(self) -> float:
        """Upper bound with disk and RAM reads fully overlapped, compute left out."""
        return self.prompt_tokens / max(self.nvme_seconds, self.memory_seconds)

    @property
    def limited_by(self) -> str:
        return "nvme" if self.nvme_seconds >= self.memory_seconds else "memory"


def routed_experts_per_layer(cfg: ModelConfig, tokens: int) -> float:
    """Experts a pass of `tokens` tokens routes to in one MoE layer, expected under uniform routing."""
    E, k = cfg.num_experts, cfg.num_experts_per_token
    return E * (1.0 - (1.0 - k / E) ** max(tokens, 0))


def prefill_speed_bound(plan: Plan, prompt_tokens: int, nvme_gbps: float, mem_gbps: float, *,
                        experts_fit: bool = False, pass_tokens: int | None = None) -> PrefillBound:
    """Speed bound of a prefill of `prompt_tokens` from a cold cache (see the module docstring):
    the streaming store's (`experts_fit` False) or the memory map's when every expert fits in RAM;
    passes of `pass_tokens` (default: the engine's PREFILL_PASS_TOKENS)."""
    if prompt_tokens < 1:
        raise WasteError(f"prompt of {prompt_tokens} tokens: expected at least 1")
    if nvme_gbps <= 0 or mem_gbps <= 0:
        raise WasteError(f"bandwidths must be positive, got NVMe {nvme_gbps} GB/s and memory {mem_gbps} GB/s")
    if pass_tokens is None:
        from waste.engine.model import PREFILL_PASS_TOKENS

        pass_tokens = PREFILL_PASS_TOKENS
    passes = [min(pass_tokens, prompt_tokens - start) for start in range(0, prompt_tokens, pass_tokens)]
    layer_bytes = plan.weights.expert_layers * plan.weights.per_expert
    fetched = sum(routed_experts_per_layer(plan.config, t) for t in passes) * layer_bytes
    read = routed_experts_per_layer(plan.config, prompt_tokens) * layer_bytes if experts_fit else fetched
    trunk_read = trunk_read_bytes(plan)
    memory = len(passes) * trunk_read + fetched
    return PrefillBound(
        prompt_tokens=int(prompt_tokens),
        nvme_bytes=int(round(read)),
        memory_bytes=int(round(memory)),
        nvme_seconds=read / (nvme_gbps * GB),
        memory_seconds=memory / (mem_gbps * GB),
    )


@dataclass(frozen=True)
class RunPrediction:
    """What `waste plan TARGET --ram R` predicts for a `waste run` on a machine with R available:
    the run's own memory plan (`waste.engine.memory.plan_memory`, the arithmetic `waste run`
    uses), the hit rate its expert cache reaches, the decode bound at that hit rate and the bound
    of the prompt's prefill from a cold cache."""

    memory: Any  # waste.engine.memory.MemoryPlan
    decode_tokens: int
    cached_experts: int
    total_experts: int
    hit_rate: float
    hit_rate_source: str
    bound: DecodeBound
    bandwidths: Any  # waste.analysis.machine.Bandwidths
    prefill: PrefillBound
    compute: Any = None  # waste.analysis.compute.DecodeCompute: a decode step's compute, measured

    @property
    def unused_guess_bytes(self) -> float:
        """Bytes a decode step reads ahead for nothing in the estimate: the experts the measured
        step guessed and their layer did not ask for, each read when not cached (1 - hit rate)."""
        if self.compute is None:
            return 0.0
        expert_bytes = self.memory.experts_total / max(1, self.total_experts)  # an expert's blob, on average
        return self.compute.unused_guesses * (1.0 - self.hit_rate) * expert_bytes

    @property
    def estimate_disk_seconds(self) -> float:
        """The disk's time for a step's reads in the decode estimate, its misses and its unused
        guesses (`unused_guess_bytes`): at the speed the compute measurement's random blob reads
        reached (a step's reads), else at the disk bandwidth."""
        gbps = self.bandwidths.disk.gbps if self.compute is None or self.compute.blob_gbps is None \
            else self.compute.blob_gbps
        return (self.bound.nvme_bytes + self.unused_guess_bytes) / (gbps * GB)

    @property
    def decode_estimate(self) -> tuple[float, float] | None:
        """(overlapped, serial) decode tok/s from the measured compute step: the disk's reads of the
        misses and unused guesses under the step's compute, or after it; None when the compute was
        not measured. A run's step also spends CPU on its reads and waits for the misses no guess
        read ahead, so it falls between the two."""
        if self.compute is None:
            return None
        step, disk = self.compute.step_seconds, self.estimate_disk_seconds
        return 1.0 / max(step, disk), 1.0 / (step + disk)

    @property
    def fits(self) -> bool:
        """Whether the resident part fits at all (else the run swaps or is killed)."""
        m = self.memory
        return m.resident <= m.available - m.headroom

    def as_dict(self) -> dict[str, Any]:
        estimate = self.decode_estimate
        return {"memory_plan": self.memory.as_dict(), "fits": self.fits, "decode_tokens": self.decode_tokens,
                "cached_experts": self.cached_experts,
                "total_experts": self.total_experts, "hit_rate": self.hit_rate,
                "hit_rate_source": self.hit_rate_source, "decode_bound_tps": self.bound.tokens_per_second,
                "decode_serial_tps": self.bound.serial_tokens_per_second, "limited_by": self.bound.limited_by,
                "disk_bytes_per_token": self.bound.nvme_bytes, "memory_bytes_per_token": self.bound.memory_bytes,
                "prompt_tokens": self.prefill.prompt_tokens, "prefill_bound_tps": self.prefill.tokens_per_second,
                "prefill_disk_bytes": self.prefill.nvme_bytes, "prefill_limited_by": self.prefill.limited_by,
                "planned_peak_rss": self.memory.planned_peak, **self.bandwidths.as_dict(),
                "decode_compute": None if self.compute is None else self.compute.as_dict(),
                "decode_estimate_tps": None if estimate is None else estimate[0],
                "decode_estimate_serial_tps": None if estimate is None else estimate[1],
                "decode_estimate_unused_guess_bytes": self.unused_guess_bytes}

    def describe(self) -> str:
        from waste.units import human_bytes

        m, b, bw = self.memory, self.bound, self.bandwidths
        store = "memory map (every expert fits)" if m.experts_fit else \
            f"streaming, cache {human_bytes(m.cache_budget)} ({human_bytes(m.prefill_cache_budget)} reading a prompt)"
        lines = [
            f"waste run with {human_bytes(m.available)} available (waste/engine/memory.py, as the run plans it), "
            f"the context's last {self.decode_tokens} tokens generated",
            f"  resident {human_bytes(m.resident)}: runtime {human_bytes(m.runtime)}, trunk {human_bytes(m.trunk)}, "
            f"MLA weights {human_bytes(m.mla_weights)}, state {human_bytes(m.state)}, working "
            f"{human_bytes(m.working)} while a prompt is read ({human_bytes(m.decode_working)} decoding); "
            f"headroom {human_bytes(m.headroom)}",
        ]
        if not self.fits:
            short = m.resident - (m.available - m.headroom)
            return "\n".join([*lines, f"  does NOT fit: short by {human_bytes(short)}; no prediction"])
        lines += [
            f"  expert store: {store}: {self.cached_experts:,d} of {self.total_experts:,d} experts "
            f"({100 * self.cached_experts / max(self.total_experts, 1):.1f}%)",
            f"  hit rate {100 * self.hit_rate:.1f}% ({self.hit_rate_source})",
            f"  per token {human_bytes(b.nvme_bytes)} from disk at {bw.disk.gbps:.2f} GB/s, "
            f"{human_bytes(b.memory_bytes)} from RAM at {bw.memory.gbps:.1f} GB/s",
            f"  decode bound {b.tokens_per_second:.2f} tok/s (disk and RAM reads overlapped; "
            f"{b.serial_tokens_per_second:.2f} one after the other), limited by {b.limited_by}",
        ]
        estimate = self.decode_estimate
        if estimate is not None:
            overlapped, serial = estimate
            c = self.compute
            disk_s = self.estimate_disk_seconds
            speed = f"{overlapped:.2f}" if disk_s == 0 else f"{serial:.2f} to {overlapped:.2f}"
            speed_read = "the disk bandwidth" if c.blob_gbps is None else f"{c.blob_gbps:.2f} GB/s, random blobs read"
            guesses = f" (with {c.unused_guesses:.1f} unused guesses a step)" if c.unused_guesses and disk_s else ""
            disk = "" if disk_s == 0 else (f", the disk's {1000 * disk_s:.0f} ms at {speed_read}{guesses}, after it "
                                           "or under it")
            lines.append(f"  decode estimate {speed} tok/s: a step's compute measured at "
                         f"{1000 * c.step_seconds:.1f} ms (median of {c.steps} steps of this model, every expert it "
                         f"asks for in RAM){disk}")
        lines += [
            f"  prefill of the {self.prefill.prompt_tokens} prompt tokens from a cold cache: "
            f"{human_bytes(self.prefill.nvme_bytes)} of experts from disk, bound "
            f"{self.prefill.tokens_per_second:.1f} tok/s (compute left out), limited by {self.prefill.limited_by}",
            f"  planned peak RSS {human_bytes(m.planned_peak)}",
            f"  disk: {bw.disk.source}",
            f"  memory: {bw.memory.source}",
        ]
        return "\n".join(lines)


def trace_hit_rate(trace: Any, cache_budget: int, blob_bytes: int, policy: str = "lru") -> float:
    """The decode hit rate of `trace` (a routing trace) replayed through a cache of `cache_budget` bytes."""
    from waste.analysis.cache_sim import capacity_for_budget, simulate

    sim = simulate(trace, policy, capacity_for_budget(cache_budget, blob_bytes))
    req = trace.requests()
    decode = np.repeat(req.phase == 1, np.diff(req.start))
    if not decode.any():
        raise WasteError("the routing trace has no decode steps to take a hit rate from")
    return float(sim.hit[decode].mean())


def predict_run(plan: Plan, ram: int, bandwidths: Any, *, runtime: int, decode_tokens: int = PREDICT_DECODE_TOKENS,
                trace: Any = None, trace_name: str = "", prompt_tokens: int | None = None,
                compute: Any = None) -> RunPrediction:
    """The prediction of a run of `plan`'s model reaching `plan.context` tokens (`decode_tokens` of
    them generated, the `prompt_tokens` before them the prompt: by default the rest) on a machine
    with `ram` bytes available, the runtime (interpreter, NumPy, Numba and the kernels) taking
    `runtime`: the hit rate is the fraction of experts the cache holds (uniform routing) unless a
    routing `trace` is given, whose decode lookups are replayed through that cache (LRU). With a
    decode step's `compute` measured (`waste.analysis.compute`), it also estimates the decode."""
    from waste.engine.memory import plan_memory
    from waste.engine.model import DEFAULT_PREFILL_CHUNK, PREFILL_PASS_TOKENS

    decode_tokens = min(decode_tokens, plan.context)
    memory = plan_memory(plan.config, plan.weights, plan.context, chunk=DEFAULT_PREFILL_CHUNK,
                         pass_tokens=PREFILL_PASS_TOKENS, runtime=runtime, decode_tokens=decode_tokens, available=ram)
    total = plan.config.num_experts * plan.weights.expert_layers
    cached = total if memory.experts_fit else min(memory.cache_budget // plan.weights.per_expert, total)
    if memory.experts_fit:
        hit, source = 1.0, "every expert stays in the page cache once read"
    elif trace is not None:
        hit = trace_hit_rate(trace, memory.cache_budget, plan.weights.per_expert)
        source = f"routing trace {trace_name}: its decode lookups replayed through this cache, LRU"
    else:
        hit, source = cached / total, "uniform routing: the fraction of experts cached"
    bound = decode_speed_bound(plan, hit, bandwidths.disk.gbps, bandwidths.memory.gbps)
    prompt = max(plan.context - decode_tokens, 1) if prompt_tokens is None else prompt_tokens
    prefill = prefill_speed_bound(plan, prompt, bandwidths.disk.gbps, bandwidths.memory.gbps,
                                  experts_fit=memory.experts_fit)
    return RunPrediction(memory, decode_tokens, cached, total, hit, source, bound, bandwidths, prefill, compute)


def state_curve(cfg: ModelConfig, contexts: Sequence[int], dtype: str = "f32", *, all_mla: bool = False) -> np.ndarray:
    """Attention-side state bytes [len(contexts)] int64 at each context: the model as it is
    (KDA state + conv rings + MLA latent) or, with all_mla, every layer MLA."""
    if all_mla:
        values = [all_mla_state_bytes(cfg, int(c), dtype) for c in contexts]
    else:
        values = [state_bytes(cfg, int(c), dtype).total for c in contexts]
    return np.asarray(values, np.int64)


def crossover_context(cfg: ModelConfig, dtype: str = "f32") -> int:
    """The smallest context at which the hybrid needs less attention state than all-MLA.

    The hybrid's fixed KDA part must be paid for by the latent rows its KDA layers do not
    cache: fixed / (n_kda x latent row bytes), rounded up (plus one when it divides exactly).
    """
    fixed = state_bytes(cfg, 0, dtype).total
    per_token_saved = all_mla_state_bytes(cfg, 1, dtype) - state_bytes(cfg, 1, dtype).mla_latent
    if per_token_saved <= 0:
        raise WasteError("crossover_context: the model has no KDA layers, so nothing is saved")
    return fixed // per_token_saved + 1


def target_config(target: str) -> tuple[str, ModelConfig]:
    """(name, config) of a preset name, config.json or container path (the container is closed)."""
    from waste.plan import load_target

    name, cfg, container = load_target(str(target))
    if container is not None:
        container.close()
    return name, cfg


def state_curves(configs: dict[str, ModelConfig], contexts: Sequence[int], dtype: str = "f32") -> dict[str, np.ndarray]:
    """For each named config, the curve as it is (label: name) and with every layer MLA
    (label: "name, all MLA"); bytes per context."""
    out: dict[str, np.ndarray] = {}
    for name, cfg in configs.items():
        out[name] = state_curve(cfg, contexts, dtype)
        out[f"{name}, all MLA"] = state_curve(cfg, contexts, dtype, all_mla=True)
    return out


def budget_summary(plan: Plan, bound: DecodeBound) -> str:
    """Lines the RAM-budget control prints: cache size, experts that fit, the speed bound."""
    from waste.units import human_bytes

    total = plan.config.num_experts * plan.weights.expert_layers
    room = plan.cache_room or 0
    lines = [
        f"{plan.name}: RAM budget {human_bytes(plan.ram or 0)}, resident trunk + state {human_bytes(plan.resident)}",
        (f"expert cache {human_bytes(room)}: {plan.experts_fit:,d} of {total:,d} experts fit "
         f"({100 * cache_fraction(plan):.1f}%, the hit rate of uniform routing)") if room >= 0 else
        f"does NOT fit: short by {human_bytes(-room)}, no room for an expert cache",
        f"per token: {human_bytes(plan.touched_per_token)} of experts, {human_bytes(bound.nvme_bytes)} missed "
        f"at hit rate {bound.hit_rate:.0%}, {human_bytes(bound.memory_bytes)} read from RAM",
        f"decode bound: {bound.tokens_per_second:.2f} tok/s with NVMe and RAM reads overlapped "
        f"({bound.serial_tokens_per_second:.2f} tok/s one after the other), limited by {bound.limited_by}",
    ]
    return "\n".join(lines)


def load_scale_bench(path: str | Path) -> list[dict[str, Any]]:
    """The measured points of a `bench/scale.py` result (bench/results/scale-*.json), one per store:
    {store, preset, scheme, ram (the RAM the run planned for, bytes), cache_budget, hit_rate,
    decode_tps, prefill_tps, peak_rss, planned_peak_rss, bound_tps (at the hit rate measured),
    predicted_tps, predicted_prefill_tps and predicted_peak_rss (what `waste plan` predicts at that
    RAM, `predict_run`; None in results written before it), estimated_tps ((serial, overlapped):
    its decode estimate from the compute measured; None in results written before it)} for placing
    on a budget plot."""
    import json

    try:
        data = json.loads(Path(path).read_text())
        runs = data["runs"]
        points = []
        for r in runs:
            mp, pred = r["memory_plan"], r.get("prediction", {})
            predicted = pred.get("waste_plan") or {}
            points.append({
                "store": r["store"], "preset": data.get("preset"), "scheme": data.get("scheme"),
                "ram": mp["available"], "cache_budget": r["cache_budget"],
                "hit_rate": r["decode_hit_rate_steady"], "decode_tps": r["decode_tps_steady"],
                "prefill_tps": r["prefill_tps"], "peak_rss": r["peak_rss"],
                "planned_peak_rss": mp["planned_peak"],
                "bound_tps": pred.get("decode_bound_tps_measured_hit", pred.get("decode_bound_tps_uniform")),
                "predicted_tps": predicted.get("decode_bound_tps"),
                "predicted_prefill_tps": predicted.get("prefill_bound_tps"),
                "predicted_peak_rss": predicted.get("planned_peak_rss"),
                "estimated_tps": None if predicted.get("decode_estimate_tps") is None else
                (predicted["decode_estimate_serial_tps"], predicted["decode_estimate_tps"]),
            })
    except FileNotFoundError:
        raise WasteError(f"{path}: no such bench result (run `make bench-scale`)") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WasteError(f"{path}: not a bench/scale.py result ({e})") from None
    return points
