"""How much RAM a run may use, and which expert store follows from it.

`waste run` without `--expert-cache` plans its memory once the model is loaded and warmed up
(`measure_runtime`: a few tokens through each kind of expert store, so every kernel the run
will use is loaded or compiled), before it picks the expert store:

    budget = available RAM (MemAvailable plus the process's anonymous memory, or the cgroup's limit
             when lower) - headroom
    resident = runtime: what the process then holds besides the terms below, measured (its
               RSS less the container's mapped pages and the MLA weights): the interpreter,
               NumPy, Numba and LLVM, the compiled kernels, thread stacks
             + trunk weights (copied into memory when the model loads: Container.hold_trunk_in_memory),
               less an untied embedding, read a row at a time from the file (`resident_trunk`)
             + MLA absorbed weights (kv_b_proj widened to float32 at load)
             + session state at the run's context (KDA states and their pending updates,
               conv rings, MLA latents)
             + working buffers (one prefill pass's activations, the routed experts one
               layer of that pass holds at once, one group of the routed rows a MoE layer
               runs together, the logits rows of one chunk); while decoding, a decode
               step's instead (its misses and guesses, one token's activations and logits)
    expert cache = budget - resident

When every routed expert fits in the cache the container's memory map serves them (the
page cache holds them); otherwise the streaming store reads them into a cache of exactly
that many bytes: the decode's budget between prompts, shrunk to the prefill's while a
prompt is read (`StreamingExpertStore.prefilling`), so a decode step has the memory a
prefill pass works in (on the 48B, a layer of routed experts: about 1 GB) as cache. The run
reports the planned total next to its peak RSS. `waste plan CONTAINER --ram R` runs the same
warm-up and the same arithmetic (`plan_memory`) for a machine with R available
(`waste.analysis.budget.predict_run`).
"""

from __future__ import annotations

import mmap
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from waste.config import ModelConfig
from waste.container.reader import HUGE_PAGE
from waste.engine.experts import GUESS_LAYERS
from waste.engine.moe_layer import GROUP_ROWS, MoELayer
from waste.errors import NonFiniteError, WasteError
from waste.plan import WeightBytes, container_weight_bytes, kda_pending_bytes, row_read_bytes, state_bytes
from waste.qformat import ROWS
from waste.units import human_bytes

HEADROOM_FRACTION = 0.05  # of the available RAM, kept free for the allocator, the OS and noise
HEADROOM_MIN = 256 << 20


def _proc_bytes(path: str, key: str) -> int | None:
    """The kB figure on the line `key:` of a /proc file such as /proc/meminfo, in bytes (None if absent)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _meminfo_available() -> int | None:
    return _proc_bytes("/proc/meminfo", "MemAvailable")


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
    """Bytes this process may grow to: MemAvailable plus its own anonymous memory, or its
    cgroup's room when that is lower. (`WASTE_RAM` overrides it, e.g. 8G, for tests and
    benchmarks.) Only anonymous memory is added: the file pages the process maps (the
    container's trunk) sit in the page cache, which MemAvailable already counts, and adding
    them twice once planned a 48B run past the machine's physical RAM."""
    from waste.units import parse_size

    forced = os.environ.get("WASTE_RAM")
    if forced:
        return parse_size(forced, "WASTE_RAM")
    meminfo, cgroup = _meminfo_available(), _cgroup_room()
    found = ([] if meminfo is None else [meminfo + anonymous_rss()]) + ([] if cgroup is None else [cgroup])
    if not found:
        raise WasteError("cannot tell how much memory is available (no /proc/meminfo); give --expert-cache")
    return min(found)


def mapped_rss(fds: list[int]) -> int:
    """Resident bytes of this process's memory maps of the files open as `fds` (/proc/self/smaps)."""
    keys = set()
    for fd in fds:
        st = os.fstat(fd)
        keys.add((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
    total, counting = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
                    major, minor = head[3].split(":")
                    counting = (int(major, 16), int(minor, 16), int(head[4])) in keys
                elif counting and head[0] == "Rss:":
                    total += int(head[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


def current_rss() -> int:
    """Resident bytes of this process now."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss()


def anonymous_rss() -> int:
    """Resident anonymous bytes of this process now (RssAnon: its heap, arrays and stacks, not
    the file pages it maps)."""
    anonymous = _proc_bytes("/proc/self/status", "RssAnon")
    return current_rss() if anonymous is None else anonymous


def peak_rss() -> int:
    """The largest resident size this process has had: VmHWM, the high-water mark of its own
    memory. (ru_maxrss is no substitute: Linux carries it across exec, so a process started by
    a larger one reports its parent's size until it outgrows it.)"""
    peak = _proc_bytes("/proc/self/status", "VmHWM")
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024 if peak is None else peak


@dataclass(frozen=True)
class MemoryPlan:
    """The figures behind a run's choice of expert store (bytes)."""

    available: int
    headroom: int
    runtime: int  # what the process holds besides the terms below (measure_runtime)
    trunk: int
    mla_weights: int
    state: int
    working: int  # a prefill pass's working memory (never less than a decode step's)
    experts_total: int
    decode_working: int  # a decode step's working memory

    @property
    def resident(self) -> int:
        """What the process holds besides the expert cache while it reads a prompt."""
        return self.runtime + self.trunk + self.mla_weights + self.state + self.working

    @property
    def decode_resident(self) -> int:
        """What the process holds besides the expert cache while it decodes."""
        return self.resident - self.working + self.decode_working

    @property
    def prefill_cache_budget(self) -> int:
        """Bytes left for the expert cache while a prompt is read (0 when even the resident part does not fit)."""
        return max(0, self.available - self.headroom - self.resident)

    @property
    def cache_budget(self) -> int:
        """Bytes left for the expert cache between prompts: a decode step's working memory is
        smaller than a prefill pass's (one layer of routed experts), and the cache takes the rest."""
        return max(0, self.available - self.headroom - self.decode_resident)

    @property
    def experts_fit(self) -> bool:
        return self.experts_total <= self.prefill_cache_budget

    @property
    def planned_peak(self) -> int:
        """The RSS the run should not exceed: resident + the cache (or all experts when mapped)."""
        if self.experts_fit:
            return self.resident + self.experts_total
        return max(self.resident + self.prefill_cache_budget, self.decode_resident + self.cache_budget)

    def describe(self) -> str:
        """One line: the store chosen and why."""
        if self.experts_fit:
            return (f"expert store: memory map (all {human_bytes(self.experts_total)} of experts fit in "
                    f"{human_bytes(self.prefill_cache_budget)} = {self._why(self.resident, self.working)})")
        return (f"expert store: streaming, cache budget {human_bytes(self.cache_budget)} = "
                f"{self._why(self.decode_resident, self.decode_working)}; "
                f"{human_bytes(self.prefill_cache_budget)} while a prompt is read (working "
                f"{human_bytes(self.working)}); the experts take {human_bytes(self.experts_total)}")

    def _why(self, resident: int, working: int) -> str:
        return (f"{human_bytes(self.available)} available - {human_bytes(self.headroom)} headroom - "
                f"{human_bytes(resident)} resident (runtime {human_bytes(self.runtime)}, trunk "
                f"{human_bytes(self.trunk + self.mla_weights)}, state {human_bytes(self.state)}, working "
                f"{human_bytes(working)})")

    def as_dict(self) -> dict[str, Any]:
        return {"available": self.available, "headroom": self.headroom, "runtime": self.runtime,
                "trunk": self.trunk, "mla_weights": self.mla_weights, "state": self.state,
                "working": self.working, "decode_working": self.decode_working, "experts_total": self.experts_total,
                "resident": self.resident, "decode_resident": self.decode_resident,
                "cache_budget": self.cache_budget, "prefill_cache_budget": self.prefill_cache_budget,
                "experts_fit": self.experts_fit, "planned_peak": self.planned_peak}


def mla_weight_bytes(cfg: ModelConfig) -> int:
    """The MLA layers' kv_b_proj, widened to float32 when the model loads (absorbed attention)."""
    return len(cfg.mla_layers) * cfg.mla_num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank * 4


def measure_runtime(container: Any, *, chunk: int, router_weights: str = "unbiased") -> tuple[Any, int]:
    """(model, runtime bytes): the model over `container`, after a warm-up that loads (or compiles)
    every kernel a run uses; and what the process then holds beyond the plan's other terms: its
    RSS less the container's mapped pages and its trunk's copy in memory (the trunk term counts
    those) and the MLA weights. That is the interpreter, NumPy, Numba and LLVM, the compiled
    kernels, the threads' stacks and whatever the model keeps besides.

    The warm-up runs two prompt tokens, one decoded token (through the map twice, see below)
    and a one-token prompt through each kind of expert store, one that streams and caches
    nothing and the memory map: the run picks its store after this measurement, and their paths
    differ (fetched experts, or the map's MoE step in one call; a one-token prompt runs one-token
    products), so a kernel the warm-up had not met would be loaded or compiled beyond the plan
    (with an empty kernel cache on `tiny`, 250 MiB). The model's store is closed; give it the
    run's (`model.store = ...`)."""
    from waste.engine.experts import MmapExpertStore, StreamingExpertStore
    from waste.engine.model import LayerTimes, Model

    model = Model(container, store=StreamingExpertStore(container, 0, read_threads=1), router_weights=router_weights)
    for store in (model.store, MmapExpertStore(container)):
        model.store = store
        session = model.new_session(4)
        try:
            model.prefill(session, [0, 1], chunk=chunk, all_logits=False)
            if store.maps_every_expert:
                # The map's decode runs a MoE layer in one call when the layer's tables hold every
                # expert the step routes to (a prefill enters the ones it ran), else through the
                # path that enters them: this step meets that path (tables dropped), the same step
                # replayed in a new session, whose routing is the same, the one call.
                _drop_decode_tables(model)
                model.decode(session, 0)
                session = model.new_session(4)
                model.prefill(session, [0, 1], chunk=chunk, all_logits=False)
            model.decode(session, 0)
            model.prefill(session, [1], chunk=chunk, all_logits=False)
        except NonFiniteError as e:
            raise NonFiniteError(f"{e} (in the warm-up on token ids 0, 1 before the prompt)") from None
        finally:
            model.store.close()
    _drop_decode_tables(model)
    # The map's pass left the experts it used mapped into the process: file pages in its RSS that
    # a streaming run would carry past its plan (1.5 GB on the 48B q4). Unmapped, the page cache
    # keeps them.
    expert_bytes = container.byte_counts()["expert_bytes"]
    if expert_bytes:
        container.advise_experts(0, expert_bytes, mmap.MADV_DONTNEED)
    model.times = LayerTimes()
    runtime = (current_rss() - mapped_rss(container.data_fds()) - container.trunk_in_memory
               - mla_weight_bytes(container.config))
    return model, max(runtime, 0)


def _drop_decode_tables(model: Any) -> None:
    for ffn in model.ffn:
        if isinstance(ffn, MoELayer):
            ffn.drop_tables()


def plan_run_memory(container: Any, context: int, *, chunk: int, pass_tokens: int, runtime: int, decode_tokens: int,
                    all_logits: bool = False, available: int | None = None) -> MemoryPlan:
    """The memory plan of a run over `container` reaching `context` tokens, `decode_tokens` of them
    generated (see the module doc)."""
    return plan_memory(container.config, container_weight_bytes(container), context, chunk=chunk,
                       pass_tokens=pass_tokens, runtime=runtime, decode_tokens=decode_tokens, all_logits=all_logits,
                       available=available)


def resident_trunk(cfg: ModelConfig, weights: WeightBytes, tokens: int) -> int:
    """The trunk bytes a run whose passes take up to `tokens` tokens holds: all of them, but of an
    untied embedding (`row_read_bytes`, read from the file: `waste.container.rows.FileRows`) only
    the huge pages at its two ends, which the copy in memory keeps, and what one pass reads of it:
    a row block of ROWS rows per token (the q formats' interleave), at most."""
    row_read = row_read_bytes(cfg, weights)
    if not row_read:
        return weights.trunk
    one_pass = min(row_read, max(tokens, 1) * ROWS * row_read // cfg.vocab_size)
    return min(weights.trunk, weights.trunk - row_read + 2 * HUGE_PAGE + one_pass)


def plan_memory(cfg: ModelConfig, weights: WeightBytes, context: int, *, chunk: int, pass_tokens: int, runtime: int,
                decode_tokens: int, all_logits: bool = False, available: int | None = None) -> MemoryPlan:
    """The memory plan of a run of a model with these weights (`waste.plan`'s figures) reaching
    `context` tokens, `decode_tokens` of them generated: the one place its arithmetic lives, for
    `waste run` and for `waste plan`'s prediction."""
    avail = available_memory() if available is None else int(available)
    headroom = max(HEADROOM_MIN, int(HEADROOM_FRACTION * avail))
    mla_weights = mla_weight_bytes(cfg)
    widest = max(cfg.intermediate_size, cfg.num_experts_per_token * cfg.moe_intermediate_size,
                 cfg.mla_num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.kv_lora_rank),
                 3 * cfg.kda_proj_size)
    per_layer = min(cfg.num_experts, cfg.num_experts_per_token)
    expert_in = cfg.routed_expert_hidden_size or cfg.hidden_size
    prompt_rows = max(context - decode_tokens, 1) if all_logits else 1

    def working(tokens: int, experts: int) -> int:
        """The working memory of a pass of `tokens` tokens whose MoE layers hold `experts` routed experts."""
        # The pass's residual stream, normalised copy and FFN output, plus its widest intermediate,
        # each float32; the experts it holds; one chunk's logits (twice: the product and its copy
        # into the output); and the logits rows the run keeps: one per generated token, and every
        # prompt row's with `all_logits` (else the last one's).
        activations = 4 * tokens * (4 * cfg.hidden_size + 2 * widest)
        # A prefill's group of routed rows (`waste.engine.moe_layer.GROUP_ROWS`): their inputs, gate
        # and up products (and their unpadded copies), activations and outputs, float32.
        group_rows = min(tokens * cfg.num_experts_per_token, GROUP_ROWS)
        grouped = 4 * group_rows * (2 * expert_in + 5 * cfg.moe_intermediate_size) if cfg.num_experts else 0
        logits = 4 * cfg.vocab_size * (2 * min(chunk, tokens) + prompt_rows + decode_tokens)
        return activations + experts * weights.per_expert + grouped + logits

    # A decode step holds its own misses and the guesses of the GUESS_LAYERS MoE layers after it
    # (`waste.engine.experts`); a prefill pass one MoE layer's routed experts, up to all of them
    # (counted as no fewer than a decode step's, so the prefill's working memory is the larger).
    decode_held = (1 + GUESS_LAYERS) * per_layer
    tokens = min(max(context, 1), pass_tokens)
    prefill_held = max(min(cfg.num_experts, tokens * cfg.num_experts_per_token), decode_held)
    return MemoryPlan(
        available=avail,
        headroom=headroom,
        runtime=int(runtime),
        trunk=resident_trunk(cfg, weights, tokens),
        mla_weights=mla_weights,
        state=state_bytes(cfg, context).total + kda_pending_bytes(cfg),
        working=max(working(tokens, prefill_held), working(1, decode_held)),
        experts_total=weights.experts_total,
        decode_working=working(1, decode_held),
    )
