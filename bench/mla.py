"""MLA attention over the latent cache at the Kimi-Linear shape (H = 32, R = 512, rope 64).

Prefill: 32-token chunks from an empty cache up to `--context` tokens, as the engine runs a
prompt, and one chunk of 512 tokens; multiply-adds per second (causal: each query against the
keys it sees), against the same two products (scores, then probabilities times latents) as
plain BLAS calls with no mask and no softmax, timed in the same run at the same thread count
(1 against 1, all cores against all cores: bench/common.py `at_threads`). For the single chunk the
plain products multiply the whole square while the prefill's query tiles stop near the
diagonal, so the prefill can beat its baseline there. Decode: one query over 1K, 4K and 16K
cached rows; microseconds, multiply-adds per second and the cache bytes read per second
against the machine's copy bandwidth measured in the same run. Prints tables, writes
bench/results/mla.json, asserts nothing.

    python bench/mla.py [--context 2048] [--rounds 3] [--out bench/results/mla.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numba
import numpy as np
from common import RESULTS_DIR, at_threads, best_seconds, format_table, machine_info, thread_counts, write_json

from waste.analysis.budget import copy_bandwidth
from waste.kernels.mla import mla_decode, mla_prefill

H, R, ROPE = 32, 512, 64
D = R + ROPE
SCALE = 192**-0.5  # (qk_nope 128 + rope 64) ** -0.5
CHUNK = 32
DECODE_CONTEXTS = (1024, 4096, 16384)


def prefill_macs(T: int, start: int) -> float:
    """Multiply-adds of T causal queries at positions start.. over the cache: D per score, R per output."""
    return H * T * (start + (T + 1) / 2) * (D + R)


def bench_prefill(rng: np.random.Generator, context: int, rounds: int) -> list[dict[str, Any]]:
    latent = (0.05 * rng.standard_normal((context, D))).astype(np.float32)
    q = (0.05 * rng.standard_normal((context, H, D))).astype(np.float32)

    def chunked() -> None:
        for start in range(0, context, CHUNK):
            mla_prefill(q[start:start + CHUNK], latent, start, SCALE, R)

    def chunked_gemm() -> None:
        for start in range(0, context, CHUNK):
            n = start + CHUNK
            s = q[start:start + CHUNK].reshape(-1, D) @ latent[:n].T
            s @ latent[:n, :R]

    T1 = min(512, context)
    cases = {
        f"{CHUNK}-token chunks to {context}": (chunked, chunked_gemm,
                                               sum(prefill_macs(CHUNK, s) for s in range(0, context, CHUNK))),
        f"one chunk of {T1}": (lambda: mla_prefill(q[:T1], latent, 0, SCALE, R),
                               lambda: (q[:T1].reshape(-1, D) @ latent[:T1].T) @ latent[:T1, :R],
                               prefill_macs(T1, 0)),
    }
    rows = []
    for name, (fn, gemm, macs) in cases.items():
        fn()  # compile or load the kernels first
        for threads in thread_counts():
            with at_threads(threads):
                t, t_gemm = best_seconds(fn, rounds), best_seconds(gemm, rounds)
            rows.append({"case": name, "threads": threads, "seconds": t, "gmacs": macs / t / 1e9,
                         "gemm_seconds": t_gemm, "gemm_gmacs": macs / t_gemm / 1e9, "fraction_of_gemm": t_gemm / t})
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
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens of the chunked prefill")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "mla.json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    copy = copy_bandwidth(threads=numba.config.NUMBA_NUM_THREADS)  # decode runs on all of them
    decode = bench_decode(rng, args.rounds, copy["gbps"])
    prefill = bench_prefill(rng, args.context, args.rounds)
    print(format_table(["prefill H=32 R=512", "threads", "s", "GMAC/s", "BLAS s", "BLAS GMAC/s", "of BLAS"],
                       [[r["case"], r["threads"], r["seconds"], r["gmacs"], r["gemm_seconds"], r["gemm_gmacs"],
                         r["fraction_of_gemm"]] for r in prefill]))
    print("BLAS: the same two products with no mask and no softmax, on the same number of threads\n")
    print(format_table(["decode H=32 R=512", "cache MB", "us", "GMAC/s", "read GB/s", "of copy bw"],
                       [[f"context {r['context']}", r["cache_bytes"] / 1e6, r["us"], r["gmacs"], r["read_gbps"],
                         r["fraction_of_copy_bandwidth"]] for r in decode]))
    print("decode in latent space is compute-bound: H (D + R) multiply-adds per cached row")
    print(f"copy bandwidth {copy['gbps']:.1f} GB/s (bytes read + written)")
    write_json(args.out, {"machine": machine_info(), "rounds": args.rounds, "copy_bandwidth": copy,
                          "prefill": prefill, "decode": decode})


if __name__ == "__main__":
    main()
