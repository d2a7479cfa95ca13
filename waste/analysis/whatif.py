"""The memory_planning notebook's what-if: a RAM budget, the cache it buys, and the decode bound.

A RAM budget pays first for what must stay resident (trunk weights and session state); what
is left holds whole routed experts, and under routing that spreads evenly over the experts the
hit rate equals the fraction of experts cached. `what_if` takes that hit rate unless the user
sets one, prices a decoded token three ways (RAM traffic, NVMe reads of the missed experts,
arithmetic at a measured multiply rate; see `waste.analysis.budget`), and names the term that
binds. A plan whose resident part does not fit the budget has no bound: `WhatIf.fits` is False
and `describe` says by how much it misses.

`measured_points` reads what bench/engine.py, bench/streaming.py and bench/scale.py wrote
(bench/results/*.json) and places each run at the RAM it used and the speed it reached.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from waste.analysis.budget import DecodeBound, cache_fraction, decode_speed_bound, load_scale_bench
from waste.container.format import expected_expert_tensors, expected_tensors
from waste.errors import WasteError
from waste.plan import Plan
from waste.units import human_bytes

TERM_WORDS = {
    "memory": "RAM bandwidth: the trunk, the state and every expert the token uses pass through the cores",
    "nvme": "disk: reading the experts the cache misses",
    "compute": "compute: the multiply-adds of the weights the token uses",
}


def multiply_adds_per_token(plan: Plan) -> int:
    """Weights one decoded token multiplies by: every trunk matrix except the embedding table
    (one row is read, not multiplied; with tied embeddings the lm_head multiplies by it) plus
    top-k routed experts in every MoE layer."""
    cfg = plan.config
    embed = "model.embed_tokens.weight"
    trunk = sum(math.prod(s) for n, s in expected_tensors(cfg).items()
                if len(s) == 2 and n.endswith(".weight") and (n != embed or cfg.tie_word_embeddings))
    expert = sum(math.prod(s) for s in expected_expert_tensors(cfg).values())
    return int(trunk + cfg.num_experts_per_token * plan.weights.expert_layers * expert)


def compute_rate(seconds: float = 0.3) -> float:
    """This machine's float32 multiply-add rate in GMAC/s: a [64, 1024] x [1024, 1024] product
    repeated for about `seconds`, best round (as BLAS runs under waste: one thread)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 1024), dtype=np.float32)
    b = rng.standard_normal((1024, 1024), dtype=np.float32)
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end or best == float("inf"):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 64 * 1024 * 1024 / best / 1e9


@dataclass(frozen=True)
class WhatIf:
    """One point of the what-if: the plan under a budget, the hit rate used and the bound."""

    plan: Plan
    hit_rate: float
    hit_rate_from_cache: bool  # True: follows the cache the budget buys; False: set by the user
    bound: DecodeBound | None  # None when the plan does not fit
    compute_seconds: float

    @property
    def fits(self) -> bool:
        return self.bound is not None

    @property
    def seconds(self) -> dict[str, float]:
        """Time per token of each term (RAM, disk, compute)."""
        b = self.bound
        if b is None:
            return {}
        return {"memory": b.memory_seconds, "nvme": b.nvme_seconds, "compute": self.compute_seconds}

    @property
    def binding(self) -> str | None:
        """The term that takes longest: "memory", "nvme" or "compute" (None when it does not fit)."""
        s = self.seconds
        return max(s, key=s.get) if s else None  # type: ignore[arg-type]

    @property
    def tokens_per_second(self) -> float:
        """The bound with the three terms overlapped (NaN when the plan does not fit)."""
        return 1.0 / max(self.seconds.values()) if self.fits else float("nan")

    def describe(self) -> str:
        """What the user reads under the controls, in words."""
        p = self.plan
        total = p.config.num_experts * p.weights.expert_layers
        head = f"{p.name}: RAM budget {human_bytes(p.ram or 0)}, resident trunk + state {human_bytes(p.resident)}"
        if not self.fits:
            return (f"{head}\nDOES NOT FIT: the resident part alone is {human_bytes(p.resident - (p.ram or 0))} over "
                    f"the budget, so there is no decode bound. Raise the RAM budget or pick a smaller scheme.")
        source = "follows the cache this budget buys" if self.hit_rate_from_cache else "set by hand, not by the budget"
        s = self.seconds
        ranked = sorted(s, key=s.get, reverse=True)  # type: ignore[arg-type]
        second = ranked[1]
        lines = [
            head,
            f"expert cache {human_bytes(p.cache_room or 0)}: {p.experts_fit:,d} of {total:,d} experts "
            f"({100 * cache_fraction(p):.1f}%)",
            f"hit rate {self.hit_rate:.0%} ({source}); per token {human_bytes(self.bound.nvme_bytes)} read from disk, "
            f"{human_bytes(self.bound.memory_bytes)} from RAM",
            f"per token: RAM {1e3 * s['memory']:.2f} ms, disk {1e3 * s['nvme']:.2f} ms, compute "
            f"{1e3 * s['compute']:.2f} ms",
            f"decode bound {self.tokens_per_second:.2f} tok/s, bound by {TERM_WORDS[ranked[0]]}. "
            f"The next term, {second}, would allow {1 / s[second]:.2f} tok/s.",
        ]
        return "\n".join(lines)


def what_if(plan: Plan, *, nvme_gbps: float, mem_gbps: float, gmacs: float, hit_rate: float | None = None) -> WhatIf:
    """The bound of `plan` (made with a RAM budget) at `hit_rate`, or at the hit rate of the cache
    the budget buys when `hit_rate` is None; rates in GB/s and GMAC/s."""
    fits = (plan.cache_room or 0) >= 0
    rate = cache_fraction(plan) if hit_rate is None else float(hit_rate)
    compute = multiply_adds_per_token(plan) / (gmacs * 1e9)
    bound = decode_speed_bound(plan, rate, nvme_gbps, mem_gbps) if fits else None
    return WhatIf(plan, rate, hit_rate is None, bound, compute)


def curve_over_ram(make: Any, rams: Sequence[int], **rates: float) -> tuple[np.ndarray, np.ndarray]:
    """(bound tok/s [N], hit rate [N]) at each RAM budget, the hit rate following the cache;
    NaN where the plan does not fit. `make(ram)` returns the plan at that budget."""
    points = [what_if(make(int(r)), **rates) for r in rams]
    return (np.array([p.tokens_per_second for p in points]),
            np.array([p.hit_rate if p.fits else np.nan for p in points]))


def curve_over_hit_rate(plan: Plan, hit_rates: Sequence[float], **rates: float) -> np.ndarray:
    """Bound tok/s [N] of one plan at each hit rate (NaN everywhere when it does not fit)."""
    return np.array([what_if(plan, hit_rate=h, **rates).tokens_per_second for h in hit_rates])


@dataclass(frozen=True)
class MeasuredPoint:
    """One benchmark run placed on the what-if plots."""

    label: str
    preset: str
    scheme: str
    ram_bytes: int | None  # resident + expert cache the run used (None: everything mapped)
    hit_rate: float | None
    tokens_per_second: float
    predicted_tps: float | None = None  # what `waste plan` predicts for the same RAM (bench/scale.py)
    estimated_tps: tuple[float, float] | None = None  # and its decode estimate (serial, overlapped)


def measured_points(results_dir: str | Path, resident: dict[str, int] | None = None) -> list[MeasuredPoint]:
    """Decode speeds measured by bench/engine.py (every expert in RAM), bench/streaming.py (an
    expert cache of a given budget) and bench/scale.py, from the JSON they wrote in `results_dir`;
    [] when there is none. `resident` maps "preset/scheme" to the resident bytes a cache budget
    sits on top of (the plan's), to place the streaming runs at their whole RAM. A bench/scale.py
    run sits at the RAM it planned with, beside what `waste plan` predicts for that RAM."""
    results_dir = Path(results_dir)
    out: list[MeasuredPoint] = []
    # A result file another version of the bench wrote (fields renamed or missing) places no point.
    try:
        engine = _read(results_dir / "engine.json")
        points = []
        for run in engine.get("runs", []):
            # Each run names its preset (mini and k3-mini share one file); older files named one for all.
            preset = run.get("preset", engine.get("preset", "mini"))
            points.append(MeasuredPoint(f"bench/engine.py {run['scheme']}", preset, run["scheme"], None, 1.0,
                                        float(run["decode_tps"])))
        out += points
    except (KeyError, TypeError, ValueError, AttributeError):
        pass
    try:
        streaming = _read(results_dir / "streaming.json")
        base = (resident or {}).get(f"{streaming.get('preset')}/{streaming.get('scheme')}")
        points = []
        for b in streaming.get("budgets", []):
            ram = None if base is None else base + int(b["budget_bytes"])
            points.append(MeasuredPoint(f"bench/streaming.py {100 * b['budget_fraction']:g}% cache",
                                        streaming["preset"], streaming["scheme"], ram, b.get("decode_hit_rate"),
                                        float(b["decode_tps"])))
        out += points
    except (KeyError, TypeError, ValueError, AttributeError):
        pass
    for path in sorted(results_dir.glob("scale-*.json")):
        try:
            scale = load_scale_bench(path)
        except WasteError:
            continue  # like the files above: a result that cannot be read places no point
        for p in scale:
            out.append(MeasuredPoint(f"bench/scale.py {p['store']}", str(p["preset"]), str(p["scheme"]),
                                     int(p["ram"]), p["hit_rate"], float(p["decode_tps"]),
                                     None if p["predicted_tps"] is None else float(p["predicted_tps"]),
                                     p["estimated_tps"]))
    return out


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def plot_what_if(rams: Sequence[int], over_ram: tuple[np.ndarray, np.ndarray], hit_rates: Sequence[float],
                 over_hit: np.ndarray, current: WhatIf, measured: Sequence[MeasuredPoint] = ()) -> Figure:
    """Left: the bound and the hit rate against the RAM budget (the part that does not fit
    shaded); right: the bound against the hit rate at the chosen budget. The chosen point is
    marked on both, measured runs as crosses."""
    fig = Figure(figsize=(12, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    x = np.asarray(rams, np.float64) / 2**30
    tps, hit = over_ram
    left.plot(x, tps, color="#1f77b4", label="decode bound (hit rate follows the cache)")
    missing = ~np.isfinite(tps)
    if missing.any():
        left.axvspan(x[missing].min(), x[missing].max(), color="#d62728", alpha=0.12, label="does not fit")
    twin = left.twinx()
    twin.plot(x, hit, color="#2ca02c", linestyle="--", label="hit rate the cache buys")
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("hit rate (fraction of expert lookups)")
    ram_now = (current.plan.ram or 0) / 2**30
    if current.fits:
        left.plot([ram_now], [current.tokens_per_second], "o", color="black", label="chosen")
    for m in measured:
        if m.ram_bytes is None:
            continue
        (mark,) = left.plot([m.ram_bytes / 2**30], [m.tokens_per_second], "x", markersize=9, label=m.label)
        if m.predicted_tps is not None:
            # `waste plan`'s prediction for the RAM this run had, joined to what the run reached.
            left.plot([m.ram_bytes / 2**30] * 2, [m.tokens_per_second, m.predicted_tps], ":", color=mark.get_color())
            left.plot([m.ram_bytes / 2**30], [m.predicted_tps], "^", color=mark.get_color(), markersize=8,
                      label=f"waste plan's bound at {m.label.removeprefix('bench/scale.py ')}'s RAM")
        if m.estimated_tps is not None:
            left.plot([m.ram_bytes / 2**30] * 2, list(m.estimated_tps), "_-", color=mark.get_color(), linewidth=3,
                      markersize=12, alpha=0.5,
                      label=f"waste plan's estimate at {m.label.removeprefix('bench/scale.py ')}'s RAM")
    left.set_xscale("log", base=2)
    left.set_xlabel("RAM budget (GiB, log scale)")
    left.set_ylabel("decode bound (tokens/s)")
    left.set_title(f"{current.plan.name}: bound against the RAM budget")
    handles = left.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    left.legend(handles=handles, fontsize="small", loc="upper left")
    right.plot(hit_rates, over_hit, color="#1f77b4", label=f"bound at {ram_now:g} GiB")
    if current.fits:
        right.plot([current.hit_rate], [current.tokens_per_second], "o", color="black", label="chosen")
    for m in measured:
        if m.hit_rate is not None:
            right.plot([m.hit_rate], [m.tokens_per_second], "x", markersize=9, label=m.label)
    right.set_xlim(0, 1)
    right.set_xlabel("expert-cache hit rate")
    right.set_ylabel("decode bound (tokens/s)")
    right.set_title("bound against the hit rate" + ("" if current.fits else " (does not fit: no bound)"))
    right.legend(fontsize="small")
    return fig


# The NVMe read bandwidth the panel starts at: a PCIe 4.0 x4 drive's sequential reads.
DEFAULT_NVME_GBPS = 7.0


class WhatIfPanel:
    """The memory_planning controls: model, RAM budget, bandwidths, compute rate, and a hit rate
    that follows the budget unless "set the hit rate by hand" is ticked. `update()` is the
    callback every control runs; `result` is the point it last drew."""

    def __init__(self, targets: dict[str, str], make: Any, *, ram_gib: float, mem_gbps: float, gmacs: float,
                 measured: Sequence[MeasuredPoint] = ()):
        import ipywidgets as w

        self.make, self.measured = make, list(measured)
        self.target = w.Dropdown(options=list(targets.items()), description="model")
        self.ram = w.FloatLogSlider(value=ram_gib, base=2, min=-4, max=10, step=0.25, continuous_update=False,
                                    description="RAM (GiB)", readout_format=".3g")
        self.nvme = w.FloatText(value=DEFAULT_NVME_GBPS, description="NVMe (GB/s)")
        self.mem = w.FloatText(value=round(mem_gbps, 1), description="RAM (GB/s)")
        self.gmacs = w.FloatText(value=round(gmacs, 1), description="GMAC/s")
        self.manual = w.Checkbox(value=False, description="set the hit rate by hand")
        self.hit = w.FloatSlider(value=0.5, min=0, max=1, step=0.01, continuous_update=False, description="hit rate",
                                 disabled=True)
        self.text = w.Output()
        self.out = w.Output()
        self.result: WhatIf | None = None
        self.figure: Figure | None = None
        self._updating = False
        for c in (self.target, self.ram, self.nvme, self.mem, self.gmacs, self.manual, self.hit):
            c.observe(lambda _: self.update(), names="value")
        self.update()

    def widget(self) -> Any:
        import ipywidgets as w

        return w.VBox([w.HBox([self.target, self.ram]), w.HBox([self.nvme, self.mem, self.gmacs]),
                       w.HBox([self.manual, self.hit]), self.text, self.out])

    def update(self) -> None:
        """Recompute the plan and bound for the controls' values and redraw in place."""
        if self._updating:
            return
        self._updating = True
        try:
            self._update()
        finally:
            self._updating = False

    def _update(self) -> None:
        from waste.analysis.widgets import redraw

        self.hit.disabled = not self.manual.value
        target = self.target.value
        rates = {"nvme_gbps": self.nvme.value, "mem_gbps": self.mem.value, "gmacs": self.gmacs.value}
        if min(rates.values()) <= 0:
            redraw(self.text, lambda: print("bandwidths and the compute rate must be positive"))
            return
        plan = self.make(target, int(self.ram.value * 2**30))
        self.result = what_if(plan, hit_rate=self.hit.value if self.manual.value else None, **rates)
        if not self.manual.value:
            self.hit.value = round(self.result.hit_rate, 2) if self.result.fits else 0.0
        whole = plan.resident + plan.weights.experts_total
        rams = np.geomspace(max(plan.resident / 2, 2**20), 2 * whole, 41).astype(np.int64).tolist()
        over_ram = curve_over_ram(lambda r: self.make(target, r), rams, **rates)
        hit_rates = np.linspace(0, 1, 41)
        over_hit = curve_over_hit_rate(plan, hit_rates, **rates)
        name = plan.name
        points = [m for m in self.measured if m.preset == name.split(" ")[0] and m.scheme == plan.scheme]
        self.figure = plot_what_if(rams, over_ram, hit_rates, over_hit, self.result, points)
        text = self.result.describe()

        def draw() -> None:
            from IPython.display import display

            display(self.figure)

        redraw(self.text, lambda: print(text))
        redraw(self.out, draw)
