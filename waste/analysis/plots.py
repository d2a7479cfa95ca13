"""Figures for the notebooks. Each function takes plain data (numbers, arrays, dicts), draws
one figure with a title and axes labelled with units, and returns the matplotlib Figure
(built without pyplot, so nothing is shown or kept alive behind the caller's back).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from waste.units import human_bytes, human_count

_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
_PART_COLORS = {
    "kda_state": "#1f77b4",
    "conv_rings": "#aec7e8",
    "mla_latent": "#ff7f0e",
    "trunk": "#2ca02c",
    "row_read": "#98df8a",
    "experts": "#9467bd",
    "expert_cache": "#c5b0d5",
    "free": "#eeeeee",
}
KIND_COLORS = {"kda": "#1f77b4", "mla": "#ff7f0e"}


def byte_unit(n: float) -> tuple[str, int]:
    """The binary unit (name, size) that shows `n` bytes as a number of at least 1."""
    for name, size in _UNITS:
        if abs(n) >= size:
            return name, size
    return "B", 1


def plot_stacked_bytes(
    rows: Mapping[str, Mapping[str, int]],
    labels: Mapping[str, str],
    *,
    title: str,
    limits: Mapping[str, int] | None = None,
) -> Figure:
    """One horizontal stacked bar per row (rows: name -> {part: bytes}), each on its own
    axis in the binary unit that suits it; `limits` draws a dashed line per row (a RAM budget).
    Parts with negative bytes are left out of the bar."""
    fig = Figure(figsize=(9, 1.3 + 1.1 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), 1, squeeze=False)[:, 0]
    for ax, (name, parts) in zip(axes, rows.items(), strict=True):
        top = max(sum(max(v, 0) for v in parts.values()), (limits or {}).get(name, 0))
        unit, size = byte_unit(top)
        left = 0.0
        for part, nbytes in parts.items():
            if nbytes <= 0:
                continue
            ax.barh([0], [nbytes / size], left=left, color=_PART_COLORS.get(part), edgecolor="white",
                    label=labels.get(part, part))
            left += nbytes / size
        if limits and name in limits:
            ax.axvline(limits[name] / size, color="black", linestyle="--", label="RAM budget")
        ax.set_yticks([0], [name])
        ax.set_xlim(0, top / size * 1.02 if top else 1)
        ax.set_xlabel(f"bytes ({unit})")
    handles: dict[str, object] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center", ncols=min(len(handles), 4))
    fig.suptitle(title)
    return fig


def plot_state_curves(
    contexts: Sequence[int],
    curves: Mapping[str, np.ndarray],
    *,
    title: str,
    marks: Sequence[int] = (),
    styles: Mapping[str, Mapping[str, object]] | None = None,
) -> Figure:
    """Log-log bytes against context: curves label -> bytes [len(contexts)]; a dotted
    vertical line at each context in `marks`. Curves "NAME" and "NAME, all MLA" (as
    budget.state_curves names them) share a colour, the all-MLA one dashed; `styles`
    overrides per label."""
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    x = np.asarray(contexts, np.float64)
    colors: dict[str, str] = {}
    for label, y in curves.items():
        base = label.removesuffix(", all MLA")
        colors.setdefault(base, f"C{len(colors)}")
        style = {"color": colors[base], "linestyle": "--" if base != label else "-"}
        style.update((styles or {}).get(label, {}))
        ax.loglog(x, np.asarray(y, np.float64) / (1 << 20), label=label, **style)
    for m in marks:
        ax.axvline(m, color="grey", linestyle=":", linewidth=1)
        ax.annotate(human_count(int(m)), (m, 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", color="grey")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("attention-side state (MiB)")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right")
    return fig


def plot_heatmap(
    matrix: np.ndarray,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    colorbar: str,
    row_labels: Sequence[object] | None = None,
) -> Figure:
    """A matrix [rows, cols] as an image with a colour bar."""
    m = np.asarray(matrix, np.float64)
    fig = Figure(figsize=(9, 1.8 + 0.3 * m.shape[0]), layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis")
    if row_labels is not None:
        ax.set_yticks(range(len(row_labels)), [str(r) for r in row_labels])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label=colorbar)
    return fig


def plot_histograms(
    samples: Mapping[str, np.ndarray],
    *,
    title: str,
    xlabel: str,
    ylabel: str = "count (occurrences)",
    bins: int | np.ndarray = 30,
    logx: bool = False,
) -> Figure:
    """Overlaid step histograms of several samples (label -> values); log-spaced bins with logx."""
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    finite = [np.asarray(v, np.float64)[np.isfinite(v)] for v in samples.values()]
    allv = np.concatenate(finite) if finite else np.zeros(0)
    if logx and np.isscalar(bins) and allv.size:
        lo, hi = max(allv[allv > 0].min(initial=1.0), 1e-12), max(allv.max(), 1.0)
        bins = np.geomspace(lo, hi * 1.0001, int(bins) + 1)
        ax.set_xscale("log")
    for (label, _), v in zip(samples.items(), finite, strict=True):
        ax.hist(v, bins=bins, histtype="step", linewidth=1.5, label=f"{label} ({v.size})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if samples:
        ax.legend()
    return fig


def plot_lines(
    x: Sequence[float],
    ys: Mapping[str, np.ndarray],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    ylim: tuple[float, float] | None = None,
    points: Mapping[str, tuple[float, float]] | None = None,
) -> Figure:
    """Several series over one x axis, with markers (label -> values [len(x)]); `points`
    adds single labelled crosses (label -> (x, y)), e.g. a measured value on a simulated curve."""
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    for label, y in ys.items():
        ax.plot(x, y, marker="o", markersize=3, label=label)
    for label, (px, py) in (points or {}).items():
        ax.plot([px], [py], "kx", markersize=10, markeredgewidth=2, label=label)
    if logx:
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(x), [f"{v:g}" for v in x])
        ax.minorticks_off()
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def plot_layer_errors(errors: Sequence[float], kinds: Sequence[str], *, tolerance: float, title: str) -> Figure:
    """Relative error per layer as bars coloured by layer kind, log scale, tolerance line."""
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    e = np.maximum(np.asarray(errors, np.float64), 1e-18)
    for kind in dict.fromkeys(kinds):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        ax.bar(idx, e[idx], color=KIND_COLORS.get(kind, "#7f7f7f"), label=kind.upper())
    ax.axhline(tolerance, color="red", linestyle="--", label=f"tolerance {tolerance:.0e}")
    ax.set_yscale("log")
    ax.set_xticks(range(len(kinds)))
    ax.set_xlabel("layer (0-based)")
    ax.set_ylabel("relative L2 error of the hidden state (unitless)")
    ax.set_title(title)
    ax.legend()
    return fig


def plot_position_errors(errors: Sequence[float], prompt_len: int, *, tolerance: float, title: str) -> Figure:
    """Relative error per position, log scale: prefill positions and decode positions in two
    colours, a line at the boundary and the tolerance line."""
    fig = Figure(figsize=(8, 3.6), layout="constrained")
    ax = fig.subplots()
    e = np.maximum(np.asarray(errors, np.float64), 1e-18)
    pos = np.arange(e.size)
    ax.bar(pos[:prompt_len], e[:prompt_len], color="#7f7f7f", label="prefill (chunked)")
    ax.bar(pos[prompt_len:], e[prompt_len:], color="#2ca02c", label="decode (one token per step)")
    ax.axvline(prompt_len - 0.5, color="black", linewidth=1)
    ax.axhline(tolerance, color="red", linestyle="--", label=f"tolerance {tolerance:.0e}")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("position (prompt, then generated)")
    ax.set_ylabel("worst layer's relative L2 error")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return fig


def plot_golden_errors(agreements: Sequence, *, engine_bound: float, oracle_bound: float) -> Figure:
    """Each golden's relative L2 of the logits (`waste.analysis.goldens.GoldenAgreement`s): the
    engine's prompt, the oracle's prompt and the engine's decode steps as bars (a golden with no
    decode steps has no bar there), with each side's bound."""
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    ax = fig.subplots()
    series = (("engine, prompt", [a.prompt_error for a in agreements]),
              ("oracle, prompt", [np.nan if a.oracle_error is None else a.oracle_error for a in agreements]),
              ("engine, decode", [np.nan if a.decode_error is None else a.decode_error for a in agreements]))
    for i, (name, values) in enumerate(series):
        ax.bar([x + 0.27 * (i - 1) for x in range(len(agreements))], values, width=0.27, label=name)
    ax.axhline(engine_bound, color="black", linewidth=0.8, linestyle="--", label=f"engine's bound {engine_bound:.1e}")
    ax.axhline(oracle_bound, color="tab:orange", linewidth=0.8, linestyle=":",
               label=f"oracle's bound {oracle_bound:.1e}")
    ax.set_yscale("log")
    ax.set_xticks(range(len(agreements)), [f"{a.implementation}\n{a.checkpoint}" for a in agreements], fontsize=7)
    ax.set_xlabel("golden (whose implementation, which checkpoint)")
    ax.set_ylabel("relative L2 of the logits")
    ax.set_title("Against other implementations' float32 logits")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside: the bounds run across
    return fig


def bytes_table(rows: Mapping[str, Mapping[str, int]], labels: Mapping[str, str] | None = None) -> str:
    """A plain-text table of byte counts (rows x parts) in human units."""
    parts = list(dict.fromkeys(p for r in rows.values() for p in r))
    names = [(labels or {}).get(p, p) for p in parts]
    width = max([len(n) for n in rows] + [6])
    lines = [" " * width + "".join(f"{n:>16}" for n in names)]
    for name, r in rows.items():
        lines.append(f"{name:<{width}}" + "".join(f"{human_bytes(r[p]) if p in r else '-':>16}" for p in parts))
    return "\n".join(lines)
