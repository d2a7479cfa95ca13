"""A Hugging Face checkpoint read through the container's interface, for the float64 oracle.

`waste check CONTAINER --source CHECKPOINT_DIR` runs the oracle on the checkpoint the container
was converted from, so the comparison includes the weight format's own rounding (q8g, q4g, a
requantised MXFP4), which an oracle reading the container's stored weights cannot see.
`CheckpointSource` offers what `waste.reference.model.ReferenceModel` reads from a container
(`.config`, `.tensor`, `.matrix`, `.expert`, `.has`): tensors under their canonical names (K3's
layout mapped by `k3_layout`, as `waste convert` maps it), matrices as float32 (bfloat16 widened
exactly), MXFP4 experts as their two byte arrays. Tensors are read on demand, one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from waste.config import ModelConfig, load_config_file
from waste.container import k3_layout
from waste.container.convert import SourceTensor, inventory, read_tensor
from waste.container.format import expert_name
from waste.errors import WasteError


@dataclass(frozen=True)
class SourceMatrix:
    """A checkpoint matrix [N, K] as the oracle's dequantiser reads one: "f32" with buffer "w", or
    "mxfp4" with buffers "packed" and "scales"."""

    fmt: str
    shape: tuple[int, int]
    buffers: dict[str, np.ndarray]


class CheckpointSource:
    """A checkpoint directory (config.json + safetensors) with the container's read interface."""

    def __init__(self, hf_dir: str | Path):
        self.path = Path(hf_dir)
        if not (self.path / "config.json").is_file():
            raise WasteError(f"{self.path}: not a checkpoint directory (no config.json)")
        self.config: ModelConfig = load_config_file(self.path / "config.json")
        self._found, _ = inventory(self.path, self.config)

    def has(self, name: str) -> bool:
        return name in self._found

    def _read(self, name: str) -> np.ndarray:
        t: SourceTensor | None = self._found.get(name)
        if t is None:
            raise WasteError(f"{self.path}: no tensor {name!r}")
        with open(t.path, "rb") as f:
            return read_tensor(f, t)

    def tensor(self, name: str) -> np.ndarray:
        """A tensor as float32 in its checkpoint shape."""
        return self._read(name)

    def matrix(self, name: str) -> SourceMatrix:
        values = self._read(name)
        if values.ndim != 2:
            raise WasteError(f"{self.path}: tensor {name!r} has shape {list(values.shape)}, not a matrix")
        return SourceMatrix("f32", (values.shape[0], values.shape[1]), {"w": values})

    def expert(self, layer: int, e: int) -> tuple[SourceMatrix, SourceMatrix, SourceMatrix]:
        """(w1, w3, w2) of a routed expert: float32, or MXFP4 as the checkpoint stores it."""
        out = []
        for part in ("w1", "w3", "w2"):
            name = expert_name(layer, e, part)
            if name in self._found:
                out.append(self.matrix(name))
                continue
            buffers = {buf: self._read(n) for buf, n in k3_layout.mxfp4_expert_names(name).items()}
            rows, half = buffers["packed"].shape
            out.append(SourceMatrix("mxfp4", (rows, 2 * half), buffers))
        return out[0], out[1], out[2]

    def expert_format(self) -> str:
        """"mxfp4" when the checkpoint's routed experts are MXFP4, else "float"."""
        return "mxfp4" if any(k3_layout.mxfp4_expert(n) for n in self._found) else "float"


def check_source_matches(source: CheckpointSource, container: Any) -> None:
    """Refuse a checkpoint that is not the container's source: another config, or any tensor the
    container keeps as an exact float32 array (norms, router, biases, conv taps) that differs."""
    if source.config != container.config:
        raise WasteError(f"{source.path}: its config.json is not the container's config; give the checkpoint "
                         "the container was converted from")
    for name in container.names():
        entry = container.entry(name)
        if entry.kind != "array":
            continue
        if not source.has(name):
            raise WasteError(f"{source.path}: no tensor {name!r}, which the container holds")
        if not np.array_equal(source.tensor(name), container.tensor(name)):
            raise WasteError(f"{source.path}: tensor {name!r} differs from the container's; give the checkpoint "
                             "the container was converted from")
