"""One KDA (Kimi Delta Attention) layer of a Kimi model: prefill a chunk, decode one token.

    q, k, v = SiLU(conv4(W x))                      conv rings keep the last kernel-1 inputs
    g = gate(W_fb W_fa x)                           softplus (Kimi-Linear) or lower-bound (K3)
    beta = sigmoid(W_b x)
    o, S = KDA(q, k, v, g, beta, S)                 waste.kernels.kda
    y = W_o (RMSNorm_head(o) * sigmoid(W_gb W_ga x  |  W_g x))

Input x is the layer input after input_layernorm; y is what the block adds to the residual
stream. Shapes: x [T, hidden]; q, k, v, g [T, H, K] (V = K = head_dim); state [H, K, V].
Weights come through `get_matrix` (QMatrix, any storage format) and `get_tensor` (float32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from waste.config import ModelConfig
from waste.errors import WasteError
from waste.jit import num_threads
from waste.kernels.bf16 import DENSE_FORMATS, dense_operand, operand_buffer, operand_mode
from waste.kernels.dense_batch import dense_products, dense_table
from waste.kernels.kda import (
    _gate_kernel,
    _gated_rmsnorm_kernel,
    a_log_per_head,
    gated_rmsnorm,
    kda_gate_lower_bound,
    kda_gate_softplus,
)
from waste.kernels.kda_chunk import prefill_kda
from waste.kernels.kda_decode import _deferred_decode_kernel, apply_pending, kda_scale, new_state
from waste.kernels.kda_step import kda_decode_step, kda_decode_step_dense, sigmoid_into
from waste.kernels.qbatch import QBatch, batchable
from waste.kernels.quant import Q_FORMATS, QMatrix, matmul_pair
from waste.kernels.same_input import SameInput
from waste.kernels.short_conv import _conv_step_kernel, conv_taps, short_conv_silu

GetMatrix = Callable[[str], QMatrix]
GetTensor = Callable[[str], np.ndarray]


def _matvec_pair(x: np.ndarray, a: QMatrix, b: QMatrix) -> tuple[np.ndarray, np.ndarray]:
    """(a x, b x) for x [K]: one kernel call for two q matrices of one format and shape (the
    same bits as two matvecs, and a decoded token makes many such small products)."""
    if a.fmt == b.fmt and a.fmt in ("q8g", "q4g") and a.shape == b.shape:
        ya, yb = matmul_pair(x[None, :], a, b)
        return ya[0], yb[0]
    return a.matvec(x), b.matvec(x)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """sigmoid of a float32 array, by the decode step's own kernel (so prefill's betas round alike)."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    sigmoid_into(x.reshape(-1), out.reshape(-1))
    return out


@dataclass
class KDAState:
    """Session state of one KDA layer.

    Decoding leaves each token's rank-1 update pending for the next token's single pass over
    the state (`kda_decode_step_deferred`), so the recurrent state is base + pending_k
    pending_d^T. Read it through `recurrent`, which folds the pending update in first; that
    rounds exactly as the next step would, so reading never changes later bits.
    """

    base: np.ndarray  # [H, K, V] float32, row-major by K
    conv: np.ndarray  # [3, kernel-1, H*K] float32: last inputs of the q, k, v convs, oldest first
    pending_k: np.ndarray  # [H, K] float32
    pending_d: np.ndarray  # [H, V] float32
    has_pending: bool = False

    @classmethod
    def zeros(cls, H: int, K: int, conv_shape: tuple[int, int, int]) -> KDAState:
        return cls(new_state(H, K, K), np.zeros(conv_shape, np.float32),
                   np.zeros((H, K), np.float32), np.zeros((H, K), np.float32))

    @property
    def recurrent(self) -> np.ndarray:
        """The recurrent state [H, K, V] (after folding in any pending update; writable)."""
        if self.has_pending:
            apply_pending(self.base, self.pending_k, self.pending_d)
            self.has_pending = False
        return self.base

    def copy(self) -> KDAState:
        base = new_state(*self.base.shape)  # cache-line aligned, as the decode step wants
        base[...] = self.base
        return KDAState(base, self.conv.copy(), self.pending_k.copy(), self.pending_d.copy(),
                        self.has_pending)

    @property
    def nbytes(self) -> int:
        return int(self.base.nbytes + self.conv.nbytes + self.pending_k.nbytes + self.pending_d.nbytes)


class KDALayer:
    """KDA attention: `prefill` for a chunk, `decode` for one token; both advance the state in place."""

    def __init__(self, cfg: ModelConfig, *, qkv: tuple[QMatrix, QMatrix, QMatrix], conv_weights: list[np.ndarray],
                 a_log: np.ndarray, dt_bias: np.ndarray, f_a: QMatrix, f_b: QMatrix, b_proj: QMatrix,
                 gate: tuple[QMatrix, ...], o_norm: np.ndarray, o_proj: QMatrix):
        self.H = cfg.kda_num_heads
        self.K = cfg.kda_head_dim
        self.W = cfg.short_conv_kernel
        self.eps = float(cfg.rms_norm_eps)
        self.lower_bound = cfg.gate_lower_bound if cfg.kda_gate == "lower_bound" else None
        self.qkv = qkv
        self.taps3 = np.stack([conv_taps(w) for w in conv_weights])  # [3, W, H*K]: the decode step's one conv call
        self.taps = list(self.taps3)  # 3 x [W, H*K]
        self.a_log = a_log_per_head(a_log, self.H)  # [H]
        self.dt_bias = np.ascontiguousarray(dt_bias, np.float32).reshape(-1)  # [H*K]
        self.f_a, self.f_b, self.b_proj = f_a, f_b, b_proj
        self.gate = gate  # (g_a, g_b) low rank, or (g_proj,) full rank
        self.o_norm = np.ascontiguousarray(o_norm, np.float32).reshape(-1)  # [K]
        self.o_proj = o_proj
        # A decode step's products in two kernel calls: the six that read x (q, k, v, f_a, the
        # gate's first, b), then the two of rank K (f_b, g_b); QBatch for q formats.
        first, second = [*qkv, f_a, gate[0], b_proj], [f_b, *gate[1:]]
        # A chunk's six products of x in one call (q, k, v, f_a, b, the gate's first).
        self._prefill_products = SameInput([*qkv, f_a, b_proj, gate[0]])
        self._decode_batches = (QBatch(first), QBatch(second)) if batchable(first) and batchable(second) else None
        # f32 or bf16 weights, all of one format: the same two calls through dense_products.
        one_dense_format = len({m.fmt for m in first + second}) == 1 and first[0].fmt in DENSE_FORMATS
        self._dense_decode = (first, second) if one_dense_format else None
        # What the decode step's kernels take, derived once (its public wrappers derive it per
        # call, about 5 us each): exp(A_log) as the gate kernel computes it, dt_bias per head.
        self._gate_a = np.exp(self.a_log.astype(np.float64)).astype(np.float32)  # [H]
        self._gate_bias = self.dt_bias.reshape(self.H, self.K)  # [H, K]
        self._scale = kda_scale(None, self.K)
        self._x_rows = np.zeros(len(first), np.int64)  # [6]: every product of the first call reads x
        self._mid_rows = np.arange(len(second), dtype=np.int64)  # f_b reads f, g_b the gate's low rank
        # With every product in a q format, or every weight f32 or every one bf16, the whole step
        # is one call (waste.kernels.kda_step): its arguments that do not change from token to token.
        self._step_args: tuple[Any, ...] | None = None
        self._dense_step_args: tuple[Any, ...] | None = None
        if self._dense_decode is not None and o_proj.fmt == first[0].fmt:
            fmt = o_proj.fmt
            self._dense_step_args = (
                (self._x_rows, dense_table(first), first[0].buffers["w"][:0], self._mid_rows, dense_table(second),
                 second[0].buffers["w"][:0], operand_mode(fmt), operand_buffer(fmt, len(second), self.K),
                 len(gate) == 2, self.taps3),
                (self._gate_a, self._gate_bias, 0.0 if self.lower_bound is None else float(self.lower_bound),
                 self._scale, True),
                (self.o_norm, self.eps, o_proj.buffers["w"]),
            )
        if self._decode_batches is not None and o_proj.fmt in Q_FORMATS:
            a, b = self._decode_batches
            qs, scales, tscale, _, no_qs, no_scales = o_proj._qargs
            self._step_args = (
                (self._x_rows, a.table, a.tscales, a.first_format, *a.likes,
                 self._mid_rows, b.table, b.tscales, b.first_format, *b.likes, len(gate) == 2, self.taps3),
                (self._gate_a, self._gate_bias, 0.0 if self.lower_bound is None else float(self.lower_bound),
                 self._scale, True),
                (self.o_norm, self.eps, qs, scales, tscale, no_qs, no_scales),
            )

    @classmethod
    def from_weights(cls, cfg: ModelConfig, get_matrix: GetMatrix, get_tensor: GetTensor, prefix: str) -> KDALayer:
        """Build from a container; prefix like 'model.layers.3.self_attn.'."""
        H, K, W, hidden = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel, cfg.hidden_size
        HK = H * K

        def matrix(name: str, shape: tuple[int, int]) -> QMatrix:
            m = get_matrix(prefix + name)
            if tuple(m.shape) != shape:
                raise WasteError(f"{prefix}{name}: expected shape {list(shape)}, got {list(m.shape)}")
            return m

        def tensor(name: str, size: int) -> np.ndarray:
            t = np.asarray(get_tensor(prefix + name), np.float32)
            if t.size != size:
                raise WasteError(f"{prefix}{name}: expected {size} values, got shape {list(t.shape)}")
            return t

        if cfg.kda_full_rank_gate:
            gate: tuple[QMatrix, ...] = (matrix("g_proj.weight", (HK, hidden)),)
        else:
            gate = (matrix("g_a_proj.weight", (K, hidden)), matrix("g_b_proj.weight", (HK, K)))
        a_log = np.asarray(get_tensor(prefix + "A_log"), np.float32)
        if a_log.size < H or np.any(a_log.reshape(-1)[H:]):  # as convert accepts it (format.shape_accepted)
            raise WasteError(f"{prefix}A_log: expected {H} values (or more, zero past {H}), got shape "
                             f"{list(a_log.shape)}")
        return cls(
            cfg,
            qkv=tuple(matrix(f"{n}_proj.weight", (HK, hidden)) for n in "qkv"),  # type: ignore[arg-type]
            conv_weights=[tensor(f"{n}_conv1d.weight", HK * W).reshape(HK, 1, W) for n in "qkv"],
            a_log=a_log,
            dt_bias=tensor("dt_bias", HK),
            f_a=matrix("f_a_proj.weight", (K, hidden)),
            f_b=matrix("f_b_proj.weight", (HK, K)),
            b_proj=matrix("b_proj.weight", (H, hidden)),
            gate=gate,
            o_norm=tensor("o_norm.weight", K),
            o_proj=matrix("o_proj.weight", (hidden, HK)),
        )

    def new_state(self) -> KDAState:
        """Zero recurrent state and zero conv history."""
        return KDAState.zeros(self.H, self.K, (3, self.W - 1, self.H * self.K))

    def _decay(self, z: np.ndarray) -> np.ndarray:
        """z [T, H*K] -> g [T, H, K] (log space)."""
        if self.lower_bound is None:
            return kda_gate_softplus(z, self.a_log, self.dt_bias, num_heads=self.H)
        return kda_gate_lower_bound(z, self.a_log, self.dt_bias, self.lower_bound, num_heads=self.H)

    def _check_state(self, state: KDAState) -> None:
        H, K, HK = self.H, self.K, self.H * self.K
        # The decode step's kernels index these arrays unchecked.
        arrays = ((state.base, (H, K, K)), (state.conv, (3, self.W - 1, HK)), (state.pending_k, (H, K)),
                  (state.pending_d, (H, K)))
        if not all(a.shape == shape and a.dtype == np.float32 and a.flags.c_contiguous for a, shape in arrays):
            raise WasteError(f"KDA state does not fit this layer: recurrent {state.base.shape}, "
                             f"conv {state.conv.shape}, pending {state.pending_k.shape} and {state.pending_d.shape}; "
                             "expected contiguous "
                             f"float32 {(H, K, K)}, {(3, self.W - 1, HK)}, {(H, K)} and {(H, K)}")

    def prefill(self, x: np.ndarray, state: KDAState) -> np.ndarray:
        """A chunk x [T, hidden] -> y [T, hidden]; advances `state` past the chunk."""
        x = np.ascontiguousarray(x, np.float32)
        if x.ndim != 2:
            raise WasteError(f"KDA prefill input must be [T, hidden], got shape {x.shape}")
        self._check_state(state)
        T, H, K = x.shape[0], self.H, self.K
        *qkv, f, b, gate = self._prefill_products(x)
        q, k, v = (short_conv_silu(y, taps, state.conv[i]).reshape(T, H, K)
                   for i, (y, taps) in enumerate(zip(qkv, self.taps, strict=True)))
        g = self._decay(self.f_b.matmul(f))
        beta = _sigmoid(b)
        o, final = prefill_kda(q, k, v, g, beta, initial_state=state.recurrent)
        state.recurrent[...] = final
        o = gated_rmsnorm(o, gate if len(self.gate) == 1 else self.gate[1].matmul(gate), self.o_norm, self.eps)
        return self.o_proj.matmul(o.reshape(T, H * K))

    def _batch_products(self, which: int, X: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The first (which 0) or second (1) batch of a decode step's products on rows of X [R, K]
        -> [M, W], in one call: QBatch for q formats, dense_products for f32 or bf16."""
        if self._decode_batches is not None:
            return self._decode_batches[which](X, rows)
        return dense_products(X, self._dense_decode[which], rows)  # type: ignore[index]

    def _decode_products(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """x [hidden] -> (q, k, v projections [3, H*K], f_b f_a x [H*K], the output gate [H*K]
        before the sigmoid, b x [H]); each product the bits of its matvec."""
        H, HK = self.H, self.H * self.K
        if self._decode_batches is not None or self._dense_decode is not None:
            y = self._batch_products(0, x[None, :], self._x_rows)  # [6, W]: q, k, v, f_a x, gate_a x (or g x), b x
            low = np.ascontiguousarray(y[3:3 + len(self._mid_rows), :self.K])
            mid = self._batch_products(1, low, self._mid_rows)  # [1 or 2, W]: f_b f, g_b gate_a
            gate = mid[1, :HK] if len(self.gate) == 2 else y[4, :HK]
            return y[:3, :HK], mid[0, :HK], gate, y[5, :H]
        qkv = np.empty((3, HK), np.float32)
        qkv[0], qkv[1] = _matvec_pair(x, self.qkv[0], self.qkv[1])
        qkv[2] = self.qkv[2].matvec(x)
        if len(self.gate) == 2:
            f, gate = _matvec_pair(x, self.f_a, self.gate[0])
            gate = self.gate[1].matvec(gate)
        else:
            f, gate = self.f_a.matvec(x), self.gate[0].matvec(x)
        return qkv, self.f_b.matvec(f), gate, self.b_proj.matvec(x)

    def _decode(self, x: np.ndarray, state: KDAState) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One token: the kernels of short_conv_silu_step, kda_gate_*, kda_decode_step_deferred and
        gated_rmsnorm called directly on arrays of the types those wrappers pass (so the same
        compiled code and the same bits), their shapes fixed at load and by _check_state."""
        x = np.ascontiguousarray(x, np.float32).reshape(-1)
        if x.shape[0] != self.o_proj.shape[0]:
            raise WasteError(f"KDA decode input must have {self.o_proj.shape[0]} values, got {x.shape[0]}")
        self._check_state(state)
        H, K = self.H, self.K
        if self._step_args is not None:
            products, gates, output = self._step_args
            y = np.empty((1, self.o_proj._qargs[3]), np.float32)
            g = np.empty((H, K), np.float32)
            beta = np.empty(H, np.float32)
            kda_decode_step(x[None, :], *products, state.conv, *gates, state.base, state.pending_k, state.pending_d,
                            *output, y, g, beta, num_threads())
            state.has_pending = True
            return y[0, :self.o_proj.shape[0]], g, beta
        if self._dense_step_args is not None:
            products, gates, (o_norm, eps, o_w) = self._dense_step_args
            fmt = self.o_proj.fmt
            y = np.empty((1, self.o_proj.shape[0]), np.float32)
            g = np.empty((H, K), np.float32)
            beta = np.empty(H, np.float32)
            kda_decode_step_dense(dense_operand(x[None, :], fmt), *products, state.conv, *gates, state.base,
                                  state.pending_k, state.pending_d, o_norm, eps, o_w, operand_buffer(fmt, 1, H * K),
                                  y, g, beta)
            state.has_pending = True
            return y[0], g, beta
        qkv, fb, gate, b = self._decode_products(x)
        qkv = np.ascontiguousarray(qkv)
        conv = np.empty_like(qkv)  # [3, H*K]
        _conv_step_kernel(qkv, self.taps3, state.conv, conv)
        q, k, v = conv.reshape(3, H, K)
        g = np.empty((1, H, K), np.float32)
        lower_bound = 0.0 if self.lower_bound is None else float(self.lower_bound)
        _gate_kernel(np.ascontiguousarray(fb).reshape(1, H, K), self._gate_a, self._gate_bias, lower_bound, g)
        g = g[0]
        beta = _sigmoid(b)
        o = np.empty((H, K), np.float32)
        _deferred_decode_kernel(q, k, v, g, beta, self._scale, True, state.base, state.pending_k, state.pending_d, o)
        state.has_pending = True
        normed = np.empty_like(o)
        _gated_rmsnorm_kernel(o, np.ascontiguousarray(gate).reshape(H, K), self.o_norm, self.eps, normed)
        return self.o_proj.matvec(normed.reshape(H * K)), g, beta

    def decode(self, x: np.ndarray, state: KDAState) -> np.ndarray:
        """One token x [hidden] -> y [hidden]; advances `state` by one token."""
        return self._decode(x, state)[0]

    def inspect_decode(self, x: np.ndarray, state: KDAState) -> dict[str, Any]:
        """`decode` (it advances `state` too) plus what a notebook wants to look at.

        Returns y [hidden], decay = exp(g) [H, K], beta [H], state = copy of the new recurrent state [H, K, V].
        """
        y, g, beta = self._decode(x, state)
        return {"y": y, "decay": np.exp(g), "beta": beta, "state": state.recurrent.copy()}
