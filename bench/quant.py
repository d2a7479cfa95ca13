"""Quantised matrix products on Kimi-Linear shapes: time, weight GB/s, ratio to NumPy float32.

For each shape and format: `matvec` (one token, decode) and `matmul` at 32 tokens (prefill
chunk), the weight bytes streamed per call over the time, and the speed ratio against NumPy's
float32 product on the same shape in the same run (> 1 is faster). Every ratio is taken at
equal thread counts, 1 thread against 1 thread and all cores against all cores (NumPy's BLAS
under threadpoolctl, the kernels under numba.set_num_threads; bench/common.py), shown side
by side. Each product steps through copies of its matrix that together exceed the
last-level cache (four times what sysfs reports, and at least 256 MiB: common.rotation), so
every call reads its weights from memory (the decode case: a model's weights do not stay in
cache between tokens). Timings are the best of many short interleaved
bursts (the machine is shared).

Then the weight quantiser (`quantize`, q8g and q4g) in ns per weight on one float32 matrix,
against a vectorised float32 NumPy quantiser written here (`numpy_quantize`: the same
arithmetic as whole-array operations; NumPy's elementwise operations run on one thread, so the
all-cores row compares against the same single-threaded NumPy and says so), and whether the
Numba bytes agree with the float64 oracle `reference_quantize`. Prints tables and writes
bench/results/quant.json (with --quantize-only only the quantiser section, to
bench/results/quant_quantize.json).

Then (alone with --k3-only, to bench/results/quant_k3.json) MXFP4 against f32 and Q4G on Kimi
K3's routed-expert shapes, per byte: see measure_k3_experts.

Then (alone with --lowerings-only, to bench/results/quant_lowerings.json) q8g products through
the integer-dot lowering this host uses against the generic lowering (`int8_blocks`), both in
the same driver: see measure_lowerings. Asserts nothing.

Then (alone with --amx-only, to bench/results/quant_amx.json), on hosts whose lowering is "amx",
chunk products of every q format through AMX tiles against the vector blocks: see measure_amx.

    python bench/quant.py [--quick] [--rounds 30]
                          [--quantize-only | --k3-only | --lowerings-only | --amx-only] [--out PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import time
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np
from common import at_threads, best_seconds, cycle, machine_info, rotation, thread_counts, write_json

from waste.jit import parallel_kernel, prange
from waste.kernels import activations, int8_blocks, int8_rows
from waste.kernels import quant as qk
from waste.kernels.int8_blocks import ISA
from waste.qformat import BLOCK_BYTES, GROUP, QMAX, ROWS, SCALE_EXPONENT, bits_per_weight
from waste.reference.quant import reference_quantize

SHAPES = [  # (name, N, K)
    ("kda_qkv", 4096, 2304),
    ("o_proj", 2304, 4096),
    ("expert_up", 1024, 2304),
    ("expert_down", 2304, 1024),
    ("lm_head", 163840, 2304),
]
TOKENS = 32
QUANTIZE_SHAPE = ("kda_qkv", 4096, 2304)  # the matrix the quantiser is timed on
# Issue #4 targets: (format, op, shapes, minimum ratio to NumPy float32).
TARGETS = [
    ("q4g", "matvec", ("kda_qkv", "lm_head"), 4.0),
    ("q8g", "matvec", ("kda_qkv", "lm_head"), 2.5),
    ("q4g", "matmul", tuple(s[0] for s in SHAPES), 0.5),
    ("q8g", "matmul", tuple(s[0] for s in SHAPES), 0.5),
]
ENV_KEYS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
            "NUMBA_NUM_THREADS", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")


def round_times(fns: dict[str, Callable[[], object]], rounds: int, burst_s: float = 0.002,
                settle_s: float = 0.12) -> dict[str, list[float]]:
    """Mean seconds per call of each function in each of `rounds` short bursts of calls.

    Rounds interleave the functions so that load on the shared machine hits them alike.
    Before each burst the process sleeps `settle_s` (OpenBLAS worker threads spin for about
    2^28 cycles, ~0.1 s, after a call and Numba's OpenMP workers spin too; on 2 cores a
    spinning pool stalls the other, docs/QUANT.md), then makes one untimed call that wakes its
    own threads (and the idle virtual CPU). Bursts are short because a process that just
    woke gets the cores first, and a parallel kernel is only as fast as its slowest thread.
    """
    reps = {}
    for key, fn in fns.items():
        fastest = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            fn()
            fastest = min(fastest, time.perf_counter() - t)
        reps[key] = max(1, int(burst_s / max(fastest, 1e-7)))
    times: dict[str, list[float]] = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            time.sleep(settle_s)
            fn()
            t = time.perf_counter()
            for _ in range(reps[key]):
                fn()
            times[key].append((time.perf_counter() - t) / reps[key])
    return times


def best_times(fns: dict[str, Callable[[], object]], rounds: int, burst_s: float = 0.002,
               settle_s: float = 0.12) -> dict[str, float]:
    """Best mean seconds per call of each function over `rounds` bursts (`round_times`)."""
    return {key: min(t) for key, t in round_times(fns, rounds, burst_s, settle_s).items()}


def blas_info() -> dict[str, object]:
    """Which BLAS NumPy calls and which OpenBLAS kernel set it picked on this CPU."""
    info: dict[str, object] = {"env": {k: os.environ.get(k) for k in ENV_KEYS}}
    try:
        cfg = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        info.update(name=cfg.get("name"), version=cfg.get("version"))
    except (KeyError, TypeError):
        pass
    with open("/proc/self/maps") as f:
        libs = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line})
    for path in libs:
        lib = ctypes.CDLL(path)
        for prefix, suffix in (("scipy_", "64_"), ("scipy_", ""), ("", "64_"), ("", "")):
            fn = getattr(lib, f"{prefix}openblas_get_corename{suffix}", None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                info["openblas_core"] = fn().decode()
                cfg = getattr(lib, f"{prefix}openblas_get_config{suffix}")
                cfg.restype = ctypes.c_char_p
                info["openblas_config"] = cfg().decode()
                info["openblas_threads"] = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}")()
                return info
    return info


def quant_machine_info() -> dict[str, object]:
    """The shared machine description plus what decides these kernels' speed."""
    return {**machine_info(), "numba_threading_layer": _threading_layer(),
            "vnni_kernels": ISA in ("amx", "vbmi", "vnni"), "dot_isa": ISA}


def _threading_layer() -> str:
    try:
        return numba.threading_layer()
    except ValueError:
        return "not started"


def measure_shape(name: str, n: int, k: int, rng: np.random.Generator, rounds: int) -> dict[str, object]:
    """Time NumPy float32 and every format on one weight shape [n, k], at each thread count, each
    product stepping through copies of its matrix larger than the last-level cache together."""
    w = rng.standard_normal((n, k), dtype=np.float32)
    x = rng.standard_normal(k, dtype=np.float32)
    X = rng.standard_normal((TOKENS, k), dtype=np.float32)
    copies = rotation(lambda i: w if i == 0 else w.copy(), w.nbytes)
    fns: dict[str, Callable[[], object]] = {
        "numpy/matvec": cycle([lambda c=c: c @ x for c in copies]),
        "numpy/matmul": cycle([lambda c=c: X @ c.T for c in copies]),
    }
    matrices, quantize_s, n_copies = {}, {}, {"numpy": len(copies)}
    del copies
    for fmt in qk.FORMATS:
        t = time.perf_counter()
        m = matrices[fmt] = qk.quantize(w, fmt)
        quantize_s[fmt] = time.perf_counter() - t
        ms = rotation(lambda i, m=m, fmt=fmt: m if i == 0 else qk.quantize(w, fmt), m.nbytes)
        n_copies[fmt] = len(ms)
        fns[f"{fmt}/matvec"] = cycle([lambda m=m: m.matvec(x) for m in ms])
        fns[f"{fmt}/matmul"] = cycle([lambda m=m: m.matmul(X) for m in ms])
    row: dict[str, object] = {"name": name, "N": n, "K": k, "tokens": TOKENS, "copies": n_copies,
                              "numpy_f32": {}, "formats": {fmt: {"bytes": m.nbytes,
                                                                 "bits_per_weight": 8 * m.nbytes / (n * k),
                                                                 "quantize_s": quantize_s[fmt], "threads": {}}
                                                           for fmt, m in matrices.items()}}
    for threads in thread_counts():
        with at_threads(threads):
            best = best_times(fns, rounds)
        np_mv, np_mm = best["numpy/matvec"], best["numpy/matmul"]
        row["numpy_f32"][threads] = {"matvec_ms": np_mv * 1e3, "matmul_ms": np_mm * 1e3}
        for fmt, m in matrices.items():
            mv, mm = best[f"{fmt}/matvec"], best[f"{fmt}/matmul"]
            row["formats"][fmt]["threads"][threads] = {
                "matvec_ms": mv * 1e3, "matvec_gbs": m.nbytes / mv / 1e9, "matvec_vs_numpy": np_mv / mv,
                "matmul_ms": mm * 1e3, "matmul_gbs": m.nbytes / mm / 1e9, "matmul_vs_numpy": np_mm / mm,
            }
    return row


def numpy_quantize(w: np.ndarray, fmt: str) -> dict[str, np.ndarray]:
    """The q8g / q4g buffers of w [N, K] by vectorised float32 NumPy: the speed baseline for the
    Numba quantiser (same steps, whole-array operations; bytes may differ from the oracle's in
    the last float32 rounding, which a speed baseline does not need)."""
    n, k = w.shape
    nb, g = -(-n // ROWS), -(-k // GROUP)
    wg = np.zeros((nb * ROWS, g * GROUP), np.float32)
    wg[:n, :k] = w
    wg = wg.reshape(nb * ROWS, g, GROUP)
    dmax = float(np.abs(wg).max()) / QMAX[fmt]
    tscale = np.float32(2.0 ** (np.frexp(dmax)[1] - 1 - SCALE_EXPONENT)) if dmax else np.float32(1.0)
    if fmt == "q8g":
        extreme = np.abs(wg).max(axis=-1)
    else:
        extreme = -np.take_along_axis(wg, np.abs(wg).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    s16 = (extreme / np.float32(QMAX[fmt]) / tscale).astype(np.float16)
    d = s16.astype(np.float32) * tscale
    inv = np.divide(np.float32(1.0), d, out=np.zeros_like(d), where=d != 0)
    ratio = wg * inv[..., None]
    if fmt == "q8g":
        codes = np.clip(np.rint(ratio), -127, 127).astype(np.int8)
        qs = codes.reshape(nb, ROWS, g, GROUP // 4, 4).transpose(0, 2, 3, 1, 4)
    else:
        codes = np.clip(np.rint(ratio) + 8, 0, 15).astype(np.uint8)
        packed = codes[..., : GROUP // 2] | (codes[..., GROUP // 2:] << 4)
        qs = packed.reshape(nb, ROWS, g, GROUP // 8, 4).transpose(0, 2, 3, 1, 4)
    return {"qs": np.ascontiguousarray(qs).reshape(nb, g, BLOCK_BYTES[fmt]),
            "scales": np.ascontiguousarray(s16.reshape(nb, ROWS, g).transpose(0, 2, 1)),
            "tscale": np.array([tscale], np.float32)}


def measure_quantize(rounds: int) -> dict[str, object]:
    """ns per weight of quantize and of the vectorised NumPy quantiser, per q format and thread count."""
    name, n, k = QUANTIZE_SHAPE
    w = np.random.default_rng(1).standard_normal((n, k), dtype=np.float32)
    out: dict[str, object] = {"name": name, "N": n, "K": k, "dtype": "float32", "formats": {}}
    for fmt in ("q8g", "q4g"):
        fast = qk.quantize(w, fmt)  # compiles (or loads from the cache) first
        want = reference_quantize(w, fmt)
        identical = all(np.array_equal(fast.buffers[b].view(np.uint8), want[b].view(np.uint8)) for b in want)
        row: dict[str, object] = {"identical_to_oracle": identical, "threads": {}}
        for threads in thread_counts():
            with at_threads(threads):
                fast_s = best_seconds(lambda fmt=fmt: qk.quantize(w, fmt), rounds)
                numpy_s = best_seconds(lambda fmt=fmt: numpy_quantize(w, fmt), rounds)
            row["threads"][threads] = {"fast_ns_per_weight": fast_s / w.size * 1e9,
                                       "numpy_ns_per_weight": numpy_s / w.size * 1e9,
                                       "speedup_vs_numpy": numpy_s / fast_s}
        out["formats"][fmt] = row
    return out


def print_quantize(q: dict) -> None:
    print(f"quantise {q['name']} {q['N']}x{q['K']} {q['dtype']}: ns per weight, best of the rounds; baseline: "
          "vectorised float32 NumPy (numpy_quantize, always one thread)")
    print(f"{'fmt':<5} {'threads':>7} | {'Numba':>7} {'NumPy':>7} | {'x NumPy':>7} | identical to oracle")
    for fmt, r in q["formats"].items():
        for threads, t in r["threads"].items():
            print(f"{fmt:<5} {threads:>7} | {t['fast_ns_per_weight']:>7.2f} {t['numpy_ns_per_weight']:>7.2f} | "
                  f"{t['speedup_vs_numpy']:>7.1f} | {r['identical_to_oracle']}")


def run(shapes: list[tuple[str, int, int]], rounds: int) -> dict[str, object]:
    rng = np.random.default_rng(0)
    results = []
    for name, n, k in shapes:
        results.append(measure_shape(name, n, k, rng, rounds))
        print_row(results[-1])
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": quant_machine_info(),
            "blas": blas_info(), "load_average_at_end": os.getloadavg(), "shapes": results,
            "targets": check_targets(results)}


def check_targets(results: list[dict]) -> list[dict[str, object]]:
    out = []
    by_name = {r["name"]: r for r in results}
    for fmt, op, names, minimum in TARGETS:
        for name in names:
            if name in by_name:
                for threads, t in by_name[name]["formats"][fmt]["threads"].items():
                    ratio = t[f"{op}_vs_numpy"]
                    out.append({"format": fmt, "op": op, "shape": name, "threads": threads, "ratio": ratio,
                                "target": minimum, "met": ratio >= minimum})
    return out


def print_header() -> None:
    counts = thread_counts()
    cols = " | ".join(f"{'matvec ' + str(n) + 't ms':>13} {'x np':>6} {'matmul ' + str(n) + 't ms':>13} {'x np':>6}"
                      for n in counts)
    print(f"(baseline 'x np': NumPy float32 at the same thread count; {TOKENS}-token matmul; matrices rotated "
          "beyond the last-level cache)")
    print(f"{'shape':<12} {'N x K':>13} {'fmt':<5} {'bits':>5} | {cols}")


def print_row(row: dict) -> None:
    shape = f"{row['N']}x{row['K']}"

    def cells(times: dict, ratios: dict | None) -> str:
        return " | ".join(f"{times[n]['matvec_ms']:>13.3f} {(ratios or {}).get(n, (1.0, 1.0))[0]:>6.2f} "
                          f"{times[n]['matmul_ms']:>13.3f} {(ratios or {}).get(n, (1.0, 1.0))[1]:>6.2f}"
                          for n in times)

    print(f"{row['name']:<12} {shape:>13} {'numpy':<5} {32.0:>5.1f} | {cells(row['numpy_f32'], None)}")
    for fmt, r in row["formats"].items():
        ratios = {n: (t["matvec_vs_numpy"], t["matmul_vs_numpy"]) for n, t in r["threads"].items()}
        print(f"{'':<12} {'':>13} {fmt:<5} {r['bits_per_weight']:>5.2f} | {cells(r['threads'], ratios)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the lm_head shape")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--quantize-only", action="store_true",
                        help="time only the weight quantiser (about a minute; default --out quant_quantize.json)")
    parser.add_argument("--quantize-rounds", type=int, default=10, help="rounds per quantiser timing (both sides)")
    parser.add_argument("--k3-only", action="store_true",
                        help="only MXFP4 / Q4G / f32 on K3's expert shapes (default --out quant_k3.json)")
    parser.add_argument("--lowerings-only", action="store_true",
                        help="only q8g through this host's dot lowering against the generic one "
                             "(default --out quant_lowerings.json)")
    parser.add_argument("--amx-only", action="store_true",
                        help="only chunk products through AMX tiles against the vector blocks "
                             "(default --out quant_amx.json)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON results (default bench/results/quant.json or, with --quantize-only, "
                             "bench/results/quant_quantize.json)")
    args = parser.parse_args()
    results_dir = Path(__file__).parent / "results"
    default_out = ("quant_quantize.json" if args.quantize_only else "quant_k3.json" if args.k3_only
                   else "quant_lowerings.json" if args.lowerings_only else "quant_amx.json" if args.amx_only
                   else "quant.json")
    out = args.out or results_dir / default_out
    shapes = [s for s in SHAPES if not (args.quick and s[0] == "lm_head")]
    info = quant_machine_info()
    print(f"{info['cpu']}, {info['cores']} cores, Numba {info['numba']} ({info['numba_threads']} threads), "
          f"NumPy {info['numpy']}, VNNI kernels: {info['vnni_kernels']}")
    print(f"load average at start: {os.getloadavg()}")
    if args.quantize_only:
        quantize = measure_quantize(args.quantize_rounds)
        print_quantize(quantize)
        report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": quant_machine_info(),
                  "load_average_at_end": os.getloadavg(), "quantize": quantize}
        print(f"load average at end: {report['load_average_at_end']}")
        write_json(out, report)
        return 0
    if args.k3_only or args.lowerings_only or args.amx_only:
        section = (("k3_experts", measure_k3_experts) if args.k3_only else ("lowerings", measure_lowerings)
                   if args.lowerings_only else ("amx", measure_amx))
        report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": info,
                  section[0]: section[1](args.rounds), "load_average_at_end": os.getloadavg()}
        print(f"load average at end: {report['load_average_at_end']}")
        write_json(out, report)
        return 0
    blas = blas_info()
    print(f"NumPy BLAS: {blas.get('name')} {blas.get('version')}, kernel {blas.get('openblas_core')}, "
          f"threads {blas.get('openblas_threads')}, env {blas['env']}")
    print_header()
    report = run(shapes, args.rounds)
    for t in report["targets"]:
        print(f"target {t['format']} {t['op']} on {t['shape']}, {t['threads']} thread(s): {t['ratio']:.2f}x NumPy "
              f"(>= {t['target']}): "
              f"{'met' if t['met'] else 'MISSED'}")
    report["quantize"] = measure_quantize(args.quantize_rounds)
    print_quantize(report["quantize"])
    report["k3_experts"] = measure_k3_experts(args.rounds)
    report["lowerings"] = measure_lowerings(args.rounds)
    report["amx"] = measure_amx(args.rounds)
    report["load_average_at_end"] = os.getloadavg()
    print(f"load average at end: {report['load_average_at_end']}")
    write_json(out, report)
    return 0


# -- MXFP4 on Kimi K3's expert shapes ------------------------------------------------------------

K3_EXPERT_SHAPES = [("k3_gate_up", 3072, 3584), ("k3_down", 3584, 3072)]  # w1/w3 [I, R], w2 [R, I]
K3_FORMATS = ("f32", "q4g", "mxfp4")
K3_MXFP4_SCALES = (118, 124)  # E8M0 bytes of the random MXFP4 matrices (2^-9 .. 2^-4, as trained experts)


def _k3_matrix(fmt: str, n: int, k: int, rng: np.random.Generator) -> qk.QMatrix:
    """A random matrix [n, k] in one format (MXFP4 from random stored bytes, like a checkpoint's),
    prepared: MXFP4's repack for the kernels (about 4 ms here) is made now, as the engine's reader
    threads make it, not inside the first timed product of each matrix."""
    if fmt == "mxfp4":
        return qk.from_buffers("mxfp4", (n, k), {
            "packed": rng.integers(0, 256, (n, k // 2), dtype=np.uint8),
            "scales": rng.integers(*K3_MXFP4_SCALES, (n, k // GROUP), dtype=np.uint8)}).prepare()
    return qk.quantize(rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02), fmt).prepare()


def measure_k3_experts(rounds: int) -> dict[str, object]:
    """MXFP4 against f32 and Q4G on K3's routed-expert shapes: matvec and 32-token matmul.

    Each format steps through distinct matrices together more than the last-level cache
    (common.rotation), so every call streams its weights from memory, as an expert not used for
    a while does. All formats run in the same rounds at the same thread count (one, then all;
    common.at_threads). Reported per format: time, GB/s of stored weight bytes, speed against
    f32 on the same shape, and GB/s against Q4G's (per byte; the target is >= 1): from each
    format's best round, and (`paired`) the median and quartiles over rounds of the ratio within
    a round. The best rounds of two formats may come from different moments of a noisy host (on
    this Xeon they put MXFP4 per byte anywhere in 0.87-1.06 from run to run); a round's two
    bursts, seconds apart, see the same host. But a format whose rounds vary more than the
    other's moves the paired median too (at 2 threads Q4G's did: paired 1.05-1.27 where the best
    rounds gave 0.90-0.96, 2026-12-04), so the target counts as met only when both are >= 1.
    """
    rng = np.random.default_rng(3)
    rows = []
    print(f"{'shape':<11} {'N x K':>10} {'thr':>3} {'fmt':<5} {'mats':>4} | {'matvec ms':>9} {'GB/s':>6} "
          f"{'x f32':>6} {'/q4g B':>6} {'paired':>6} | {'matmul32 ms':>11} {'GB/s':>6} {'x f32':>6} {'/q4g B':>6} "
          f"{'paired':>6}")
    for name, n, k in K3_EXPERT_SHAPES:
        x = rng.standard_normal(k, dtype=np.float32)
        X = rng.standard_normal((TOKENS, k), dtype=np.float32)
        sets = {fmt: rotation(lambda i, fmt=fmt, n=n, k=k: _k3_matrix(fmt, n, k, rng),
                              int(bits_per_weight(fmt, (n, k)) * n * k / 8)) for fmt in K3_FORMATS}
        fns = {f"{fmt}/{op}": cycle([lambda m=m, op=op, a=a: getattr(m, op)(a) for m in mats])
               for fmt, mats in sets.items() for op, a in (("matvec", x), ("matmul", X))}
        for threads in thread_counts():
            with at_threads(threads):
                times = round_times(fns, rounds, burst_s=0.02)
            best = {key: min(t) for key, t in times.items()}
            row: dict[str, object] = {"name": name, "N": n, "K": k, "tokens": TOKENS, "threads": threads,
                                      "formats": {}}
            for fmt, mats in sets.items():
                nbytes = mats[0].nbytes
                r = {"bytes": nbytes, "bits_per_weight": 8 * nbytes / (n * k), "matrices": len(mats)}
                for op in ("matvec", "matmul"):
                    sec = best[f"{fmt}/{op}"]
                    r.update({f"{op}_ms": sec * 1e3, f"{op}_gbs": nbytes / sec / 1e9,
                              f"{op}_vs_f32": best[f"f32/{op}"] / sec})
                row["formats"][fmt] = r
            for fmt, r in row["formats"].items():
                for op in ("matvec", "matmul"):
                    r[f"{op}_gbs_vs_q4g"] = r[f"{op}_gbs"] / row["formats"]["q4g"][f"{op}_gbs"]
                    # Round by round: this format's bytes per second over Q4G's in the same round.
                    paired = (r["bytes"] / row["formats"]["q4g"]["bytes"]
                              * np.array(times[f"q4g/{op}"]) / np.array(times[f"{fmt}/{op}"]))
                    r[f"{op}_gbs_vs_q4g_paired"] = [float(q) for q in np.percentile(paired, [25, 50, 75])]
                print(f"{name if fmt == 'f32' else '':<11} {f'{n}x{k}' if fmt == 'f32' else '':>10} {threads:>3} "
                      f"{fmt:<5} {r['matrices']:>4} | {r['matvec_ms']:>9.3f} {r['matvec_gbs']:>6.1f} "
                      f"{r['matvec_vs_f32']:>6.2f} {r['matvec_gbs_vs_q4g']:>6.2f} "
                      f"{r['matvec_gbs_vs_q4g_paired'][1]:>6.2f} | "
                      f"{r['matmul_ms']:>11.3f} {r['matmul_gbs']:>6.1f} {r['matmul_vs_f32']:>6.2f} "
                      f"{r['matmul_gbs_vs_q4g']:>6.2f} {r['matmul_gbs_vs_q4g_paired'][1]:>6.2f}")
            rows.append(row)
        del sets, fns
    targets = [{"shape": row["name"], "threads": row["threads"], "op": op,
                "mxfp4_gbs_vs_q4g": row["formats"]["mxfp4"][f"{op}_gbs_vs_q4g"],
                "mxfp4_gbs_vs_q4g_paired": row["formats"]["mxfp4"][f"{op}_gbs_vs_q4g_paired"],
                "met": min(row["formats"]["mxfp4"][f"{op}_gbs_vs_q4g"],
                           row["formats"]["mxfp4"][f"{op}_gbs_vs_q4g_paired"][1]) >= 1.0}
               for row in rows for op in ("matvec", "matmul")]
    for t in targets:
        q1, median, q3 = t["mxfp4_gbs_vs_q4g_paired"]
        print(f"target mxfp4 >= q4g GB/s, {t['op']} on {t['shape']}, {t['threads']} thread(s): paired median "
              f"{median:.2f} (quartiles {q1:.2f}-{q3:.2f}; best rounds {t['mxfp4_gbs_vs_q4g']:.2f}) "
              f"{'met' if t['met'] else 'MISSED'}")
    return {"shapes": rows, "targets": targets}



# -- q8g: this host's integer-dot lowering against the generic one ---------------------------------

LOWERING_SHAPES = [s for s in SHAPES if s[0] != "lm_head"]


def _lowering_product(isa: str) -> Callable[..., None]:
    """Y [T, 16NB] = X W^T for q8g / q4g codes through the blocks as lowered for `isa`: the
    engine's driver (activations quantised once, row blocks in parallel, each lowering's token
    tiles) without its serial shortcuts, so two lowerings are timed in the same driver."""
    rows = int8_rows.make_rows(isa)

    @parallel_kernel
    def product(X, qs, scales, tscale, Y):
        T, G = X.shape[0], qs.shape[1]
        xq = np.empty((T, G * GROUP), np.int8)
        xsum = np.empty((T, G), np.int32)
        xs = np.empty((T, G), np.float32)
        for t in prange(T):
            activations._quantize_token(X, t, xq, xsum, xs)
        for b in prange(qs.shape[0]):
            rows(qs, scales, xq, xsum, xs, Y, tscale[0], b)

    return product


def measure_lowerings(rounds: int) -> dict[str, object]:
    """q8g matvec and 32-token matmul through the host's dot lowering (on AVX2: vpsignb,
    vpmaddubsw, vpmaddwd) against the generic one (widen, multiply, add), in the same driver,
    interleaved rounds at the same thread count, matrices rotated beyond the last-level cache.
    Both give the same bits (checked here once per shape, and by tests/kernels/test_quant.py)."""
    rng = np.random.default_rng(5)
    lowerings = {name: _lowering_product(isa) for name, isa in (("host", ISA), ("generic", "generic"))}
    rows = []
    print(f"q8g products: host lowering {int8_blocks.dot_lowering(ISA, 'q8g')!r} against 'generic', same driver; "
          f"ms, best of {rounds} interleaved rounds; {TOKENS}-token matmul")
    print(f"{'shape':<12} {'N x K':>10} {'thr':>3} | {'matvec host':>11} {'generic':>8} {'x':>6} | "
          f"{'matmul host':>11} {'generic':>8} {'x':>6}")
    for name, n, k in LOWERING_SHAPES:
        w = rng.standard_normal((n, k), dtype=np.float32)
        mats = rotation(lambda i, w=w: qk.quantize(w, "q8g"), qk.quantize(w, "q8g").nbytes)
        args = [m._qargs[:3] for m in mats]
        inputs = {"matvec": rng.standard_normal((1, k), dtype=np.float32),
                  "matmul": rng.standard_normal((TOKENS, k), dtype=np.float32)}
        outs = {op: np.empty((len(X), args[0][0].shape[0] * ROWS), np.float32) for op, X in inputs.items()}
        same = True
        for op, X in inputs.items():
            ys = []
            for fn in lowerings.values():
                fn(X, *args[0], outs[op])
                ys.append(outs[op].copy())
            same = same and all(np.array_equal(ys[0], y) for y in ys[1:])
        fns = {f"{low}/{op}": cycle([lambda fn=fn, a=a, X=X, Y=outs[op]: fn(X, *a, Y) for a in args])
               for low, fn in lowerings.items() for op, X in inputs.items()}
        for threads in thread_counts():
            with at_threads(threads):
                best = best_times(fns, rounds)
            row = {"name": name, "N": n, "K": k, "threads": threads, "matrices": len(mats), "same_bits": same,
                   **{f"{low}_{op}_ms": best[f"{low}/{op}"] * 1e3 for low in lowerings for op in inputs},
                   **{f"{op}_speedup": best[f"generic/{op}"] / best[f"host/{op}"] for op in inputs}}
            rows.append(row)
            print(f"{name:<12} {f'{n}x{k}':>10} {threads:>3} | {row['host_matvec_ms']:>11.3f} "
                  f"{row['generic_matvec_ms']:>8.3f} {row['matvec_speedup']:>6.2f} | {row['host_matmul_ms']:>11.3f} "
                  f"{row['generic_matmul_ms']:>8.3f} {row['matmul_speedup']:>6.2f}")
        del mats, args, fns
    return {"host_isa": ISA, "host_q8g_lowering": int8_blocks.dot_lowering(ISA, "q8g"), "tokens": TOKENS,
            "shapes": rows}



AMX_CHUNKS = (16, 32, 64, 256)  # tokens of the timed chunk products


def measure_amx(rounds: int) -> dict[str, object]:
    """Chunk products of q8g, q4g and mxfp4 through AMX tiles (lowering "amx") against the vector
    blocks this host runs without them ("vbmi"), in the same driver, interleaved rounds at the
    same thread count, matrices rotated beyond the last-level cache, at AMX_CHUNKS tokens. Both
    give the same bits (checked here once per case, and by tests/kernels/test_quant.py). Only
    where the host's lowering is "amx" (an AMX CPU that Linux lets use its tiles, WASTE_AMX unset)."""
    if ISA != "amx":
        print(f"AMX tiles: not on this host (lowering {ISA!r}); skipped")
        return {"host_isa": ISA, "skipped": True}
    rng = np.random.default_rng(6)
    lowerings = {isa: _lowering_product(isa) for isa in ("amx", "vbmi")}
    rows = []
    print(f"chunk products through AMX tiles against the vector blocks ('vbmi'), same driver; ms, best of {rounds} "
          f"interleaved rounds; x = vbmi / amx")
    print(f"{'shape':<12} {'N x K':>10} {'fmt':<6} {'thr':>3} | " + " | ".join(
        f"{f'T={t} amx':>10} {'vbmi':>7} {'x':>5}" for t in AMX_CHUNKS))
    for name, n, k in LOWERING_SHAPES:
        w = rng.standard_normal((n, k), dtype=np.float32)
        for fmt in ("q8g", "q4g", "mxfp4"):
            mats = rotation(lambda i, w=w, fmt=fmt: qk.quantize(w, fmt), qk.quantize(w, fmt).nbytes)
            args = [m._qargs[:3] for m in mats]
            inputs = {t: rng.standard_normal((t, k), dtype=np.float32) for t in AMX_CHUNKS}
            outs = {t: np.empty((t, args[0][0].shape[0] * ROWS), np.float32) for t in AMX_CHUNKS}
            same = True
            for t, X in inputs.items():
                ys = []
                for fn in lowerings.values():
                    fn(X, *args[0], outs[t])
                    ys.append(outs[t].copy())
                same = same and np.array_equal(ys[0], ys[1])
            fns = {f"{low}/{t}": cycle([lambda fn=fn, a=a, X=X, Y=outs[t]: fn(X, *a, Y) for a in args])
                   for low, fn in lowerings.items() for t, X in inputs.items()}
            for threads in thread_counts():
                with at_threads(threads):
                    best = best_times(fns, rounds)
                row = {"name": name, "N": n, "K": k, "format": fmt, "threads": threads, "matrices": len(mats),
                       "same_bits": same,
                       **{f"{low}_T{t}_ms": best[f"{low}/{t}"] * 1e3 for low in lowerings for t in AMX_CHUNKS},
                       **{f"T{t}_speedup": best[f"vbmi/{t}"] / best[f"amx/{t}"] for t in AMX_CHUNKS}}
                rows.append(row)
                print(f"{name:<12} {f'{n}x{k}':>10} {fmt:<6} {threads:>3} | " + " | ".join(
                    f"{row[f'amx_T{t}_ms']:>10.3f} {row[f'vbmi_T{t}_ms']:>7.3f} {row[f'T{t}_speedup']:>5.2f}"
                    for t in AMX_CHUNKS) + ("" if same else "  DIFFERENT BITS"))
            del mats, args, fns
    return {"host_isa": ISA, "chunks": list(AMX_CHUNKS), "shapes": rows}


if __name__ == "__main__":
    raise SystemExit(main())
