"""The WASTE container format: constants, the expected tensor table, layouts, manifest checks.

A container is a directory `NAME.waste/` holding `manifest.json`, `trunk.bin` (every tensor
except the routed experts, each aligned to 64 bytes) and `experts.bin` (one blob per
(MoE layer, expert) holding w1, w3, w2, each blob aligned to 4096 bytes). docs/CONTAINER.md
is the specification; this module is the one place its rules are written as code:

- `expected_tensors(cfg)` / `expected_expert_tensors(cfg)`: the names and shapes a model of
  this config has (synth writes them, convert checks them, the reader insists on them);
- `storage_of(name, shape, scheme)`: how a trunk tensor is stored under a quantisation scheme,
  `expert_storage(cfg, scheme)`: how the routed experts are (MXFP4 stays MXFP4);
- `span_layout(...)`: where each buffer of a stored tensor sits inside its span;
- `crc32c(data)`: the checksum of every tensor span and expert part.

Reading and writing `manifest.json` itself is `waste.container.manifest`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c as _crc32c
import numpy as np

from waste.config import MXFP4_GROUP, ModelConfig
from waste.errors import WasteError
from waste.qformat import EXPERT_CHOICES, GROUP, SCHEMES, buffer_layout

MAGIC = "WASTE-CONTAINER"
# 2: CRC32C instead of zlib's CRC32, and a SHA-256 of the manifest's own content (`checksum`).
FORMAT_VERSION = 2
# q4all: the trunk in 4 bits too (llama.cpp's all-Q4_0 recipe, for a like-for-like comparison and
# the smallest model), except the embedding and lm_head, which stay q8g as llama.cpp keeps its
# output matrix at 6 bits (routers stay float32 in every scheme).
Q4ALL_KEEP_Q8 = ("model.embed_tokens.weight", "lm_head.weight")
MANIFEST = "manifest.json"
TRUNK = "trunk.bin"
EXPERTS = "experts.bin"
TRUNK_ALIGN = 64  # every tensor and every buffer starts on a cache line
BLOB_ALIGN = 4096  # one expert blob = one aligned pread, O_DIRECT-ready
EXPERT_PARTS = ("w1", "w3", "w2")  # gate, up, down: the order inside a blob
ROUTER_SUFFIX = "block_sparse_moe.gate.weight"
# Storage of the routed experts: the scheme's own (f32, q8g, q4g) or MXFP4 kept verbatim.
EXPERT_STORAGES = ("f32", "bf16", "q8g", "q4g", "mxfp4")
SCHEME_EXPERT_STORAGE = {"f32": "f32", "bf16": "bf16", "q8": "q8g", "q4": "q4g", "q4all": "q4g"}
# Group length along K of the grouped formats (docs/QUANT.md), recorded in the tensor table.
GROUP_SIZE = {"f32": None, "bf16": None, "q8g": GROUP, "q4g": GROUP, "mxfp4": MXFP4_GROUP}
# AttnRes vectors [1, D]: 2-D `.weight` tensors that stay float32 arrays, not matrices.
RES_PROJ_SUFFIX = "_res_proj.weight"

_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_DENSE_ALT_RE = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.weight$")


class ContainerError(WasteError):
    """A container that is missing, damaged, of an unknown version or inconsistent."""


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C (Castagnoli) of a contiguous buffer, continuing from `value`.

    The `crc32c` package computes it with the CPU's CRC instruction (SSE4.2, ARMv8) and
    releases the GIL on large buffers: 5 GB/s here against zlib's 1 GB/s, which matters
    when a multi-GB trunk is checked on every open.
    """
    return _crc32c.crc32c(data, value)


def side_file_record(data: bytes) -> dict[str, int]:
    """How the manifest lists a small file the container carries (the tokenizer's): size and CRC32C."""
    return {"bytes": len(data), "crc32c": crc32c(data)}


Shape = tuple[int, ...]


def expert_storage(cfg: ModelConfig, scheme: str, experts: str | None = None) -> str:
    """Storage of the routed experts: `experts` (f32, q8, q4 or mxfp4) when asked, else MXFP4 experts
    stay MXFP4 and others follow the scheme (f32, q8 -> q8g, q4 and q4all -> q4g)."""
    if scheme not in SCHEMES:
        raise WasteError(f"unknown quantisation scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    if experts is None:
        return "mxfp4" if cfg.expert_quant == "mxfp4" else SCHEME_EXPERT_STORAGE[scheme]
    if experts not in EXPERT_CHOICES:
        raise WasteError(f"unknown expert storage {experts!r}; expected one of {', '.join(EXPERT_CHOICES)}")
    return EXPERT_CHOICES[experts]


def a_log_shape(cfg: ModelConfig) -> Shape:
    """Shape synth writes for A_log: [1, 1, H, 1] (Kimi-Linear) or [K] zero-padded past H (K3)."""
    h, k = cfg.kda_num_heads, cfg.kda_head_dim
    if cfg.kda_gate == "lower_bound":
        return (max(h, k),)
    return (1, 1, h, 1)


def shape_accepted(name: str, shape: Shape, expected: Shape, cfg: ModelConfig) -> bool:
    """Whether a checkpoint or container tensor may have `shape`: the expected one, or for A_log
    either spelling, [1, 1, H, 1] or [n >= H] (K3 pads it with zeros past H)."""
    if name.endswith(".self_attn.A_log"):
        h = cfg.kda_num_heads
        return tuple(shape) == (1, 1, h, 1) or (len(shape) == 1 and shape[0] >= h)
    return tuple(shape) == tuple(expected)


def _kda_tensors(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    d, h, k = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    hk = h * k
    t: dict[str, Shape] = {}
    for x in ("q", "k", "v"):
        t[f"{p}{x}_proj.weight"] = (hk, d)
    for x in ("q", "k", "v"):
        t[f"{p}{x}_conv1d.weight"] = (hk, 1, cfg.short_conv_kernel)
    t[f"{p}A_log"] = a_log_shape(cfg)
    t[f"{p}dt_bias"] = (hk,)
    t[f"{p}f_a_proj.weight"] = (k, d)
    t[f"{p}f_b_proj.weight"] = (hk, k)
    t[f"{p}b_proj.weight"] = (h, d)
    if cfg.kda_full_rank_gate:
        t[f"{p}g_proj.weight"] = (hk, d)
    else:
        t[f"{p}g_a_proj.weight"] = (k, d)
        t[f"{p}g_b_proj.weight"] = (hk, k)
    t[f"{p}o_norm.weight"] = (k,)
    t[f"{p}o_proj.weight"] = (d, hk)
    return t


def _mla_tensors(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    d, h = cfg.hidden_size, cfg.mla_num_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    t: dict[str, Shape] = {}
    if cfg.q_lora_rank is None:
        t[f"{p}q_proj.weight"] = (h * qk, d)
    else:
        t[f"{p}q_a_proj.weight"] = (cfg.q_lora_rank, d)
        t[f"{p}q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        t[f"{p}q_b_proj.weight"] = (h * qk, cfg.q_lora_rank)
    t[f"{p}kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d)
    t[f"{p}kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    t[f"{p}kv_b_proj.weight"] = (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    t[f"{p}o_proj.weight"] = (d, h * cfg.v_head_dim)
    if cfg.mla_output_gate:
        t[f"{p}g_proj.weight"] = (h * cfg.v_head_dim, d)
    return t


def _ffn_tensors(p: str, d: int, inter: int) -> dict[str, Shape]:
    return {f"{p}gate_proj.weight": (inter, d), f"{p}up_proj.weight": (inter, d), f"{p}down_proj.weight": (d, inter)}


def _attn_res_tensors(p: str, d: int) -> dict[str, Shape]:
    """AttnRes pseudo-query of one mixing point: RMSNorm weight [D] and projection [1, D]."""
    return {f"{p}_res_norm.weight": (d,), f"{p}_res_proj.weight": (1, d)}


def expected_tensors(cfg: ModelConfig) -> dict[str, Shape]:
    """Every tensor except the routed experts: canonical HF name -> shape, in trunk order.

    Shapes follow FACTS.md; A_log has the shape synth writes (`a_log_shape`), convert also
    accepts the other spelling. Works for any parsed config (the planner prices K3 with it).
    """
    d = cfg.hidden_size
    t: dict[str, Shape] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for i, kind in enumerate(cfg.layer_kinds):
        p = f"model.layers.{i}."
        if cfg.attn_res_block_size is not None:
            t.update(_attn_res_tensors(p + "self_attention", d))
            t.update(_attn_res_tensors(p + "mlp", d))
        t[p + "input_layernorm.weight"] = (d,)
        t.update(_kda_tensors(cfg, p + "self_attn.") if kind == "kda" else _mla_tensors(cfg, p + "self_attn."))
        t[p + "post_attention_layernorm.weight"] = (d,)
        if i < cfg.first_k_dense_replace:
            t.update(_ffn_tensors(p + "mlp.", d, cfg.intermediate_size))
            continue
        m = p + "block_sparse_moe."
        t[m + "gate.weight"] = (cfg.num_experts, d)
        t[m + "gate.e_score_correction_bias"] = (cfg.num_experts,)
        if cfg.routed_expert_hidden_size is not None:
            r = cfg.routed_expert_hidden_size
            t[m + "routed_expert_down_proj.weight"] = (r, d)
            t[m + "routed_expert_up_proj.weight"] = (d, r)
            if cfg.latent_moe_use_norm:
                t[m + "routed_expert_norm.weight"] = (r,)
        if cfg.num_shared_experts > 0:
            t.update(_ffn_tensors(m + "shared_experts.", d, cfg.moe_intermediate_size * cfg.num_shared_experts))
    if cfg.attn_res_block_size is not None:
        t.update(_attn_res_tensors("model.output_attn", d))
    t["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = (cfg.vocab_size, d)
    return t


def expected_expert_tensors(cfg: ModelConfig) -> dict[str, Shape]:
    """The matrices of ONE routed expert, in blob order: {"w1": [I, D], "w3": [I, D], "w2": [D, I]}.

    Every expert of every MoE layer (`cfg.moe_layers`) has these; their checkpoint names come
    from `expert_name(layer, e, part)`. D is the width the experts read (`expert_input_size`).
    """
    d, inter = cfg.expert_input_size, cfg.moe_intermediate_size
    return {"w1": (inter, d), "w3": (inter, d), "w2": (d, inter)}


def expert_name(layer: int, expert: int, part: str) -> str:
    """Checkpoint name of one routed expert matrix (part w1, w2 or w3)."""
    return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{part}.weight"


def parse_expert_name(name: str) -> tuple[int, int, str] | None:
    """(layer, expert, part) of a routed expert tensor name, else None."""
    m = _EXPERT_RE.match(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def canonical_name(name: str, cfg: ModelConfig) -> str:
    """Map the transformers spelling of the dense FFN (`block_sparse_moe.gate_proj`) to `mlp.`."""
    m = _DENSE_ALT_RE.match(name)
    if m and int(m.group(1)) < cfg.first_k_dense_replace:
        return f"model.layers.{m.group(1)}.mlp.{m.group(2)}.weight"
    return name


def is_matrix(name: str, shape: Shape) -> bool:
    """Weight matrices: every 2-D `*.weight` except the MoE router (which stays exact float32) and
    the AttnRes projections [1, D] (vectors the mixing reads whole)."""
    return (len(shape) == 2 and name.endswith(".weight") and not name.endswith(ROUTER_SUFFIX)
            and not name.endswith(RES_PROJ_SUFFIX))


def storage_of(name: str, shape: Shape, scheme: str) -> tuple[str, str]:
    """(kind, storage) of a trunk tensor under a scheme: kind "matrix" | "array", storage f32 | bf16 | q8g | q4g.

    Routed experts are stored as `expert_storage` says. `bf16` keeps every matrix as bfloat16:
    lossless from a bf16 checkpoint."""
    if scheme not in SCHEMES:
        raise WasteError(f"unknown quantisation scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    if not is_matrix(name, shape):
        return "array", "f32"
    if scheme in ("f32", "bf16"):
        return "matrix", scheme
    if scheme == "q4all" and name not in Q4ALL_KEEP_Q8:
        return "matrix", "q4g"
    return "matrix", "q8g"


def tensor_class(name: str, cfg: ModelConfig) -> str:
    """Byte-count class of a trunk tensor: embedding, lm_head, kda, mla, dense_ffn, shared_experts, router,
    latent_moe (the latent projections and norm), attn_res, norms."""
    if "_res_norm." in name or "_res_proj." in name:
        return "attn_res"
    if ".routed_expert_" in name:
        return "latent_moe"
    if name == "model.embed_tokens.weight":
        return "embedding"
    if name == "lm_head.weight":
        return "lm_head"
    if ".shared_experts." in name:
        return "shared_experts"
    if name.endswith(ROUTER_SUFFIX) or name.endswith("e_score_correction_bias"):
        return "router"
    if ".mlp." in name:
        return "dense_ffn"
    if "norm" in name:
        return "norms"
    if ".self_attn." in name:
        return cfg.layer_kinds[int(name.split(".")[2])]
    return "other"


def align(n: int, a: int) -> int:
    """n rounded up to a multiple of a."""
    return -(-n // a) * a


@dataclass(frozen=True)
class BufferSpec:
    """One buffer of a stored tensor: offset relative to the tensor's span."""

    name: str
    dtype: str  # numpy dtype name, little-endian
    shape: Shape
    offset: int
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset,
                "bytes": self.nbytes}


def span_layout(kind: str, storage: str, shape: Shape) -> tuple[tuple[BufferSpec, ...], int]:
    """Buffers of a stored tensor back to back, each 64-byte aligned; (buffers, span bytes)."""
    if kind == "array":
        layout = [("w", np.dtype(np.float32), shape)]
    else:
        layout = buffer_layout(storage, (shape[0], shape[1]))
    specs, pos = [], 0
    for bname, dtype, bshape in layout:
        dt = np.dtype(dtype)
        nbytes = math.prod(bshape) * dt.itemsize
        specs.append(BufferSpec(bname, dt.name, tuple(int(s) for s in bshape), pos, nbytes))
        pos = align(pos + nbytes, TRUNK_ALIGN)
    end = specs[-1].offset + specs[-1].nbytes
    return tuple(specs), end


@dataclass(frozen=True)
class TensorEntry:
    """One row of the tensor table (trunk tensors, and the three parts of an expert blob)."""

    name: str
    file: str
    offset: int  # absolute in `file` (trunk) or relative to the blob (expert parts)
    nbytes: int  # the span: buffers plus the padding between them
    shape: Shape
    kind: str
    storage: str
    buffers: tuple[BufferSpec, ...]
    crc32c: int | None = None
    group_size: Any = None  # as read from a manifest; written from GROUP_SIZE

    def to_json(self) -> dict[str, Any]:
        d = {"name": self.name, "file": self.file, "offset": self.offset, "bytes": self.nbytes,
             "shape": list(self.shape), "kind": self.kind, "storage": self.storage,
             "group_size": GROUP_SIZE[self.storage], "buffers": [b.to_json() for b in self.buffers]}
        if self.crc32c is not None:
            d["crc32c"] = self.crc32c
        return d

    @property
    def data_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


@dataclass(frozen=True)
class ExpertsLayout:
    """experts.bin: blob (layer, e) sits at (moe_index(layer) * E + e) * blob_bytes."""

    layers: tuple[int, ...]
    num_experts: int
    blob_bytes: int
    parts: tuple[TensorEntry, ...]  # w1, w3, w2 with offsets inside the blob
    storage: str  # one of EXPERT_STORAGES, the same for the three parts
    crc32c: np.ndarray | None = None  # [L_moe, E, 3] uint32

    @property
    def file_bytes(self) -> int:
        return len(self.layers) * self.num_experts * self.blob_bytes

    def blob_offset(self, layer: int, expert: int) -> int:
        if layer not in self.layers:
            raise ContainerError(f"layer {layer} has no routed experts (MoE layers: {list(self.layers)})")
        if not 0 <= expert < self.num_experts:
            raise ContainerError(f"expert {expert} out of range 0..{self.num_experts - 1}")
        return (self.layers.index(layer) * self.num_experts + expert) * self.blob_bytes

    def to_json(self) -> dict[str, Any]:
        return {"file": EXPERTS, "layers": list(self.layers), "num_experts": self.num_experts,
                "blob_bytes": self.blob_bytes, "storage": self.storage, "parts": [p.to_json() for p in self.parts],
                "crc32c": [] if self.crc32c is None else self.crc32c.tolist()}


def plan_trunk(cfg: ModelConfig, scheme: str, shapes: dict[str, Shape]) -> list[TensorEntry]:
    """Offsets of the trunk tensors in the given order (shapes as found in the checkpoint)."""
    entries, pos = [], 0
    for name, shape in shapes.items():
        kind, storage = storage_of(name, shape, scheme)
        buffers, span = span_layout(kind, storage, shape)
        entries.append(TensorEntry(name, TRUNK, pos, span, tuple(shape), kind, storage, buffers))
        pos = align(pos + span, TRUNK_ALIGN)
    return entries


def plan_experts(cfg: ModelConfig, storage: str) -> ExpertsLayout:
    """Blob layout of experts.bin: w1, w3, w2 back to back, each 64-byte aligned, blob 4096-aligned."""
    if storage not in EXPERT_STORAGES:
        raise WasteError(f"unknown expert storage {storage!r}; expected one of {', '.join(EXPERT_STORAGES)}")
    parts, pos = [], 0
    for part, shape in expected_expert_tensors(cfg).items():
        buffers, span = span_layout("matrix", storage, shape)
        parts.append(TensorEntry(part, EXPERTS, pos, span, shape, "matrix", storage, buffers))
        pos = align(pos + span, TRUNK_ALIGN)
    return ExpertsLayout(tuple(cfg.moe_layers), cfg.num_experts, align(pos, BLOB_ALIGN), tuple(parts), storage)


def is_container_dir(path: Path) -> bool:
    """Whether a directory looks like a waste container (it has a manifest), as an output that
    `--force` may replace."""
    return (path / MANIFEST).is_file()
