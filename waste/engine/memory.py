"""How much RAM a run may use, and which expert store follows from it.

`waste run` without `--expert-cache` plans its memory before loading the model:

    budget = available RAM (MemAvailable, or the cgroup's limit when lower) - headroom
    resident = what the process already holds (interpreter, NumPy, Numba, the open container)
             + trunk weights (mapped, all touched by a run)
             + MLA absorbed weights (kv_b_proj widened to float32 at load)
             + session state at the run's context (KDA states, conv rings, MLA latents)
             + working buffers (one prefill pass's activations, the routed experts one
               layer of that pass holds at once, the logits rows of one chunk)
    expert cache = budget - resident

When every routed expert fits in the cache the container's memory map serves them (the
page cache holds them); otherwise the streaming store reads them into a cache of exactly
that many bytes. The run reports the planned total next to its peak RSS.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from waste.errors import WasteError
from waste.plan import state_bytes
from waste.units import human_bytes

HEADROOM_FRACTION = 0.05  # of the available RAM, kept free for the allocator, the OS and noise
HEADROOM_MIN = 256 << 20


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), when a limit is set."""
    try:
        rel = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::"))
        base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((base / "memory.current").read_text()) + current_rss()
    except (OSError, ValueError, StopIteration):
        return None


def available_memory() -> int:
    """Bytes this process may grow to: MemAvailable plus what it holds now, or its cgroup's
    room when that is lower. (`WASTE_RAM` overrides it, e.g. 8G, for tests and benchmarks.)"""
    from waste.units import parse_size

    forced = os.environ.get("WASTE_RAM")
    if forced:
        return parse_size(forced, "WASTE_RAM")
    meminfo, cgroup = _meminfo_available(), _cgroup_room()
    found = ([] if meminfo is None else [meminfo + current_rss()]) + ([] if cgroup is None else [cgroup])
    if not found:
        raise WasteError("cannot tell how much memory is available (no /proc/meminfo); give --expert-cache")
    return min(found)


def current_rss() -> int:
    """Resident bytes of this process now."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss()


def peak_rss() -> int:
    """The largest resident size this process has had (ru_maxrss, KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass(frozen=True)
class MemoryPlan:
    """The figures behind a run's choice of expert store (bytes)."""

    available: int
    headroom: int
    runtime: int  # resident before the model loads
    trunk: int
    mla_weights: int
    state: int
    working: int
    experts_total: int

    @property
    def resident(self) -> int:
        return self.runtime + self.trunk + self.mla_weights + self.state + self.working

    @property
    def cache_budget(self) -> int:
        """Bytes left for the expert cache (0 when even the resident part does not fit)."""
        return max(0, self.available - self.headroom - self.resident)

    @property
    def experts_fit(self) -> bool:
        return self.experts_total <= self.cache_budget

    @property
    def planned_peak(self) -> int:
        """The RSS the run should not exceed: resident + the cache (or all experts when mapped)."""
        return self.resident + (self.experts_total if self.experts_fit else self.cache_budget)

    def describe(self) -> str:
        """One line: the store chosen and why."""
        why = (f"{human_bytes(self.available)} available - {human_bytes(self.headroom)} headroom - "
               f"{human_bytes(self.resident)} resident (runtime {human_bytes(self.runtime)}, trunk "
               f"{human_bytes(self.trunk + self.mla_weights)}, state {human_bytes(self.state)}, working "
               f"{human_bytes(self.working)})")
        if self.experts_fit:
            return (f"expert store: memory map (all {human_bytes(self.experts_total)} of experts fit in "
                    f"{human_bytes(self.cache_budget)} = {why})")
        return (f"expert store: streaming, cache budget {human_bytes(self.cache_budget)} = {why}; "
                f"the experts take {human_bytes(self.experts_total)}")

    def as_dict(self) -> dict[str, Any]:
        return {"available": self.available, "headroom": self.headroom, "runtime": self.runtime,
                "trunk": self.trunk, "mla_weights": self.mla_weights, "state": self.state,
                "working": self.working, "experts_total": self.experts_total, "resident": self.resident,
                "cache_budget": self.cache_budget, "experts_fit": self.experts_fit,
                "planned_peak": self.planned_peak}


def plan_run_memory(container: Any, context: int, *, chunk: int, pass_tokens: int, all_logits: bool = False,
                    available: int | None = None, runtime: int | None = None) -> MemoryPlan:
    """The memory plan of a run over `container` reaching `context` tokens (see the module doc)."""
    cfg = container.config
    counts = container.byte_counts()
    avail = available_memory() if available is None else int(available)
    headroom = max(HEADROOM_MIN, int(HEADROOM_FRACTION * avail))
    mla_weights = len(cfg.mla_layers) * cfg.mla_num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) \
        * cfg.kv_lora_rank * 4
    tokens = min(max(context, 1), pass_tokens)
    widest = max(cfg.intermediate_size, cfg.num_experts_per_token * cfg.moe_intermediate_size,
                 cfg.mla_num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.kv_lora_rank),
                 3 * cfg.kda_proj_size)
    # A pass's residual stream, normalised copy and FFN output, plus its widest intermediate,
    # each float32; the experts one MoE layer of the pass holds; one chunk's logits (twice:
    # the product and its copy into the output), and every prompt row's with `all_logits`.
    activations = 4 * tokens * (4 * cfg.hidden_size + 2 * widest)
    experts_held = min(cfg.num_experts, tokens * cfg.num_experts_per_token) * int(counts["expert_blob_bytes"])
    logits = 4 * cfg.vocab_size * (2 * min(chunk, tokens) + (context if all_logits else 0))
    return MemoryPlan(
        available=avail,
        headroom=headroom,
        runtime=current_rss() if runtime is None else int(runtime),
        trunk=int(counts["trunk_bytes"]),
        mla_weights=mla_weights,
        state=state_bytes(cfg, context).total,
        working=activations + experts_held + logits,
        experts_total=int(counts["expert_bytes"]),
    )
