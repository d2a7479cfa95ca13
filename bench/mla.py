"""MLA attention at the Kimi-Linear-48B shape (the kimi-linear-48b-a3b preset: H = 32, nope 128,
rope 64, V 128, R = 512): prefill in the expanded form against the absorbed form, and decode.

Prefill (issue 13): a `--context`-token prompt (default 4096) through one MLA layer's attention,
from the queries and the cache rows to the head outputs [T, H, V] (the projections around it
are the same in both forms and left out):
- expanded, as the engine runs it: one `mla_prefill` call per pass of PREFILL_PASS_TOKENS
  tokens (each pass expands the keys and values of the whole cache once): 320 multiply-adds
  per query-key pair and head, plus R (nope + V) per cached token and head and pass;
- absorbed per query, the engine's prefill before: W_UK absorbed into every query, each query
  through the decode kernel over its causal prefix (1088 multiply-adds per pair and head),
  W_UV applied to every attended latent.
Both on the same thread count (1 and all cores: bench/common.py `at_threads`), best of
`--rounds`; the ratio is absorbed time over expanded time. Decode: one query over 1K, 4K and
16K cached rows; microseconds, multiply-adds per second and the cache bytes read per second
against the machine's copy bandwidth measured in the same run. Prints tables, writes
bench/results/mla.json, asserts nothing.

    python bench/mla.py [--context 4096] [--rounds 3] [--threads N ...] [--out bench/results/mla.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numba
import numpy as np
from common import RESULTS_DIR, at_threads, best_seconds, format_table, machine_info, thread_counts, write_json

from waste.analysis.budget import copy_bandwidth
from waste.config import load_preset
from waste.engine.model import PREFILL_PASS_TOKENS
from waste.kernels.mla import heads_dot, heads_times, mla_decode, mla_prefill

CFG = load_preset("kimi-linear-48b-a3b")
H, NOPE, ROPE, V, R = (CFG.mla_num_heads, CFG.qk_nope_head_dim, CFG.qk_rope_head_dim, CFG.v_head_dim,
                       CFG.kv_lora_rank)
D = R + ROPE
SCALE = (NOPE + ROPE) ** -0.5
DECODE_CONTEXTS = (1024, 4096, 16384)


def absorbed_prefill(q: np.ndarray, latent: np.ndarray, w_uk: np.ndarray, w_uv: np.ndarray) -> np.ndarray:
    """The absorbed per-query form: q [T, H, nope + P] from position 0 -> o [T, H, V]."""
    T = q.shape[0]
    q_abs = np.empty((T, H, D), np.float32)
    q_abs[:, :, :R] = heads_times(q[:, :, :NOPE], w_uk)
    q_abs[:, :, R:] = q[:, :, NOPE:]
    o_lat = np.empty((T, H, R), np.float32)
    for t in range(T):
        mla_decode(q_abs[t], latent, t + 1, SCALE, R, out=o_lat[t])
    return heads_dot(o_lat, w_uv)


def expanded_prefill(q: np.ndarray, latent: np.ndarray, w_uk: np.ndarray, w_uv: np.ndarray) -> np.ndarray:
    """The expanded form as the engine calls it, one call per pass: q [T, H, nope + P] -> o [T, H, V]."""
    out = np.empty((q.shape[0], H, V), np.float32)
    for start in range(0, q.shape[0], PREFILL_PASS_TOKENS):
        end = min(q.shape[0], start + PREFILL_PASS_TOKENS)
        mla_prefill(q[start:end], latent, start, SCALE, w_uk, w_uv, out=out[start:end])
    return out


def bench_prefill(rng: np.random.Generator, context: int, rounds: int, threads: list[int]) -> list[dict[str, Any]]:
    latent = rng.standard_normal((context, D)).astype(np.float32)
    q = (0.05 * rng.standard_normal((context, H, NOPE + ROPE))).astype(np.float32)
    kv_b = (rng.standard_normal((H, NOPE + V, R)) / np.sqrt(R)).astype(np.float32)
    w_uk, w_uv = np.ascontiguousarray(kv_b[:, :NOPE]), np.ascontiguousarray(kv_b[:, NOPE:])
    pairs = context * (context + 1) / 2
    passes = range(0, context, PREFILL_PASS_TOKENS)
    expanded_macs = H * (pairs * (NOPE + ROPE + V) + sum(min(context, p + PREFILL_PASS_TOKENS) for p in passes)
                         * R * (NOPE + V))
    absorbed_macs = H * (pairs * (D + R) + context * R * (NOPE + V))
    # Compile (or load) the kernels on a short prompt first.
    small = min(context, 64)
    agree = np.max(np.abs(expanded_prefill(q[:small], latent, w_uk, w_uv)
                          - absorbed_prefill(q[:small], latent, w_uk, w_uv)))
    rows = []
    for n in threads:
        with at_threads(n):
            t_exp = best_seconds(lambda: expanded_prefill(q, latent, w_uk, w_uv), rounds)
            t_abs = best_seconds(lambda: absorbed_prefill(q, latent, w_uk, w_uv), rounds)
        rows.append({"context": context, "threads": n, "expanded_s": t_exp, "absorbed_s": t_abs,
                     "speedup": t_abs / t_exp, "expanded_gmacs": expanded_macs / t_exp / 1e9,
                     "absorbed_gmacs": absorbed_macs / t_abs / 1e9, "expanded_macs": expanded_macs,
                     "absorbed_macs": absorbed_macs, "max_abs_difference_first_64": float(agree)})
    return rows


def bench_decode(rng: np.random.Generator, rounds: int, copy_gbps: float) -> list[dict[str, Any]]:
    rows = []
    for n in DECODE_CONTEXTS:
        latent = (0.05 * rng.standard_normal((n, D))).astype(np.float32)
        q = (0.05 * rng.standard_normal((H, D))).astype(np.float32)
        step = lambda latent=latent, q=q: mla_decode(q, latent, len(latent), SCALE, R)  # noqa: E731
        step()
        t = best_seconds(step, rounds * 5)  # back to back, as decode steps run
        gbps = latent.nbytes / t / 1e9
        rows.append({"context": n, "cache_bytes": latent.nbytes, "us": t * 1e6, "gmacs": H * n * (D + R) / t / 1e9,
                     "read_gbps": gbps,
                     "fraction_of_copy_bandwidth": gbps / copy_gbps})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens of the prefill")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="thread counts (default: 1 and all cores)")
    ap.add_argument("--no-decode", action="store_true", help="prefill only")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "mla.json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    info = machine_info()
    print(f"{info['cpu']}, {info['cores']} cores, load average {info['load_average']}")
    copy = copy_bandwidth(threads=numba.config.NUMBA_NUM_THREADS)  # decode runs on all of them
    decode = [] if args.no_decode else bench_decode(rng, args.rounds, copy["gbps"])
    prefill = bench_prefill(rng, args.context, args.rounds, args.threads or list(thread_counts()))
    print(format_table([f"prefill H={H} R={R}", "threads", "expanded s", "absorbed s", "speedup", "exp GMAC/s",
                        "abs GMAC/s"],
                       [[f"{r['context']} tokens", r["threads"], r["expanded_s"], r["absorbed_s"], r["speedup"],
                         r["expanded_gmacs"], r["absorbed_gmacs"]] for r in prefill]))
    print(f"one MLA layer's attention, queries and cache rows to head outputs; expanded in passes of "
          f"{PREFILL_PASS_TOKENS} tokens; speedup = absorbed s / expanded s at the same thread count; "
          f"largest |difference| over the first 64 queries {prefill[0]['max_abs_difference_first_64']:.2e}\n")
    if decode:
        print(format_table([f"decode H={H} R={R}", "cache MB", "us", "GMAC/s", "read GB/s", "of copy bw"],
                           [[f"context {r['context']}", r["cache_bytes"] / 1e6, r["us"], r["gmacs"], r["read_gbps"],
                             r["fraction_of_copy_bandwidth"]] for r in decode]))
        print("decode in latent space is compute-bound: H (D + R) multiply-adds per cached row")
    print(f"copy bandwidth {copy['gbps']:.1f} GB/s (bytes read + written)")
    write_json(args.out, {"machine": info, "rounds": args.rounds, "copy_bandwidth": copy,
                          "shape": {"H": H, "nope": NOPE, "rope": ROPE, "v": V, "R": R},
                          "prefill_pass_tokens": PREFILL_PASS_TOKENS, "prefill": prefill, "decode": decode})


if __name__ == "__main__":
    main()
