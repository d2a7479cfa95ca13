"""The whole engine on `mini` (Kimi-Linear) and `k3-mini` (K3): prefill and decode tokens per
second, time per layer kind, weight bytes read per decoded token, and those bytes over the decode
time against the machine's copy bandwidth measured in the same run. `mini` runs in `--schemes`
(q8 and q4), `k3-mini` in `--k3-schemes` (q8: K3's default conversion, a q8 trunk with the routed
experts kept MXFP4 as its checkpoint ships them), every row at the same `--threads`, one after
the other in the same run, so the K3 row reads beside the Kimi-Linear one.

The preset's checkpoint is synthesised once into bench/.cache/ and converted to each scheme
(reused on later runs). Per scheme: a warm-up (compiles kernels, faults the weights in), then
`--rounds` rounds of [fresh session, prefill `--prompt-len` tokens in `--prefill-chunk` chunks,
decode `--new` tokens greedily]; the best round of each phase is reported (the machine is
shared, so the best round is the one least disturbed), with the median beside it. Routed
experts come through the memory map (MmapExpertStore): after the warm-up everything sits in
the page cache, so this measures compute and memory, not the disk (bench/streaming.py does
the disk).

Weight bytes per decoded token count what one token's forward reads: every trunk tensor
(quantised matrices, the float32 routers, norms, conv taps), one row of the embedding, the
float32 copies of kv_b the MLA layers keep in place of the stored matrix, and top-k routed
experts per MoE layer (their data bytes, without the blob padding). Recurrent state and the
MLA cache are counted apart (`state_bytes_per_token`). Prints tables, writes
bench/results/engine.json (each run names its preset). Asserts nothing.

    python bench/engine.py [--presets mini k3-mini] [--schemes q8 q4] [--k3-schemes q8] [--prompt-len 256]
                           [--new 32] [--prefill-chunk 32] [--rounds 3] [--threads N ..] [--quick]

`--sweep-chunks 16 32 64 128 256 2048` measures instead prefill tokens per second of a
`--prompt-len` prompt at each prefill chunk (issue 17: the default chunk is the fastest one
measured), per preset and scheme, with the chunks interleaved round by round so that a change
in the machine's load touches them alike; best and median per chunk. Prints a table, writes
bench/results/engine-chunks.json (`--sweep-out`).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import common
import numba
import numpy as np

from waste.analysis.budget import copy_bandwidth
from waste.container import open_container
from waste.engine.model import DEFAULT_PREFILL_CHUNK, LayerTimes, Model
from waste.qformat import SCHEMES

KINDS = ("embed", "kda", "mla", "dense", "moe", "attn_res", "lm_head")


def weight_bytes_per_token(model: Model) -> dict[str, int]:
    """Bytes of weights one decoded token reads, per layer kind (see the module doc)."""
    c, cfg = model.container, model.config
    out = dict.fromkeys(KINDS, 0)
    for name in c.names():
        e = c.entry(name)
        if name == "model.embed_tokens.weight":
            out["embed"] += e.data_bytes // e.shape[0]
            continue
        if name in ("lm_head.weight", "model.norm.weight"):
            out["lm_head"] += e.data_bytes
            continue
        if "_res_" in name:  # AttnRes vectors (K3), per layer and at the output
            out["attn_res"] += e.data_bytes
            continue
        parts = name.split(".")
        layer, where = int(parts[2]), parts[3]
        if where in ("self_attn", "input_layernorm"):
            kind = cfg.layer_kinds[layer]
            if name.endswith("kv_b_proj.weight"):
                attn = model.attn[layer]
                out[kind] += int(attn.w_uk.nbytes + attn.w_uv.nbytes)
                continue
        else:
            kind = "dense" if layer < cfg.first_k_dense_replace else "moe"
        out[kind] += e.data_bytes
    counts = c.byte_counts()
    out["moe"] += len(cfg.moe_layers) * cfg.num_experts_per_token * counts["expert_data_bytes"]
    return out


def state_bytes_per_token(model: Model, context: int) -> int:
    """Recurrent state read and written by every KDA layer, plus the MLA cache read at `context` tokens."""
    cfg = model.config
    kda = 2 * len(cfg.kda_layers) * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4
    mla = sum(model.attn[i].latent_size for i in cfg.mla_layers) * context * 4
    return int(kda + mla)


def run_round(model: Model, prompt: np.ndarray, new: int, chunk: int) -> dict[str, Any]:
    """One fresh session: timed prefill, then `new` greedy decode steps timed one by one."""
    session = model.new_session(len(prompt) + new)
    model.times = LayerTimes()
    t0 = time.perf_counter()
    logits = model.prefill(session, prompt, chunk=chunk, all_logits=False)
    prefill_s = time.perf_counter() - t0
    prefill_kinds = dict(model.times.seconds)
    model.times = LayerTimes()
    token = int(np.argmax(logits[-1]))
    steps = []
    for _ in range(new):
        t0 = time.perf_counter()
        out = model.decode(session, token)
        steps.append(time.perf_counter() - t0)
        token = int(np.argmax(out))
    return {"prefill_s": prefill_s, "prefill_kinds": prefill_kinds, "decode_s": float(sum(steps)),
            "decode_steps": steps, "decode_kinds": dict(model.times.seconds)}


def bench_scheme(preset: str, quant: str, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up and timed rounds of one preset and scheme with Numba's parallel loops on `threads` threads."""
    numba.set_num_threads(threads)
    path = common.mini_container(quant, args.cache_dir, preset=preset)
    rng = np.random.default_rng(0)
    with open_container(path) as c:
        c.hold_experts_in_memory()  # as `waste run` does when the experts fit in RAM
        model = Model(c)
        prompt = rng.integers(0, model.config.vocab_size, args.prompt_len)
        t0 = time.perf_counter()
        run_round(model, prompt[: min(args.prompt_len, 2 * args.prefill_chunk)], min(args.new, 4), args.prefill_chunk)
        warmup_s = time.perf_counter() - t0
        rounds = [run_round(model, prompt, args.new, args.prefill_chunk) for _ in range(args.rounds)]
        wbytes = weight_bytes_per_token(model)
        sbytes = state_bytes_per_token(model, args.prompt_len + args.new // 2)
        counts = c.byte_counts()
    best_p = min(rounds, key=lambda r: r["prefill_s"])
    best_d = min(rounds, key=lambda r: r["decode_s"])
    decode_tps = args.new / best_d["decode_s"]
    total_w = sum(wbytes.values())
    kinds = {}
    for k in KINDS:
        d_s = best_d["decode_kinds"][k] / args.new
        kinds[k] = {
            "prefill_s": best_p["prefill_kinds"][k],
            "prefill_share": best_p["prefill_kinds"][k] / best_p["prefill_s"],
            "decode_ms_per_token": 1e3 * d_s,
            "decode_share": best_d["decode_kinds"][k] / best_d["decode_s"],
            "weight_bytes_per_token": wbytes[k],
            "decode_gbps": wbytes[k] / d_s / 1e9 if d_s > 0 else None,
        }
    glue_p = best_p["prefill_s"] - sum(best_p["prefill_kinds"].values())
    glue_d = best_d["decode_s"] - sum(best_d["decode_kinds"].values())
    steps = np.array([s for r in rounds for s in r["decode_steps"]])
    return {
        "preset": preset, "scheme": quant, "expert_storage": counts["expert_storage"], "threads": threads,
        "container": str(path), "trunk_bytes": counts["trunk_bytes"],
        "expert_bytes": counts["expert_bytes"], "expert_blob_bytes": counts["expert_blob_bytes"],
        "expert_data_bytes": counts["expert_data_bytes"], "warmup_s": warmup_s,
        "prefill_tps": args.prompt_len / best_p["prefill_s"],
        "prefill_tps_median": args.prompt_len / float(np.median([r["prefill_s"] for r in rounds])),
        "decode_tps": decode_tps,
        "decode_tps_median": args.new / float(np.median([r["decode_s"] for r in rounds])),
        "decode_step_ms": {"min": 1e3 * steps.min(), "median": 1e3 * float(np.median(steps)),
                           "max": 1e3 * steps.max()},
        "prefill_other_s": glue_p, "decode_other_ms_per_token": 1e3 * glue_d / args.new,
        "kinds": kinds,
        "weight_bytes_per_token": total_w,
        "state_bytes_per_token": sbytes,
        "decode_weight_gbps": total_w * decode_tps / 1e9,
        "rounds": [{k: v for k, v in r.items() if k != "decode_steps"} for r in rounds],
    }


def sweep_chunks(preset: str, quant: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Prefill tokens/s of one preset and scheme at each of args.sweep_chunks, rounds interleaved."""
    path = common.mini_container(quant, args.cache_dir, preset=preset)
    seconds: dict[int, list[float]] = {chunk: [] for chunk in args.sweep_chunks}
    with open_container(path) as c:
        c.hold_experts_in_memory()  # as `waste run` does when the experts fit in RAM
        model = Model(c)
        prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt_len)
        for chunk in args.sweep_chunks:  # warm-up: compile, fault the weights in
            model.prefill(model.new_session(len(prompt)), prompt[: min(len(prompt), 2 * chunk)], chunk=chunk,
                          all_logits=False)
        for _ in range(args.rounds):
            for chunk in args.sweep_chunks:
                session = model.new_session(len(prompt))
                t0 = time.perf_counter()
                model.prefill(session, prompt, chunk=chunk, all_logits=False)
                seconds[chunk].append(time.perf_counter() - t0)
    return [{"preset": preset, "scheme": quant, "chunk": chunk, "prefill_tps": args.prompt_len / min(s),
             "prefill_tps_median": args.prompt_len / float(np.median(s)), "seconds": s}
            for chunk, s in seconds.items()]


def run_sweep(args: argparse.Namespace, runs: list[tuple[str, str]], info: dict[str, Any]) -> None:
    """`--sweep-chunks`: prefill tokens/s per chunk, a table and bench/results/engine-chunks.json."""
    numba.set_num_threads(args.threads[0])
    print(f"prefill of {args.prompt_len} tokens at chunks {args.sweep_chunks}, best of {args.rounds} interleaved "
          f"rounds, {args.threads[0]} threads")
    rows = [r for preset, quant in runs for r in sweep_chunks(preset, quant, args)]
    print(common.format_table(["preset", "scheme", "chunk", "prefill tok/s", "median tok/s"],
                              [[r["preset"], r["scheme"], r["chunk"], r["prefill_tps"], r["prefill_tps_median"]]
                               for r in rows], floats=".1f"))
    for preset, quant in runs:
        best = max((r for r in rows if (r["preset"], r["scheme"]) == (preset, quant)), key=lambda r: r["prefill_tps"])
        print(f"{preset} {quant}: fastest chunk {best['chunk']} ({best['prefill_tps']:.1f} tok/s); "
              f"default {DEFAULT_PREFILL_CHUNK}")
    common.write_json(args.sweep_out, {
        "benchmark": "engine-chunks", "machine": info, "load_average_at_end": list(os.getloadavg()),
        "default_prefill_chunk": DEFAULT_PREFILL_CHUNK,
        "settings": {"prompt_len": args.prompt_len, "rounds": args.rounds, "chunks": args.sweep_chunks,
                     "threads": args.threads[0]},
        "sweep": rows,
    })


def print_scheme(r: dict[str, Any]) -> None:
    steps = r["decode_step_ms"]
    print(f"\n{r['preset']} {r['scheme']} (experts {r['expert_storage']}), {r['threads']} threads: "
          f"prefill {r['prefill_tps']:.1f} tok/s (median "
          f"{r['prefill_tps_median']:.1f}), decode {r['decode_tps']:.1f} tok/s (median {r['decode_tps_median']:.1f}; "
          f"steps {steps['min']:.2f} / {steps['median']:.2f} / {steps['max']:.2f} ms min/median/max)")
    rows = []
    for k, v in r["kinds"].items():
        rows.append([k, v["prefill_s"], 100 * v["prefill_share"], v["decode_ms_per_token"], 100 * v["decode_share"],
                     v["weight_bytes_per_token"] / 1e6, v["decode_gbps"]])
    rows.append(["other", r["prefill_other_s"], None, r["decode_other_ms_per_token"], None, None, None])
    rows.append(["total", None, None, 1e3 / r["decode_tps"], None, r["weight_bytes_per_token"] / 1e6,
                 r["decode_weight_gbps"]])
    print(common.format_table(["kind", "prefill s", "%", "decode ms/tok", "%", "weights MB/tok", "GB/s"], rows))
    print(f"weights read per decoded token {r['weight_bytes_per_token'] / 1e6:.1f} MB at {r['decode_tps']:.1f} tok/s ="
          f" {r['decode_weight_gbps']:.2f} GB/s, {100 * r['fraction_of_copy_bandwidth']:.0f}% of the copy bandwidth;"
          f" state and MLA cache {r['state_bytes_per_token'] / 1e6:.2f} MB/token besides")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["mini", "k3-mini"], choices=["mini", "k3-mini"])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new", type=int, default=32, help="tokens to decode")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per scheme (best is reported)")
    parser.add_argument("--schemes", nargs="+", default=["q8", "q4"], choices=SCHEMES,
                        help="trunk schemes of mini")
    parser.add_argument("--k3-schemes", nargs="+", default=["q8"], choices=SCHEMES,
                        help="trunk schemes of k3-mini (its routed experts stay MXFP4)")
    parser.add_argument("--threads", type=int, nargs="+", default=[numba.config.NUMBA_NUM_THREADS],
                        help="Numba thread counts to run each scheme with (default: all)")
    parser.add_argument("--quick", action="store_true", help="64-token prompt, 8 new tokens, one round")
    parser.add_argument("--sweep-chunks", type=int, nargs="+", default=None,
                        help="prefill only, at each of these chunks (see the module doc)")
    parser.add_argument("--sweep-out", type=Path, default=common.RESULTS_DIR / "engine-chunks.json")
    parser.add_argument("--cache-dir", type=Path, default=common.CACHE_DIR)
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR / "engine.json")
    args = parser.parse_args()
    if args.quick:
        args.prompt_len, args.new, args.rounds = 64, 8, 1
    if args.prompt_len < 1 or args.new < 1 or args.rounds < 1:
        parser.error("--prompt-len, --new and --rounds must be at least 1")
    if any(not 1 <= t <= numba.config.NUMBA_NUM_THREADS for t in args.threads):
        parser.error(f"--threads must lie in 1..{numba.config.NUMBA_NUM_THREADS} (NUMBA_NUM_THREADS)")
    if args.sweep_chunks is not None and min(args.sweep_chunks) < 1:
        parser.error("--sweep-chunks must be at least 1")
    info = common.machine_info()
    print(f"{info['cpu']}, {info['cores']} cores, Numba {info['numba']} ({info['numba_threads']} threads), "
          f"load average {info['load_average']}")
    runs = [(preset, quant) for preset in args.presets
            for quant in (args.k3_schemes if preset.startswith("k3") else args.schemes)]
    if args.sweep_chunks:
        run_sweep(args, runs, info)
        return 0
    # The bandwidth bound of a run on t threads is a copy on t threads (one core may not reach what two do).
    copy_start = {t: copy_bandwidth(threads=t) for t in args.threads}
    print("copy bandwidth " + ", ".join(f"{c['gbps']:.1f} GB/s on {t} thread(s)" for t, c in copy_start.items())
          + f" (bytes read + written, {copy_start[args.threads[0]]['buffer_bytes'] >> 20} MiB buffer)")
    print(f"{', '.join(args.presets)}: prompt {args.prompt_len} tokens in chunks of {args.prefill_chunk}, "
          f"{args.new} decoded, best of {args.rounds} rounds")
    results = []
    for preset, quant in runs:
        for threads in args.threads:
            r = bench_scheme(preset, quant, threads, args)
            r["fraction_of_copy_bandwidth"] = r["decode_weight_gbps"] / copy_start[threads]["gbps"]
            print_scheme(r)
            results.append(r)
    copy_end = {t: copy_bandwidth(threads=t) for t in args.threads}
    copy_gbps = {t: max(copy_start[t]["gbps"], copy_end[t]["gbps"]) for t in args.threads}
    for r in results:
        r["fraction_of_copy_bandwidth"] = r["decode_weight_gbps"] / copy_gbps[r["threads"]]
    ends = ", ".join(f"{c['gbps']:.1f} GB/s on {t} thread(s)" for t, c in copy_end.items())
    print(f"\ncopy bandwidth at the end {ends}; the summary uses the better of start and end at each thread count")
    summary = [[r["preset"], r["scheme"], r["expert_storage"], r["threads"], r["prefill_tps"], r["decode_tps"],
                r["decode_step_ms"]["min"], r["weight_bytes_per_token"] / 1e6, r["decode_weight_gbps"],
                100 * r["fraction_of_copy_bandwidth"]]
               for r in results]
    print(common.format_table(["preset", "scheme", "experts", "threads", "prefill tok/s", "decode tok/s",
                               "fastest step ms", "weights MB/tok", "GB/s", "% copy bw"], summary, floats=".1f"))
    common.write_json(args.out, {
        "benchmark": "engine", "presets": args.presets, "machine": info, "load_average_at_end": list(os.getloadavg()),
        "settings": {"prompt_len": args.prompt_len, "new": args.new, "prefill_chunk": args.prefill_chunk,
                     "rounds": args.rounds, "threads": args.threads, "schemes": args.schemes,
                     "k3_schemes": args.k3_schemes},
        "copy_bandwidth": {"start": copy_start, "end": copy_end, "gbps": copy_gbps},
        "runs": results,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
