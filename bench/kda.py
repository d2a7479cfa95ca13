"""KDA kernels on Kimi shapes: decode step against a state copy and a NumPy step; prefill tokens/s.

Decode (one token, one layer, K = V = 128, H = 32 Kimi-Linear and H = 96 K3), for the in-place
two-pass step and the one-pass step with the rank-1 update deferred (the engine's): microseconds per
step, the ratio to copying that layer's state once (target <= 2.0x) and the speed-up over a
straightforward vectorised NumPy step (target >= 10x), all timed in the same run at equal
thread counts, 1 against 1 and all cores against all cores (bench/common.py `at_threads`):
the copy is a Numba prange copy over heads on the same threads as the kernel, and the NumPy
step runs with BLAS at that count (its elementwise parts are single-threaded NumPy at any count).
Also timed: one in-place pass (each state row scaled where it lies, one read and one write of
the same memory), the floor for a step that updates the state in place. A copy writes to other
memory, whose lines are read before they are written, so it moves more bytes than an in-place
pass: a step can beat the copy. States are allocated as the engine allocates them
(`kda_decode.new_state`, cache-line aligned).
Prefill (T = 4096, H = 32): tokens/s of
`recurrent_kda` (head-major) and `chunk_kda`, plus a sweep over T that shows where (if anywhere)
the chunked form wins; `waste.kernels.kda_chunk.CHUNK_PREFILL_MIN_TOKENS` encodes that crossover.
Also: max |diff| against the float64 oracle at the issue's shapes, and the packed FMA
instructions in each hot kernel's machine code. Timings are the best of interleaved rounds
(the machine is shared). Prints tables, writes bench/results/kda.json, asserts nothing.

    python bench/kda.py [--quick] [--rounds 7] [--no-asm] [--out bench/results/kda.json]
"""

from __future__ import annotations

import argparse
import collections
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import RESULTS_DIR, at_threads, format_table, machine_info, thread_counts, write_json

from waste.jit import kernel, parallel_kernel, prange
from waste.kernels import kda as kk
from waste.kernels import kda_chunk as kc
from waste.kernels import kda_decode as kd
from waste.reference.kda import naive_recurrent_kda

DECODE_HEADS = (32, 96)
HEAD_DIM = 128
PREFILL_T, PREFILL_H = 4096, 32
SWEEP_T = (16, 64, 256, 1024, 4096)
DECODE_COPY_TARGET = 2.0
DECODE_NUMPY_TARGET = 10.0


def best_times(fns: dict[str, Callable[[], object]], rounds: int, min_round_s: float = 0.05,
               settle_s: float = 0.1) -> dict[str, float]:
    """Best mean seconds per call of each function, over rounds that interleave the functions.

    The sleep before each timed block lets spinning BLAS / OpenMP worker threads go idle, so one
    function's pool does not slow the next on a 2-core machine.
    """
    reps = {}
    for key, fn in fns.items():
        fn()
        t = time.perf_counter()
        fn()
        reps[key] = max(1, int(min_round_s / max(time.perf_counter() - t, 1e-7)))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for key, fn in fns.items():
            time.sleep(settle_s)
            t = time.perf_counter()
            for _ in range(reps[key]):
                fn()
            best[key] = min(best[key], (time.perf_counter() - t) / reps[key])
    return best


def inputs(rng: np.random.Generator, T: int, H: int, D: int = HEAD_DIM):
    """float32 q, k, v [T, H, D], g = logsigmoid(normal) [T, H, D], beta [T, H], state [H, D, D]."""
    f = np.float32
    q, k, v = (rng.standard_normal((T, H, D), dtype=f) for _ in range(3))
    g = (-np.logaddexp(0.0, -rng.standard_normal((T, H, D)))).astype(f)
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((T, H))))).astype(f)
    return q, k, v, g, beta, (0.1 * rng.standard_normal((H, D, D))).astype(f)


def numpy_step(q, k, v, g, beta, S, scale):
    """The straightforward vectorised NumPy decode step (float32, state updated in place)."""
    q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + np.float32(1e-6)) * np.float32(scale)
    k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + np.float32(1e-6))
    S *= np.exp(g)[:, :, None]
    u = (k[:, None, :] @ S)[:, 0]
    S += k[:, :, None] * (beta[:, None] * (v - u))[:, None, :]
    return (q[:, None, :] @ S)[:, 0]


@parallel_kernel
def _scale_rows(state, factor):
    """state[h, i] *= factor[h, i] in place, heads in parallel: one read and one write of the state."""
    for h in prange(state.shape[0]):
        for i in range(state.shape[1]):
            f = factor[h, i]
            for j in range(state.shape[2]):
                state[h, i, j] = f * state[h, i, j]


@parallel_kernel
def _copy_state(src, dst):
    """dst = src for a state [H, K, V], heads in parallel: the copy baseline at the kernel's thread count."""
    for h in prange(src.shape[0]):
        for i in range(src.shape[1]):
            for j in range(src.shape[2]):
                dst[h, i, j] = src[h, i, j]


def bench_decode(rng: np.random.Generator, rounds: int) -> list[dict[str, Any]]:
    """One row per (H, kernel, threads): the in-place two-pass step and the deferred one-pass step the
    engine runs, with the copy and the NumPy step at the same thread count."""
    rows = []
    for H in DECODE_HEADS:
        q, k, v, g, beta, S0 = inputs(rng, 1, H)
        x = (q[0], k[0], v[0], g[0], beta[0])  # one token
        S, S_def, S_scaled, dst = (kd.new_state(H, HEAD_DIM, HEAD_DIM) for _ in range(4))
        for state in (S, S_def, S_scaled):
            state[...] = S0
        S_np = S0.copy()
        factor = np.exp(g[0])  # decays <= 1: repeated scaling never overflows
        pk, pd = np.zeros((H, HEAD_DIM), np.float32), np.zeros((H, HEAD_DIM), np.float32)
        kernels = {
            "two_pass": lambda x=x, S=S: kd.kda_decode_step(*x, S),
            "deferred": lambda x=x, S=S_def, pk=pk, pd=pd: kd.kda_decode_step_deferred(*x, S, pk, pd),
        }
        fns = {
            "copy": lambda S=S, dst=dst: _copy_state(S, dst),
            "in_place": lambda S=S_scaled, f=factor: _scale_rows(S, f),
            **kernels,
            "numpy": lambda x=x, S=S_np: numpy_step(*x, S, HEAD_DIM**-0.5),
        }
        for threads in thread_counts():
            with at_threads(threads):
                best = best_times(fns, rounds)
            for name in kernels:
                rows.append({
                    "H": H, "kernel": name, "state_bytes": S.nbytes, "threads": threads,
                    "copy_us": best["copy"] * 1e6, "in_place_us": best["in_place"] * 1e6,
                    "kernel_us": best[name] * 1e6, "numpy_us": best["numpy"] * 1e6,
                    "ratio_to_copy": best[name] / best["copy"], "speedup_vs_numpy": best["numpy"] / best[name],
                    "meets_copy_target": best[name] / best["copy"] <= DECODE_COPY_TARGET,
                    "meets_numpy_target": best["numpy"] / best[name] >= DECODE_NUMPY_TARGET,
                })
    return rows


def bench_prefill(rng: np.random.Generator, rounds: int, sweep: tuple[int, ...]) -> dict[str, Any]:
    q, k, v, g, beta, _ = inputs(rng, max(sweep), PREFILL_H)
    paths = {
        "recurrent": kk.recurrent_kda,
        "chunk64": kc.chunk_kda,
        "chunk16": lambda *a: kc.chunk_kda(*a, chunk_size=16),
    }
    rows = []
    for T in sweep:
        fns = {name: (lambda f=f, T=T: f(q[:T], k[:T], v[:T], g[:T], beta[:T])) for name, f in paths.items()}
        best = best_times(fns, rounds if T < PREFILL_T else max(2, rounds // 2), min_round_s=0.2)
        rows.append({"T": T, "H": PREFILL_H, **{f"{n}_tok_s": T / s for n, s in best.items()}})
    chunk_wins = [r["T"] for r in rows if max(r["chunk64_tok_s"], r["chunk16_tok_s"]) > r["recurrent_tok_s"]]
    return {"sweep": rows, "chunk_wins_at_T": chunk_wins, "CHUNK_PREFILL_MIN_TOKENS": kc.CHUNK_PREFILL_MIN_TOKENS}


def accuracy(rng: np.random.Generator) -> list[dict[str, Any]]:
    """Max |diff| against the float64 oracle at the issue's two shapes."""
    rows = []
    for T, H, D in ((24, 4, 32), (64, 32, 128)):
        q, k, v, g, beta, S0 = inputs(rng, T, H, D)
        o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0)
        S = S0.copy()
        o_dec = np.stack([kd.kda_decode_step(q[t], k[t], v[t], g[t], beta[t], S) for t in range(T)])
        base, pk, pd = S0.copy(), np.zeros((H, D), np.float32), np.zeros((H, D), np.float32)
        o_def = np.stack([kd.kda_decode_step_deferred(q[t], k[t], v[t], g[t], beta[t], base, pk, pd)
                          for t in range(T)])
        kd.apply_pending(base, pk, pd)
        results = {"decode": (o_dec, S), "deferred decode": (o_def, base),
                   "recurrent": kk.recurrent_kda(q, k, v, g, beta, initial_state=S0),
                   "chunk": kc.chunk_kda(q, k, v, g, beta, initial_state=S0)}
        for name, (o, s) in results.items():
            rows.append({"shape": f"T={T} H={H} K=V={D}", "kernel": name,
                         "output_max_diff": float(np.max(np.abs(o - o_ref))),
                         "state_max_diff": float(np.max(np.abs(s - s_ref)))})
    return rows


def packed_fma() -> list[dict[str, Any]]:
    """Packed float32 FMA instructions by register width in fresh (uncached) builds of the hot kernels."""
    rng = np.random.default_rng(0)
    q, k, v, g, beta, S = inputs(rng, 3, 2, 16)
    o = np.empty_like(v)
    builds = {
        "_decode_kernel": (parallel_kernel(kd._decode_kernel.py_func, cache=False),
                           (q[0], k[0], v[0], g[0], beta[0], 0.25, True, S.copy(), o[0])),
        "_deferred_decode_kernel": (parallel_kernel(kd._deferred_decode_kernel.py_func, cache=False),
                                    (q[0], k[0], v[0], g[0], beta[0], 0.25, True, S.copy(), q[0].copy(),
                                     v[0].copy(), o[0])),
        "_recurrent_kernel": (parallel_kernel(kk._recurrent_kernel.py_func, cache=False),
                              (q, k, v, g, beta, 0.25, True, S.copy(), o)),
        "_gemm_nt": (kernel(kc._gemm_nt.py_func, cache=False), (q[0], q[0], o[0], 2, 2, 16, 0.0)),
    }
    rows = []
    for name, (fn, args) in builds.items():
        fn(*args)
        asm = fn.inspect_asm(fn.signatures[0])
        counts = collections.Counter(m.group(1) for m in re.finditer(r"\tvfn?madd\d+ps\t[^\n]*%([xyz]mm)", asm))
        rows.append({"kernel": name, "zmm": counts["zmm"], "ymm": counts["ymm"], "xmm": counts["xmm"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, prefill only at T <= 1024")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-asm", action="store_true", help="skip the (compiling) packed-FMA check")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "kda.json")
    ap.add_argument("--decode-only", action="store_true", help="only the decode table (prefill, accuracy and asm off)")
    args = ap.parse_args()
    rounds = 3 if args.quick else args.rounds
    rng = np.random.default_rng(0)
    kk.recurrent_kda(*inputs(rng, 2, 2, 8)[:5])  # compile (or load) before timing
    kc.chunk_kda(*inputs(rng, 2, 2, 8)[:5])

    decode = bench_decode(rng, rounds)
    print(format_table(
        ["decode", "kernel", "threads", "state KiB", "copy us", "in-place us", "kernel us", "x copy", "numpy us",
         "x numpy"],
        [[f"H={r['H']}", r["kernel"], r["threads"], r["state_bytes"] // 1024, r["copy_us"], r["in_place_us"],
          r["kernel_us"], r["ratio_to_copy"], r["numpy_us"], r["speedup_vs_numpy"]] for r in decode],
        floats=".1f"))
    print("baselines at the kernel's thread count: 'copy' a Numba prange copy of the state, 'in-place' one "
          "pass scaling each state row where it lies, 'numpy' the vectorised NumPy step (BLAS at that count)")
    for r in decode:
        if r["kernel"] == "deferred":
            print(f"H={r['H']}, {r['threads']} thread(s): {DECODE_NUMPY_TARGET:.0f}x the NumPy step needs "
                  f"<= {r['numpy_us'] / DECODE_NUMPY_TARGET:.1f} us; one copy {r['copy_us']:.1f} us, "
                  f"one in-place pass {r['in_place_us']:.1f} us")
    print(f"targets: <= {DECODE_COPY_TARGET}x one state copy, >= {DECODE_NUMPY_TARGET}x the NumPy step; "
          "the engine decodes with the deferred step\n")

    if args.decode_only:
        write_json(args.out, {"machine": machine_info(), "rounds": rounds, "decode": decode})
        return
    sweep = tuple(t for t in SWEEP_T if t <= 1024) if args.quick else SWEEP_T
    prefill = bench_prefill(rng, rounds, sweep)
    print(format_table(["prefill H=32", "recurrent tok/s", "chunk64 tok/s", "chunk16 tok/s"],
                       [[f"T={r['T']}", r["recurrent_tok_s"], r["chunk64_tok_s"], r["chunk16_tok_s"]]
                        for r in prefill["sweep"]], floats=".0f"))
    print(f"chunked form faster at T = {prefill['chunk_wins_at_T'] or 'none'}; "
          f"CHUNK_PREFILL_MIN_TOKENS = {kc.CHUNK_PREFILL_MIN_TOKENS}\n")

    acc = accuracy(rng)
    print(format_table(["accuracy vs float64", "kernel", "output max|diff|", "state max|diff|"],
                       [[r["shape"], r["kernel"], r["output_max_diff"], r["state_max_diff"]] for r in acc],
                       floats=".2e"))
    asm = [] if args.no_asm else packed_fma()
    if asm:
        print()
        print(format_table(["packed f32 FMAs", "zmm", "ymm", "xmm"],
                           [[r["kernel"], r["zmm"], r["ymm"], r["xmm"]] for r in asm]))
    write_json(args.out, {"machine": machine_info(), "rounds": rounds, "decode": decode, "prefill": prefill,
                          "accuracy": acc, "packed_fma": asm})


if __name__ == "__main__":
    main()
