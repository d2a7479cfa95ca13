"""One MLA attention layer of a Kimi model, working in the latent space.

The cache keeps, per token, the normalised KV latent (R = kv_lora_rank values) and the shared
rope part of the key (P = qk_rope_head_dim values, unrotated: `mla_use_nope`), 576 values for
the real models. W_UK and W_UV (the key and value halves of kv_b_proj, per head) are prepared
once at load as float32. Decode works in the latent space: W_UK is absorbed into the query,
W_UV applied to the attended latent afterwards. Prefill expands each head's keys and values
from the cache once per call and attends ordinarily (`waste.kernels.mla`), which costs a
third as much per query-key pair.

Query forms: `q_proj` when `q_lora_rank` is null (Kimi-Linear); `q_a_proj` -> `q_a_layernorm`
-> `q_b_proj` otherwise (K3). The K3 output gate (`mla_use_output_gate`) multiplies the
concatenated head outputs by sigmoid(g_proj x), g_proj [H*V, hidden], before o_proj; x is the
layer input (after input_layernorm), as in vLLM's kimi_linear and Moonshot's reference code.

Input x is the layer input after input_layernorm; output y is what the block adds to the
residual stream. Shapes: x [T, hidden]; q [T, H, nope + P]; latent rows [T, R + P].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from waste.config import ModelConfig
from waste.errors import WasteError
from waste.jit import num_threads
from waste.kernels.mla import (
    DECODE_BLOCK,
    decode_ranges,
    heads_dot,
    heads_times,
    mla_decode,
    mla_prefill,
    output_gate,
)
from waste.kernels.mla_step import mla_decode_step
from waste.kernels.norm import rms_norm
from waste.kernels.qbatch import QBatch, batchable
from waste.kernels.quant import Q_FORMATS, QMatrix

GetMatrix = Callable[[str], QMatrix]
GetTensor = Callable[[str], np.ndarray]


@dataclass
class MLACache:
    """Latent cache of one MLA layer: rows 0..length-1 of `latent` [capacity, R + P] are filled."""

    latent: np.ndarray  # [capacity, R + P] float32
    length: int = 0

    @property
    def capacity(self) -> int:
        return int(self.latent.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the filled part (length * (R + P) * 4)."""
        return self.length * int(self.latent.shape[1]) * self.latent.itemsize

    def copy(self) -> MLACache:
        return MLACache(self.latent.copy(), self.length)


class MLALayer:
    """MLA over the latent cache: `prefill` for many tokens (expanded), `decode` for one (absorbed)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        q_proj: QMatrix | None,
        q_a_proj: QMatrix | None,
        q_a_norm: np.ndarray | None,
        q_b_proj: QMatrix | None,
        kv_a_proj: QMatrix,
        kv_a_norm: np.ndarray,
        kv_b: np.ndarray,
        o_proj: QMatrix,
        g_proj: QMatrix | None,
    ):
        self.H = cfg.mla_num_heads
        self.nope = cfg.qk_nope_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.R = cfg.kv_lora_rank
        self.eps = cfg.kv_layernorm_eps
        self.scale = float((self.nope + self.rope) ** -0.5)
        self.q_proj, self.q_a_proj, self.q_a_norm, self.q_b_proj = q_proj, q_a_proj, q_a_norm, q_b_proj
        self.kv_a_proj, self.kv_a_norm = kv_a_proj, kv_a_norm
        self.o_proj, self.g_proj = o_proj, g_proj
        w = np.asarray(kv_b, np.float32).reshape(self.H, self.nope + self.v_dim, self.R)
        self.w_uk = np.ascontiguousarray(w[:, : self.nope, :])  # [H, nope, R]: latent -> key, q_nope -> latent
        self.w_uv = np.ascontiguousarray(w[:, self.nope :, :])  # [H, V, R]: latent -> value
        self.attention_weights_last: np.ndarray | None = None  # [H, ctx] of the last decode
        # Every product in a q format: the whole decode step is one call (waste.kernels.mla_step),
        # with these arguments that do not change. The products of x (the query's or q_a_proj,
        # kv_a_proj, g_proj) in one batch.
        self._step_args: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None
        of_x = [q_proj if q_proj is not None else q_a_proj, kv_a_proj, *([g_proj] if g_proj is not None else [])]
        if (batchable(of_x) and o_proj.fmt in Q_FORMATS
                and (q_b_proj is None or q_b_proj.fmt in Q_FORMATS)):
            batch = QBatch(of_x)
            qs, scales, tscale, _, no_qs, no_scales = o_proj._qargs
            if q_b_proj is not None:
                b_qs, b_scales, b_tscale, _, b_no_qs, b_no_scales = q_b_proj._qargs
                q_norm = np.ascontiguousarray(q_a_norm, np.float32)
            else:  # no second query product: arrays that hold nothing
                b_qs, b_scales, b_tscale, b_no_qs, b_no_scales = no_qs, no_scales, tscale, no_qs, no_scales
                q_norm = np.zeros(0, np.float32)
            self._step_args = (
                (np.zeros(len(of_x), np.int64), batch.table, batch.tscales, batch.first_format, *batch.likes,
                 q_b_proj is not None, q_norm, b_qs, b_scales, b_tscale, b_no_qs, b_no_scales, g_proj is not None,
                 np.ascontiguousarray(kv_a_norm, np.float32), np.float32(self.eps), self.w_uk, self.w_uv),
                (qs, scales, tscale, no_qs, no_scales),
            )
            self._step_batch = batch  # holds the products' matrices: the table has their addresses

    @classmethod
    def from_weights(cls, cfg: ModelConfig, get_matrix: GetMatrix, get_tensor: GetTensor, prefix: str) -> MLALayer:
        """Build from a container; prefix like 'model.layers.3.self_attn.'."""
        H, nope, rope, v_dim, R = (
            cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank,
        )
        q_width = H * (nope + rope)

        def matrix(name: str, shape: tuple[int, int]) -> QMatrix:
            m = get_matrix(prefix + name)
            if tuple(m.shape) != shape:
                raise WasteError(f"{prefix}{name}: expected shape {list(shape)}, got {list(m.shape)}")
            return m

        def vector(name: str, size: int) -> np.ndarray:
            t = np.asarray(get_tensor(prefix + name), np.float32).reshape(-1)
            if t.shape != (size,):
                raise WasteError(f"{prefix}{name}: expected {size} values, got shape {list(t.shape)}")
            return t

        hidden = cfg.hidden_size
        kw: dict[str, Any] = {"q_proj": None, "q_a_proj": None, "q_a_norm": None, "q_b_proj": None, "g_proj": None}
        if cfg.q_lora_rank is None:
            kw["q_proj"] = matrix("q_proj.weight", (q_width, hidden))
        else:
            kw["q_a_proj"] = matrix("q_a_proj.weight", (cfg.q_lora_rank, hidden))
            kw["q_a_norm"] = vector("q_a_layernorm.weight", cfg.q_lora_rank)
            kw["q_b_proj"] = matrix("q_b_proj.weight", (q_width, cfg.q_lora_rank))
        if cfg.mla_output_gate:
            kw["g_proj"] = matrix("g_proj.weight", (H * v_dim, hidden))
        kv_b = matrix("kv_b_proj.weight", (H * (nope + v_dim), R)).dequantize()
        return cls(
            cfg,
            kv_a_proj=matrix("kv_a_proj_with_mqa.weight", (R + rope, hidden)),
            kv_a_norm=vector("kv_a_layernorm.weight", R),
            kv_b=kv_b,
            o_proj=matrix("o_proj.weight", (hidden, H * v_dim)),
            **kw,
        )

    @property
    def latent_size(self) -> int:
        """R + P: values cached per token."""
        return self.R + self.rope

    def new_cache(self, capacity: int) -> MLACache:
        """An empty cache for `capacity` tokens."""
        if capacity < 1:
            raise WasteError(f"MLA cache capacity must be at least 1 token, got {capacity}")
        return MLACache(np.zeros((capacity, self.latent_size), np.float32), 0)

    def _queries(self, x: np.ndarray) -> np.ndarray:
        """x [T, hidden] -> queries [T, H, nope + P]."""
        if self.q_proj is not None:
            q = self.q_proj.matmul(x)
        else:
            q = self.q_b_proj.matmul(rms_norm(self.q_a_proj.matmul(x), self.q_a_norm, self.eps))
        return q.reshape(x.shape[0], self.H, self.nope + self.rope)

    def _absorbed_queries(self, x: np.ndarray) -> np.ndarray:
        """x [T, hidden] -> absorbed queries [T, H, R + P] (W_UK^T q_nope, then q_rope)."""
        q = self._queries(x)
        q_abs = np.empty((x.shape[0], self.H, self.latent_size), np.float32)
        # Per head [T, nope] @ [nope, R] in a kernel whose rows do not depend on T.
        q_abs[:, :, : self.R] = heads_times(q[:, :, : self.nope], self.w_uk)
        q_abs[:, :, self.R :] = q[:, :, self.nope :]
        return q_abs

    def _latents(self, x: np.ndarray) -> np.ndarray:
        """x [T, hidden] -> cache rows [T, R + P]: normalised latent, then the rope part."""
        ckv = self.kv_a_proj.matmul(x)
        ckv[:, : self.R] = rms_norm(ckv[:, : self.R], self.kv_a_norm, self.eps)
        return ckv

    def _output(self, x: np.ndarray, o: np.ndarray) -> np.ndarray:
        """Head outputs o [T, H, V] -> y [T, hidden] through the gate and o_proj."""
        o = o.reshape(o.shape[0], self.H * self.v_dim)
        if self.g_proj is not None:
            o = output_gate(o, self.g_proj.matmul(x))
        return self.o_proj.matmul(np.ascontiguousarray(o, np.float32))

    def _reserve(self, T: int, cache: MLACache) -> int:
        """Room for T new rows at the cache's end -> their first row (the cache's old length)."""
        start = cache.length
        if start + T > cache.capacity:
            raise WasteError(
                f"MLA cache capacity {cache.capacity} tokens exceeded: {start} cached + {T} new tokens"
            )
        return start

    def _append(self, x: np.ndarray, cache: MLACache) -> int:
        T = x.shape[0]
        start = self._reserve(T, cache)
        cache.latent[start : start + T] = self._latents(x)
        cache.length = start + T
        return start

    def prefill(self, x: np.ndarray, cache: MLACache) -> np.ndarray:
        """Append the tokens' latents and attend causally over the cache, in the expanded form:
        x [T, hidden] -> y [T, hidden]. The keys and values of the whole cache are expanded once
        per call, so one call for many tokens costs less than several for fewer."""
        x = np.ascontiguousarray(x, np.float32)
        if x.ndim != 2:
            raise WasteError(f"MLA prefill input must be [T, hidden], got shape {x.shape}")
        q = self._queries(x)
        start = self._append(x, cache)
        o = mla_prefill(q, cache.latent, start, self.scale, self.w_uk, self.w_uv)
        return self._output(x, o)

    def decode(self, x: np.ndarray, cache: MLACache) -> np.ndarray:
        """One token: append its latent and attend over the whole cache, x [hidden] -> y [hidden]."""
        x = np.ascontiguousarray(x, np.float32).reshape(1, -1)
        if self._step_args is not None:
            return self._decode_step(x, cache)
        q_abs = self._absorbed_queries(x)[0]
        self._append(x, cache)
        o_lat, probs = mla_decode(q_abs, cache.latent, cache.length, self.scale, self.R)
        self.attention_weights_last = probs
        return self._output(x, heads_dot(o_lat[None], self.w_uv))[0]

    def _decode_step(self, x: np.ndarray, cache: MLACache) -> np.ndarray:
        """`decode` in one kernel call (`mla_decode_step`): the same kernels, the same bits."""
        hidden = self.o_proj.shape[0]
        if x.shape[1] != self.kv_a_proj.shape[1]:
            raise WasteError(f"MLA decode input must have {self.kv_a_proj.shape[1]} values, got {x.shape[1]}")
        latent = cache.latent  # the kernel indexes it unchecked
        if latent.dtype != np.float32 or latent.shape[1] != self.latent_size or not latent.flags.c_contiguous:
            raise WasteError(f"MLA cache must be C-contiguous float32 [capacity, {self.latent_size}], got "
                             f"{latent.dtype} {latent.shape}")
        n = self._reserve(1, cache) + 1
        before, output = self._step_args  # type: ignore[misc]
        probs = np.empty((self.H, n), np.float32)
        y = np.empty((1, self.o_proj._qargs[3]), np.float32)  # rows padded to 16
        mla_decode_step(x, *before, latent, n, np.float32(self.scale), decode_ranges(n), DECODE_BLOCK, *output, probs,
                        y, num_threads())
        cache.length = n
        self.attention_weights_last = probs
        return y[0, :hidden]

    def inspect_decode(self, x: np.ndarray, cache: MLACache) -> dict[str, np.ndarray]:
        """Decode one token on a copy of the cache (the cache is left unchanged).

        Returns y [hidden], probs [H, ctx] (attention probabilities, ctx = cache.length + 1),
        q_abs [H, R + P] and latent [R + P] (the new token's cache row).
        """
        work = cache.copy()
        y = self.decode(x, work)
        x2 = np.ascontiguousarray(x, np.float32).reshape(1, -1)
        return {
            "y": y,
            "probs": self.attention_weights_last,
            "q_abs": self._absorbed_queries(x2)[0],
            "latent": work.latent[work.length - 1].copy(),
        }
