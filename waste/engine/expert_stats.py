"""Counters of an expert store: per layer and in total, for `waste run`'s report, the
benchmarks and the routing notebooks."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from waste.units import human_bytes


@dataclass
class LayerStats:
    """Counters of one layer (or the total). `requests` counts expert lookups: one per id
    asked for, so requests = hits + misses; `calls` counts `get` calls. `read_seconds` is
    the wall time from the start of the layer's first read to the end of its last (a read
    issued ahead starts when a reader thread takes it up)."""

    calls: int = 0
    requests: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    unused_bytes: int = 0  # read ahead, never asked for (included in bytes_read)
    ahead_used: int = 0  # misses whose read was issued ahead (a prefill's read-ahead or a decode guess)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else float("nan")

    @property
    def gbps(self) -> float:
        """Achieved read bandwidth, 1e9 bytes per second of wall time spent reading."""
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else float("nan")

    def add(self, other: LayerStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("hit_rate", "gbps"):
            v = getattr(self, name)
            d[name] = None if np.isnan(v) else v
        return d


class ExpertStats:
    """Per-layer and total counters of an expert store."""

    def __init__(self) -> None:
        self.layers: dict[int, LayerStats] = {}

    def layer(self, layer: int) -> LayerStats:
        """The counters of one layer, created on first use."""
        stats = self.layers.get(layer)
        if stats is None:
            stats = self.layers[layer] = LayerStats()
        return stats

    @property
    def total(self) -> LayerStats:
        t = LayerStats()
        for s in self.layers.values():
            t.add(s)
        return t

    def reset(self) -> None:
        self.layers.clear()

    def as_dict(self) -> dict[str, Any]:
        return {
            "layers": {str(k): v.as_dict() for k, v in sorted(self.layers.items())},
            "total": self.total.as_dict(),
        }

    def format_table(self) -> str:
        """A fixed-width table: one row per layer, then the total."""
        cols = ("layer", 6), ("lookups", 9), ("hits", 9), ("misses", 9), ("hit %", 7), ("read", 11), ("read s", 9)
        rows = [" ".join(f"{name:>{width}}" for name, width in cols) + f" {'GB/s':>7}"]
        for name, s in [*((str(k), v) for k, v in sorted(self.layers.items())), ("total", self.total)]:
            hit = "-" if np.isnan(s.hit_rate) else f"{100 * s.hit_rate:.1f}"
            gbps = "-" if np.isnan(s.gbps) else f"{s.gbps:.2f}"
            rows.append(
                f"{name:>6} {s.requests:>9} {s.hits:>9} {s.misses:>9} {hit:>7} {human_bytes(s.bytes_read):>11} "
                f"{s.read_seconds:>9.3f} {gbps:>7}"
            )
        return "\n".join(rows)
