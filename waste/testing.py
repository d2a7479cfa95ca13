"""Helpers for tests in every area: tiny configs and tiny containers built on the fly.

`tiny_container(tmp_path_factory, quant="q8", overrides={"q_lora_rank": 16})` synthesises the
`tiny` preset (with config overrides merged in) and converts it; with a pytest
`tmp_path_factory` the result is cached for the session, keyed by its arguments, so many
tests can share one container (containers are read-only once written).
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from waste.config import preset_dict

_CACHE: dict[tuple[str, str], Path] = {}


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """The `tiny` preset's HF config dict with overrides merged in (nested dicts merge key by key).

    e.g. tiny_config(q_lora_rank=16, linear_attn_config={"gate_lower_bound": -5.0}).
    """
    return _merge(preset_dict("tiny"), overrides)


def tiny_container(tmp: Any, *, quant: str = "f32", dtype: str = "f32", seed: int = 0,
                   overrides: dict[str, Any] | None = None, preset: str = "tiny",
                   expert_format: str | None = None) -> Path:
    """Synthesise a small preset (with config overrides) and convert it; the container's path.

    `tmp` is a pytest TempPathFactory (containers are then cached across the session) or a
    directory to build in. `preset="k3-tiny"` builds K3 (overrides then go under
    "text_config"); its experts are MXFP4 unless `expert_format` is "f32" or "bf16".
    """
    from waste.container.convert import convert
    from waste.synth import synthesize

    key = json.dumps([quant, dtype, seed, overrides or {}, expert_format], sort_keys=True)
    tag = f"{preset}-{quant}-{dtype}-s{seed}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    if hasattr(tmp, "getbasetemp"):
        base = Path(tmp.getbasetemp()) / "waste-tiny"
        base.mkdir(exist_ok=True)
    else:
        base = Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
    cache_key = (str(base), tag)
    cached = _CACHE.get(cache_key)
    if cached is not None and (cached / "manifest.json").is_file():
        return cached
    cfg = _merge(preset_dict(preset), overrides or {})
    hf = synthesize(cfg, base / f"{tag}-hf", seed=seed, dtype=dtype, force=True, expert_format=expert_format)
    out = convert(hf, base / f"{tag}.waste", quant=quant, force=True, progress=False)
    _CACHE[cache_key] = out
    return out


def tiny_checkpoint(container: Path) -> Path:
    """The synthesised checkpoint directory a `tiny_container` was converted from."""
    return container.parent / (container.name.removesuffix(".waste") + "-hf")


def load_checkpoint(hf_dir: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint as float32, read with the safetensors library (not waste's reader)."""
    from safetensors import safe_open

    hf_dir = Path(hf_dir)
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(hf_dir / shard, "np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[name] = f.get_tensor(name).astype(np.float32)
    return out


def kda_inputs(rng: np.random.Generator, T: int, H: int, K: int, V: int, g: np.ndarray | None = None
               ) -> tuple[np.ndarray, ...]:
    """Random float32 KDA inputs as fla's tests draw them: q, k [T, H, K], v [T, H, V],
    g [T, H, K] (log-sigmoid of normals, < 0) unless given, beta [T, H] in (0, 1), and an
    initial state [H, K, V]."""
    f = np.float32
    q = rng.standard_normal((T, H, K)).astype(f)
    k = rng.standard_normal((T, H, K)).astype(f)
    v = rng.standard_normal((T, H, V)).astype(f)
    if g is None:
        g = -np.logaddexp(0.0, -rng.standard_normal((T, H, K)))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((T, H))))
    s0 = (0.1 * rng.standard_normal((H, K, V))).astype(f)
    return q, k, v, np.asarray(g).astype(f), beta.astype(f), s0
