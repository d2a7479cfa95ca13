"""Random Hugging Face style checkpoints with the real tensor names, for any preset's shape.

`synthesize` writes `config.json`, Kimi's tokenizer files when the vocabulary has room
(`waste.tokenizer.synthetic_tokenizer_files`), shards `model-0000i-of-0000n.safetensors` and
`model.safetensors.index.json`, one tensor at a time (memory bounded by the largest tensor).
Each tensor is drawn from its own generator seeded by (seed, CRC32 of its name), so the
values do not depend on sharding or on the order of writing.

Value ranges are chosen so a forward pass stays in range through every layer: inputs of
every projection are RMS-normalised or O(1), so weights are N(0, 1/fan_in); the matrices
that write back into the residual stream (o_proj, down_proj, w2) are a further
1/sqrt(2 L) smaller so the stream grows by O(1) over the whole depth; norms are
1 + 0.05 N(0, 1); conv taps are near identity (0.1 N(0, 1), plus 1 on the current-token tap);
A_log = log U[1, 16]; dt_bias 0.1 N(0, 1); router bias 0.01 N(0, 1); lm_head is scaled so
logits have a standard deviation of about 3 (a clear but not extreme spread). In a latent MoE
the routed experts write into the latent, so `routed_expert_up_proj` is the residual writer.

A `kimi_k3` config is written in K3's own layout (`waste.container.k3_layout`): names under
`language_model.`, a few vision tensors, and MXFP4 routed experts quantised from the same random
values (with K3's quantization_config in config.json) when the config or `expert_format` asks.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import zlib
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from waste.config import PRESETS, ModelConfig, load_config_file, load_preset, parse_config
from waste.container import k3_layout
from waste.container.format import (
    EXPERT_PARTS,
    Shape,
    expected_expert_tensors,
    expected_tensors,
    expert_name,
)
from waste.errors import WasteError
from waste.fileio import check_free_space, check_output_dir, install_dir, recover_stale, remove_tree, temp_dir_for
from waste.kernels.mxfp4 import quantize_mxfp4
from waste.tokenizer import synthetic_tokenizer_files, write_files
from waste.units import human_bytes, parse_size

DTYPES = {"bf16": ("BF16", ml_dtypes.bfloat16), "f32": ("F32", np.float32)}
_ST_NUMPY = {"BF16": ml_dtypes.bfloat16, "F32": np.float32, "U8": np.uint8}
EXPERT_FORMATS = ("mxfp4", "bf16", "f32")
INDEX = "model.safetensors.index.json"
_RESIDUAL_WRITERS = (".o_proj.weight", ".down_proj.weight", ".w2.weight", ".routed_expert_up_proj.weight")
LOGIT_STD = 3.0


def resolve_config(cfg_or_preset: ModelConfig | dict[str, Any] | str | Path) -> ModelConfig:
    """A ModelConfig from a ModelConfig, an HF config dict, a preset name or a config.json path."""
    if isinstance(cfg_or_preset, ModelConfig):
        return cfg_or_preset
    if isinstance(cfg_or_preset, dict):
        return parse_config(cfg_or_preset)
    if isinstance(cfg_or_preset, str) and cfg_or_preset in PRESETS:
        return load_preset(cfg_or_preset)
    return load_config_file(cfg_or_preset)


def checkpoint_tensors(cfg: ModelConfig) -> dict[str, Shape]:
    """Every tensor of the checkpoint in file order: each layer's experts sit inside the layer."""
    trunk = expected_tensors(cfg)
    parts = expected_expert_tensors(cfg)
    out: dict[str, Shape] = {}
    current = -1

    def experts_of(layer: int) -> None:
        if layer in cfg.moe_layers:
            for e in range(cfg.num_experts):
                for part in EXPERT_PARTS:
                    out[expert_name(layer, e, part)] = parts[part]

    for name, shape in trunk.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if layer != current:
            experts_of(current)
            current = layer
        out[name] = shape
    experts_of(current)
    return out


def synth_values(name: str, shape: Shape, cfg: ModelConfig, seed: int) -> np.ndarray:
    """float32 values of one tensor, deterministic in (seed, name)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    # In place throughout: the largest tensors (embedding, lm_head) set the memory peak.
    x = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith("norm.weight"):
        x *= np.float32(0.05)
        x += np.float32(1)
        return x
    if name.endswith(".A_log"):
        h = cfg.kda_num_heads
        a = np.zeros(shape, np.float32).reshape(-1)
        a[:h] = np.log(rng.uniform(1.0, 16.0, size=h)).astype(np.float32)
        return a.reshape(shape)
    if name.endswith(".dt_bias"):
        x *= np.float32(0.1)
        return x
    if name.endswith("e_score_correction_bias"):
        x *= np.float32(0.01)
        return x
    if "_conv1d." in name:
        x *= np.float32(0.1)
        x[..., -1] += np.float32(1)
        return x
    if name == "model.embed_tokens.weight":
        return x
    scale = 1.0 / math.sqrt(shape[-1])
    if name == "lm_head.weight":
        scale *= LOGIT_STD
    elif name.endswith(_RESIDUAL_WRITERS) and not (name.endswith(".w2.weight") and cfg.routed_expert_hidden_size):
        scale /= math.sqrt(2 * cfg.num_layers)
    x *= np.float32(scale)
    return x


def _entry_bytes(entry: k3_layout.CheckpointEntry) -> int:
    """A checkpoint tensor's data bytes."""
    st_dtype, shape, _, _ = entry
    return math.prod(shape) * np.dtype(_ST_NUMPY[st_dtype]).itemsize


def _plan_shards(entries: dict[str, k3_layout.CheckpointEntry], shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, entry in entries.items():
        n = _entry_bytes(entry)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


class _Values:
    """The bytes of each checkpoint tensor; an MXFP4 expert is quantised once for its two tensors."""

    def __init__(self, cfg: ModelConfig, seed: int, shapes: dict[str, Shape]):
        self.cfg, self.seed, self.shapes = cfg, seed, shapes
        self._mxfp4: tuple[str, dict[str, np.ndarray]] | None = None

    def __call__(self, entry: k3_layout.CheckpointEntry) -> np.ndarray:
        st_dtype, shape, source, buf = entry
        if buf is None:
            return synth_values(source, shape, self.cfg, self.seed).astype(_ST_NUMPY[st_dtype])
        if self._mxfp4 is None or self._mxfp4[0] != source:
            packed, scales = quantize_mxfp4(synth_values(source, self.shapes[source], self.cfg, self.seed))
            self._mxfp4 = (source, {"packed": packed, "scales": scales})
        return self._mxfp4[1][buf]


def _write_shard(path: Path, names: list[str], entries: dict[str, k3_layout.CheckpointEntry],
                 values: _Values) -> int:
    """One safetensors file, header first, then each tensor as it is generated; its data bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name in names:
        st_dtype, shape, _, _ = entries[name]
        n = _entry_bytes(entries[name])
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in names:
            f.write(memoryview(np.ascontiguousarray(values(entries[name])).reshape(-1).view(np.uint8)))
    return pos


def _checkpoint_layout(cfg: ModelConfig, dtype: str, expert_format: str | None,
                       attn_res_spelling: str) -> tuple[dict[str, Any], dict[str, k3_layout.CheckpointEntry]]:
    """(config.json, checkpoint name -> entry): Kimi-Linear's flat layout, or K3's own."""
    hf = cfg.to_hf_dict()
    st_dtype = DTYPES[dtype][0]
    if expert_format not in (None, *EXPERT_FORMATS):
        raise WasteError(f"unknown expert format {expert_format!r}; expected one of {', '.join(EXPERT_FORMATS)}")
    if cfg.model_type != "kimi_k3":
        if expert_format == "mxfp4":
            raise WasteError("MXFP4 experts are written in K3's layout only; this config is kimi_linear")
        expert_dtype = DTYPES[expert_format or dtype][0]
        entries = {n: (expert_dtype if ".experts." in n else st_dtype, s, n, None)
                   for n, s in checkpoint_tensors(cfg).items()}
        return hf, entries
    expert_format = expert_format or ("mxfp4" if cfg.expert_quant == "mxfp4" else dtype)
    mxfp4 = expert_format == "mxfp4"
    quant = cfg.raw.get("text_config", {}).get("quantization_config") if cfg.expert_quant else None
    quant = quant or k3_layout.MXFP4_QUANTIZATION_CONFIG
    hf = k3_layout.k3_config_json(hf, quant if mxfp4 else None)
    parse_config(hf)  # e.g. MXFP4 experts need widths in whole groups of 32: refuse before writing
    expert_dtype = "U8" if mxfp4 else DTYPES[expert_format][0]
    return hf, k3_layout.checkpoint_entries(checkpoint_tensors(cfg), st_dtype, expert_dtype, attn_res_spelling)


def synthesize(cfg_or_preset: ModelConfig | dict[str, Any] | str | Path, out_dir: str | Path, *, seed: int = 0,
               dtype: str = "bf16", shard_bytes: int = 512 << 20, force: bool = False,
               expert_format: str | None = None, attn_res_spelling: str = "canonical") -> Path:
    """Write a random checkpoint (config.json, shards, index) for a config; the directory's path.

    `expert_format` (mxfp4, bf16, f32) is how routed experts are written: by default MXFP4 when
    the config's quantization_config says so (as K3 ships) and `dtype` otherwise.
    `attn_res_spelling` "dotted" writes K3's AttnRes vectors as `<x>_res.norm_weight` / `.proj_weight`."""
    cfg = resolve_config(cfg_or_preset)
    if dtype not in DTYPES:
        raise WasteError(f"unknown dtype {dtype!r}; expected bf16 or f32")
    if shard_bytes < 1:
        raise WasteError(f"shard size must be positive, got {shard_bytes}")
    out = Path(out_dir)
    recover_stale(out)
    check_output_dir(out, "checkpoint (a directory with config.json)", force,
                     lambda d: (d / "config.json").is_file())
    if not out.parent.is_dir():
        raise WasteError(f"{out.parent}: no such directory")
    hf, entries = _checkpoint_layout(cfg, dtype, expert_format, attn_res_spelling)
    shards = _plan_shards(entries, shard_bytes)
    values = _Values(cfg, seed, checkpoint_tensors(cfg))
    tmp = temp_dir_for(out)
    try:
        check_free_space(out, sum(_entry_bytes(e) for e in entries.values()), "checkpoint")
        hf["dtype"] = "bfloat16" if dtype == "bf16" else "float32"
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        tokenizer = synthetic_tokenizer_files(cfg)
        if tokenizer:
            write_files(tmp, tokenizer)
        weight_map, total = {}, 0
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            total += _write_shard(tmp / fname, names, entries, values)
            weight_map.update(dict.fromkeys(names, fname))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        install_dir(tmp, out, force=force)
    except BaseException:
        remove_tree(tmp)
        raise
    return out


def cmd_synth(args: argparse.Namespace) -> int:
    """`waste synth PRESET OUT_DIR [--seed S] [--dtype bf16|f32] [--expert-format mxfp4|bf16|f32]
    [--attn-res-spelling canonical|dotted] [--shard-size 512M] [--force]`; with `--quant`, a
    container instead (`waste.synth_container`)."""
    if getattr(args, "quant", None):
        from waste.synth_container import cmd_synth_container

        return cmd_synth_container(args)
    shard_bytes = parse_size(getattr(args, "shard_size", None) or "512M", "shard size")
    dtype = getattr(args, "dtype", None) or "bf16"
    out = synthesize(args.preset, args.out_dir, seed=args.seed, dtype=dtype, shard_bytes=shard_bytes,
                     force=args.force, expert_format=getattr(args, "expert_format", None),
                     attn_res_spelling=getattr(args, "attn_res_spelling", None) or "canonical")
    index = json.loads((out / INDEX).read_text())
    n_shards = len(set(index["weight_map"].values()))
    print(f"{out}: {len(index['weight_map'])} tensors, {human_bytes(index['metadata']['total_size'])} "
          f"in {n_shards} shard(s), {dtype}, seed {args.seed}")
    return 0
