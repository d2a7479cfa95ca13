"""Model configuration parsed from a Hugging Face `config.json`.

Two model types are understood: `kimi_linear` (flat keys) and `kimi_k3` (the text model's
keys under `text_config`). The 1-based `kda_layers` / `full_attn_layers` lists become a
0-based tuple of layer kinds ("kda" or "mla"). KDA and MLA variants are read off the keys
(FACTS.md): `gate_lower_bound` selects the lower-bound sigmoid decay gate,
`use_full_rank_gate` the full-rank output gate, `mla_use_output_gate` the MLA output gate,
and a non-null `q_lora_rank` the factorised MLA query. K3 adds AttnRes
(`attn_res_block_size`), a latent MoE (`routed_expert_hidden_size`, `latent_moe_use_norm`),
SiTU (`activation_situ_beta`, `activation_situ_linear_beta`) and a compressed-tensors
`quantization_config` whose `mxfp4-pack-quantized` routed experts set `expert_quant`.

Presets ship as JSON files in `waste/presets/` in the same Hugging Face form.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from waste.errors import ConfigError

MODEL_TYPES = ("kimi_linear", "kimi_k3")
PRESETS = ("tiny", "mini", "kimi-linear-48b-a3b", "k3", "k3-tiny", "k3-mini")
MXFP4_FORMAT = "mxfp4-pack-quantized"
MXFP4_GROUP = 32  # weights sharing one E8M0 scale
# A routed expert's module name, as compressed-tensors' targets and ignore patterns see it.
# A routed expert's projection as compressed-tensors names the module it quantises or ignores.
_EXPERT_MODULE = "language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{part}"
# A sanity bound that keeps a corrupt config from allocating per-layer tables without end.
MAX_LAYERS = 10_000


@dataclass(frozen=True)
class ModelConfig:
    """Everything the workbench needs to know about one model's shape."""

    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    layer_kinds: tuple[str, ...]  # [L] "kda" | "mla", 0-based
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel: int
    kda_gate: str  # "softplus" (Kimi-Linear) | "lower_bound" (K3)
    gate_lower_bound: float | None
    kda_full_rank_gate: bool
    # MLA
    mla_num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_nope: bool
    mla_output_gate: bool
    kv_layernorm_eps: float
    # FFN
    intermediate_size: int
    first_k_dense_replace: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int | None
    routed_scaling_factor: float
    moe_renormalize: bool
    num_expert_group: int
    topk_group: int
    hidden_act: str
    situ_beta: float | None  # SiTU gate beta (None means 1.0)
    situ_linear_beta: float | None  # SiTU linear-branch beta (None: the plain up projection)
    attn_res_block_size: int | None  # AttnRes: layers per block (None: plain residual stream)
    latent_moe_use_norm: bool  # RMSNorm on the latent before routed_expert_up_proj
    expert_quant: str | None  # "mxfp4" when the checkpoint's routed experts are MXFP4, else None
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    raw: dict[str, Any] = field(compare=False, repr=False)

    @property
    def kda_layers(self) -> list[int]:
        """0-based indices of the KDA layers."""
        return [i for i, kind in enumerate(self.layer_kinds) if kind == "kda"]

    @property
    def mla_layers(self) -> list[int]:
        """0-based indices of the MLA layers."""
        return [i for i, kind in enumerate(self.layer_kinds) if kind == "mla"]

    @property
    def moe_layers(self) -> list[int]:
        """0-based indices of the layers whose FFN is a routed MoE."""
        return list(range(self.first_k_dense_replace, self.num_layers))

    @property
    def kda_proj_size(self) -> int:
        """H*K: width of each of the q, k, v projections of a KDA layer."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def mla_latent_size(self) -> int:
        """Values cached per token per MLA layer: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def expert_input_size(self) -> int:
        """Width the routed experts read: hidden, or the latent width of a latent MoE."""
        return self.routed_expert_hidden_size or self.hidden_size

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face config.json this was parsed from."""
        return json.loads(json.dumps(self.raw))

    def summary(self) -> dict[str, Any]:
        """Parsed fields as plain JSON-able values (without the raw dict)."""
        d = asdict(self)
        d.pop("raw")
        d["layer_kinds"] = list(self.layer_kinds)
        return d


class _Keys:
    """Typed reads from one JSON object, with errors naming the full key path."""

    def __init__(self, d: Any, where: str):
        if not isinstance(d, dict):
            raise ConfigError(f"config: {where or 'top level'} must be a JSON object")
        self.d = d
        self.where = where

    def _path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def has(self, key: str) -> bool:
        return key in self.d and self.d[key] is not None

    def int(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"config key {self._path(key)!r}: expected an integer, got {v!r}")
        if v < minimum:
            raise ConfigError(f"config key {self._path(key)!r}: expected an integer >= {minimum}, got {v}")
        return v

    def opt_int(self, key: str, *, minimum: int = 1) -> int | None:
        return self.int(key, minimum=minimum) if self.has(key) else None

    def opt_token_id(self, key: str, vocab_size: int) -> int | None:
        """A special token's id, if given: one of the vocabulary's (a chat would otherwise wait for
        an end-of-turn id no logit can produce)."""
        v = self.opt_int(key, minimum=0)
        if v is not None and v >= vocab_size:
            raise ConfigError(f"config key {self._path(key)!r}: token id {v} is outside the vocabulary "
                              f"(vocab_size {vocab_size})")
        return v

    def float(self, key: str, default: float | None = None) -> float:
        v = self._get(key, default)
        try:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError
        except (ValueError, OverflowError):
            raise ConfigError(f"config key {self._path(key)!r}: expected a finite number, got {v!r:.40}") from None
        return float(v)

    def positive_float(self, key: str, default: float | None = None) -> float:
        v = self.float(key, default)
        if v <= 0:
            raise ConfigError(f"config key {self._path(key)!r}: expected a positive number, got {v}")
        return v

    def opt_positive_float(self, key: str) -> float | None:
        return self.positive_float(key) if self.has(key) else None

    def bool(self, key: str, default: bool | None = None) -> bool:
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise ConfigError(f"config key {self._path(key)!r}: expected true or false, got {v!r}")
        return v

    def str(self, key: str, default: str | None = None) -> str:
        v = self._get(key, default)
        if not isinstance(v, str):
            raise ConfigError(f"config key {self._path(key)!r}: expected a string, got {v!r}")
        return v

    def obj(self, key: str) -> _Keys:
        return _Keys(self._get(key, None), self._path(key))

    def str_list(self, key: str) -> list[str]:
        v = self._get(key, None)
        if not isinstance(v, list) or not all(isinstance(i, str) for i in v):
            raise ConfigError(f"config key {self._path(key)!r}: expected a list of strings, got {v!r:.60}")
        return v

    def int_list(self, key: str) -> list[int]:
        v = self._get(key, None)
        if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
            raise ConfigError(f"config key {self._path(key)!r}: expected a list of integers, got {v!r}")
        return v

    def _get(self, key: str, default: Any) -> Any:
        if key in self.d and self.d[key] is not None:
            return self.d[key]
        if default is not None:
            return default
        raise ConfigError(f"config key {self._path(key)!r} is missing")


def _layer_kinds(num_layers: int, kda_1based: list[int], mla_1based: list[int], where: str) -> tuple[str, ...]:
    kinds: list[str | None] = [None] * num_layers
    for name, layers, kind in (("kda_layers", kda_1based, "kda"), ("full_attn_layers", mla_1based, "mla")):
        for layer in layers:
            if not 1 <= layer <= num_layers:
                raise ConfigError(
                    f"config key {where}.{name!r}: layer {layer} is outside 1..{num_layers} (the lists are 1-based)"
                )
            if kinds[layer - 1] is not None:
                raise ConfigError(f"config key {where}.{name!r}: layer {layer} is listed twice")
            kinds[layer - 1] = kind
    missing = [i + 1 for i, k in enumerate(kinds) if k is None]
    if missing:
        raise ConfigError(
            f"config keys {where}.kda_layers and full_attn_layers must partition layers 1..{num_layers}; "
            f"missing {missing}"
        )
    return tuple(k for k in kinds if k is not None)


def _matches(patterns: list[str], module: str) -> bool:
    """compressed-tensors matching: "re:<regex>" matched from the start, else a class name or module name."""
    for p in patterns:
        if p.startswith("re:"):
            try:
                if re.match(p[3:], module):
                    return True
            except re.error:
                raise ConfigError(f"config: quantization pattern {p!r} is not a valid regular expression") from None
        elif p in ("Linear", module, module.removeprefix("language_model.")):
            return True
    return False


def _expert_modules(moe_layers: range, num_experts: int) -> list[str]:
    """The routed-expert modules whose quantisation is compared: w1, w2 and w3 of the first and the
    last expert of every MoE layer, and w1 of every expert of the first MoE layer (a pattern that
    singles out a layer, a projection or an expert shows there)."""
    ends = sorted({0, num_experts - 1})
    names = [_EXPERT_MODULE.format(layer=layer, expert=e, part=part)
             for layer in moe_layers for e in ends for part in ("w1", "w2", "w3")]
    names += [_EXPERT_MODULE.format(layer=moe_layers[0], expert=e, part="w1") for e in range(num_experts)]
    return names


def _expert_quant(c: _Keys, moe_layers: range, num_experts: int) -> str | None:
    """"mxfp4" when the quantization_config quantises the routed experts as mxfp4-pack-quantized.

    The config sits under text_config (K3) or at the top; the format may be given per group or
    once for all groups. Any other format, or MXFP4 with other bits or group size, is refused,
    and so is an `ignore` list that exempts some routed experts but not others: a container
    stores every routed expert in one format.
    """
    if not c.has("quantization_config"):
        return None
    q = c.obj("quantization_config")
    method = q.str("quant_method", "compressed-tensors")
    if method != "compressed-tensors":
        raise ConfigError(f"config key {q._path('quant_method')!r}: expected 'compressed-tensors', got {method!r}")
    ignore = q.str_list("ignore") if q.has("ignore") else []
    groups = q.obj("config_groups")
    quantised: dict[str, bool] = dict.fromkeys(_expert_modules(moe_layers, num_experts) if moe_layers else [], False)
    for gname in groups.d:
        g = groups.obj(gname)
        fmt = g.str("format") if g.has("format") else q.str("format")
        if fmt != MXFP4_FORMAT:
            raise ConfigError(f"config key {g._path('format')!r}: expected {MXFP4_FORMAT!r}, got {fmt!r}")
        w = g.obj("weights")
        bits, group = w.int("num_bits"), w.int("group_size", MXFP4_GROUP)
        if bits != 4 or group != MXFP4_GROUP or w.str("type", "float") != "float":
            raise ConfigError(f"config key {w.where!r}: {MXFP4_FORMAT} needs num_bits 4, group_size "
                              f"{MXFP4_GROUP}, type float")
        targets = g.str_list("targets")
        for module in quantised:
            quantised[module] = quantised[module] or (_matches(targets, module) and not _matches(ignore, module))
    packed = [m for m, q in quantised.items() if q]
    kept = [m for m, q in quantised.items() if not q]
    if packed and kept:
        raise ConfigError(f"config key {q._path('ignore')!r}: quantises some routed experts and not others "
                          f"({packed[0]} is {MXFP4_FORMAT}, {kept[0]} is not); waste stores every routed expert "
                          "in one format")
    return "mxfp4" if packed else None


def parse_config(hf: dict[str, Any]) -> ModelConfig:
    """Parse a Hugging Face config dict (kimi_linear or kimi_k3) into a ModelConfig."""
    top = _Keys(hf, "")
    model_type = top.str("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"config key 'model_type': expected one of {', '.join(MODEL_TYPES)}, got {model_type!r}")
    c = top.obj("text_config") if model_type == "kimi_k3" else top
    la = c.obj("linear_attn_config")
    num_layers = c.int("num_hidden_layers")
    if num_layers > MAX_LAYERS:
        raise ConfigError(f"config key 'num_hidden_layers': {num_layers} is more than {MAX_LAYERS}")
    kinds = _layer_kinds(num_layers, la.int_list("kda_layers"), la.int_list("full_attn_layers"), la.where)
    lower_bound = la.float("gate_lower_bound") if la.has("gate_lower_bound") else None
    if lower_bound is not None and lower_bound >= 0:
        raise ConfigError(f"config key {la.where}.'gate_lower_bound': expected a negative number, got {lower_bound}")
    num_experts = c.int("num_experts")
    top_k = c.int("num_experts_per_token") if c.has("num_experts_per_token") else c.int("num_experts_per_tok")
    if top_k > num_experts:
        raise ConfigError(f"config key 'num_experts_per_token': {top_k} exceeds num_experts {num_experts}")
    n_group = c.int("num_expert_group", 1)
    topk_group = c.int("topk_group", 1)
    if num_experts % n_group or topk_group > n_group:
        raise ConfigError(
            f"config keys 'num_expert_group'/'topk_group': {num_experts} experts cannot form {n_group} groups "
            f"keeping {topk_group}"
        )
    first_dense = c.int("first_k_dense_replace", 0, minimum=0)
    if first_dense > num_layers:
        raise ConfigError(f"config key 'first_k_dense_replace': {first_dense} exceeds num_hidden_layers {num_layers}")
    activation = c.str("moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise ConfigError(f"config key 'moe_router_activation_func': expected 'sigmoid', got {activation!r}")
    hidden_act = c.str("hidden_act", "silu")
    if hidden_act not in ("silu", "situ"):
        raise ConfigError(f"config key 'hidden_act': expected 'silu' or 'situ', got {hidden_act!r}")
    max_pos = c.int("max_position_embeddings") if c.has("max_position_embeddings") else c.int("model_max_length")
    use_nope = c.bool("mla_use_nope", False)
    if "mla" in kinds and not use_nope:
        # Kimi's MLA layers carry no position encoding (FACTS.md); the engine and the oracle
        # implement only that, so a RoPE config would run wrongly rather than fail.
        raise ConfigError("config key 'mla_use_nope': waste implements NoPE MLA only (mla_use_nope: true); "
                          "this config asks for rotary position embeddings in its MLA layers")
    latent = c.opt_int("routed_expert_hidden_size")
    expert_quant = _expert_quant(c if c.has("quantization_config") else top, range(first_dense, num_layers),
                                 num_experts)
    if expert_quant == "mxfp4":
        moe_inter = c.int("moe_intermediate_size")
        for key, width in (("routed_expert_hidden_size" if latent else "hidden_size", latent or c.int("hidden_size")),
                           ("moe_intermediate_size", moe_inter)):
            if width % MXFP4_GROUP:
                raise ConfigError(f"config key {c._path(key)!r}: {width} is not a multiple of {MXFP4_GROUP}, "
                                  "which MXFP4 routed experts need")
    return ModelConfig(
        model_type=model_type,
        hidden_size=c.int("hidden_size"),
        num_layers=num_layers,
        vocab_size=c.int("vocab_size"),
        rms_norm_eps=c.positive_float("rms_norm_eps"),
        max_position_embeddings=max_pos,
        layer_kinds=kinds,
        kda_num_heads=la.int("num_heads"),
        kda_head_dim=la.int("head_dim"),
        short_conv_kernel=la.int("short_conv_kernel_size", minimum=2),
        kda_gate="lower_bound" if lower_bound is not None else "softplus",
        gate_lower_bound=lower_bound,
        kda_full_rank_gate=la.bool("use_full_rank_gate", False),
        mla_num_heads=c.int("num_attention_heads"),
        q_lora_rank=c.opt_int("q_lora_rank"),
        kv_lora_rank=c.int("kv_lora_rank"),
        qk_nope_head_dim=c.int("qk_nope_head_dim"),
        qk_rope_head_dim=c.int("qk_rope_head_dim", minimum=0),
        v_head_dim=c.int("v_head_dim"),
        mla_use_nope=use_nope,
        mla_output_gate=c.bool("mla_use_output_gate", False),
        kv_layernorm_eps=1e-6,
        intermediate_size=c.int("intermediate_size"),
        first_k_dense_replace=first_dense,
        num_experts=num_experts,
        num_experts_per_token=top_k,
        num_shared_experts=c.int("num_shared_experts", 0, minimum=0),
        moe_intermediate_size=c.int("moe_intermediate_size"),
        routed_expert_hidden_size=latent,
        routed_scaling_factor=c.positive_float("routed_scaling_factor", 1.0),
        moe_renormalize=c.bool("moe_renormalize", True),
        num_expert_group=n_group,
        topk_group=topk_group,
        hidden_act=hidden_act,
        situ_beta=c.opt_positive_float("activation_situ_beta"),
        situ_linear_beta=c.opt_positive_float("activation_situ_linear_beta"),
        attn_res_block_size=c.opt_int("attn_res_block_size"),
        latent_moe_use_norm=latent is not None and c.bool("latent_moe_use_norm", False),
        expert_quant=expert_quant,
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        bos_token_id=c.opt_token_id("bos_token_id", c.int("vocab_size")),
        eos_token_id=c.opt_token_id("eos_token_id", c.int("vocab_size")),
        pad_token_id=c.opt_token_id("pad_token_id", c.int("vocab_size")),
        raw=hf,
    )


def preset_dict(name: str) -> dict[str, Any]:
    """The Hugging Face config dict of a shipped preset."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
    text = resources.files("waste.presets").joinpath(f"{name}.json").read_text()
    return json.loads(text)


def load_preset(name: str) -> ModelConfig:
    """A shipped preset as a ModelConfig."""
    return parse_config(preset_dict(name))


def load_config_file(path: str | Path) -> ModelConfig:
    """Parse a config.json file (or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        hf = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from None
    return parse_config(hf)
