"""Kimi K3's own checkpoint layout, mapped to the workbench's canonical names and back.

A K3 checkpoint (`model_type: kimi_k3`) differs from Kimi-Linear's in its names only
(K3_CONTRACT.md lists the canonical ones):
- every text tensor starts with `language_model.`; the vision side (`vision_tower.*`,
  `vision_model.*`, `mm_projector.*`, `multi_modal_projector.*`) is ignored;
- the AttnRes vectors are spelled `<x>_res_norm.weight` / `<x>_res_proj.weight` or, by some
  tooling, `<x>_res.norm_weight` / `<x>_res.proj_weight` (x: self_attention, mlp, output_attn);
- the router bias may sit at `block_sparse_moe.e_score_correction_bias`;
- MXFP4 routed experts (compressed-tensors `mxfp4-pack-quantized`) are two uint8 tensors,
  `...experts.E.wN.weight_packed` [out, in/2] and `.weight_scale` [out, in/32], instead of
  `...experts.E.wN.weight`.
`canonical(name)` reads a checkpoint name, `checkpoint_name(name, ...)` writes one.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from waste.config import MXFP4_GROUP
from waste.errors import WasteError

TEXT_PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "vision_model.", "mm_projector.", "multi_modal_projector.")
RES_SPELLINGS = ("canonical", "dotted")  # <x>_res_norm.weight | <x>_res.norm_weight
# safetensors suffix of an MXFP4 expert matrix -> its QMatrix buffer ("mxfp4" layout)
MXFP4_BUFFERS = {"weight_packed": "packed", "weight_scale": "scales"}
# A few small vision tensors synth writes so that readers must skip them: name -> shape.
VISION_TENSORS = {
    "vision_tower.patch_embed.proj.weight": (32, 3, 2, 2),
    "vision_tower.encoder.blocks.0.wqkv.weight": (96, 32),
    "vision_tower.encoder.final_layernorm.weight": (32,),
    "mm_projector.proj.0.weight": (64, 32),
}

_RES_DOTTED = re.compile(r"(self_attention_res|mlp_res|output_attn_res)\.(norm|proj)_weight$")
_RES_CANONICAL = re.compile(r"(self_attention_res|mlp_res|output_attn_res)_(norm|proj)\.weight$")
_BIAS_ALT = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.)e_score_correction_bias$")
_MXFP4_EXPERT = re.compile(
    r"^(model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3))\.(weight_packed|weight_scale)$"
)


def is_vision(name: str) -> bool:
    """A tensor of the vision side of a K3 checkpoint (with or without a leading `language_model.`)."""
    return name.removeprefix(TEXT_PREFIX).startswith(VISION_PREFIXES) or name.startswith(VISION_PREFIXES)


def canonical(name: str) -> str | None:
    """The canonical name of a K3 checkpoint tensor; None for the vision tensors (to be ignored).

    MXFP4 expert buffers keep their `.weight_packed` / `.weight_scale` suffix (see `mxfp4_expert`)."""
    if is_vision(name):
        return None
    name = name.removeprefix(TEXT_PREFIX)
    name = _RES_DOTTED.sub(r"\1_\2.weight", name)
    return _BIAS_ALT.sub(r"\1gate.e_score_correction_bias", name)


def checkpoint_name(name: str, res_spelling: str = "canonical") -> str:
    """The K3 checkpoint name of a canonical tensor name, AttnRes spelled as asked."""
    if res_spelling == "dotted":
        name = _RES_CANONICAL.sub(r"\1.\2_weight", name)
    return TEXT_PREFIX + name


def spelled_like(checkpoint_names: list[str]) -> Callable[[str], str]:
    """A function giving a canonical tensor name as a K3 checkpoint with these names spells it (its
    `language_model.` prefix or none, its AttnRes spelling), so that an error names what the user
    would look for in the file."""
    prefixed = any(n.startswith(TEXT_PREFIX) for n in checkpoint_names)
    spelling = "dotted" if any(_RES_DOTTED.search(n) for n in checkpoint_names) else "canonical"

    def spell(name: str) -> str:
        name = checkpoint_name(name, spelling)
        return name if prefixed else name.removeprefix(TEXT_PREFIX)

    return spell


def mxfp4_expert(name: str) -> tuple[int, int, str, str] | None:
    """(layer, expert, part, buffer) of a canonical MXFP4 expert tensor name, else None."""
    m = _MXFP4_EXPERT.match(name)
    if m is None:
        return None
    return int(m.group(2)), int(m.group(3)), m.group(4), MXFP4_BUFFERS[m.group(5)]


def mxfp4_expert_names(weight_name: str) -> dict[str, str]:
    """{"packed": ..., "scales": ...}: the two MXFP4 tensors standing for `...wN.weight`."""
    stem = weight_name.removesuffix(".weight")
    return {buf: f"{stem}.{suffix}" for suffix, buf in MXFP4_BUFFERS.items()}


def mxfp4_shapes(shape: tuple[int, int]) -> dict[str, tuple[int, int]]:
    """Shapes of the packed nibbles and the scale bytes of an MXFP4 matrix [out, in]."""
    out, inp = shape
    return {"packed": (out, inp // 2), "scales": (out, inp // MXFP4_GROUP)}


# The quantization_config K3 ships (under text_config): compressed-tensors MXFP4 for every Linear
# except those its ignore list names, so only the routed experts (the latent MoE's projections
# and AttnRes's stay bfloat16, as synth writes them and convert expects them).
MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized",
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": True,
                    "dynamic": False, "scale_dtype": "torch.uint8", "observer": "minmax"},
        "input_activations": None,
        "output_activations": None,
    }},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
               r"re:.*block_sparse_moe\.routed_expert_(down|up)_proj.*", "re:.*_res_proj.*", "re:.*lm_head.*",
               "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None,
}
# Tensors a K3 checkpoint keeps in float32 when the rest is bfloat16 (FACTS.md).
_F32_SUFFIXES = (".A_log", ".dt_bias", "_conv1d.weight", ".o_norm.weight", "e_score_correction_bias")
# (safetensors dtype, shape, canonical name whose values it holds, MXFP4 buffer or None)
CheckpointEntry = tuple[str, tuple[int, ...], str, str | None]


def checkpoint_entries(canonical_tensors: dict[str, tuple[int, ...]], float_dtype: str, expert_dtype: str,
                       res_spelling: str = "canonical") -> dict[str, CheckpointEntry]:
    """The tensors of a K3 checkpoint in file order: checkpoint name -> entry.

    `canonical_tensors` are the canonical names in file order (routed experts as `.weight`);
    `float_dtype` is "BF16" or "F32"; `expert_dtype` "U8" writes the experts as MXFP4 pairs,
    else a float dtype for them. The vision tensors come last."""
    if res_spelling not in RES_SPELLINGS:
        raise WasteError(f"unknown AttnRes spelling {res_spelling!r}; expected one of {', '.join(RES_SPELLINGS)}")
    out: dict[str, CheckpointEntry] = {}
    for name, shape in canonical_tensors.items():
        if ".block_sparse_moe.experts." in name:
            if expert_dtype == "U8":
                shapes = mxfp4_shapes((shape[0], shape[1]))
                for buf, bname in mxfp4_expert_names(name).items():
                    out[checkpoint_name(bname)] = ("U8", shapes[buf], name, buf)
            else:
                out[checkpoint_name(name)] = (expert_dtype, shape, name, None)
            continue
        dtype = "F32" if name.endswith(_F32_SUFFIXES) else float_dtype
        out[checkpoint_name(name, res_spelling)] = (dtype, shape, name, None)
    for name, shape in VISION_TENSORS.items():
        out[name] = (float_dtype, shape, name, None)
    return out


def k3_config_json(hf: dict, quantization_config: dict | None) -> dict:
    """A K3 config.json whose text_config carries `quantization_config` (or none when None)."""
    out = dict(hf)
    text = dict(out["text_config"])
    out.pop("quantization_config", None)
    text.pop("quantization_config", None)
    if quantization_config is not None:
        text["quantization_config"] = quantization_config
    out["text_config"] = text
    return out
