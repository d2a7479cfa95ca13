"""Kimi-Linear-48B-A3B in q4 on this machine (issue 13): a model bigger than RAM, decoded from disk.

The container is synthesised once (`waste synth ... --quant q4`, random weights) into
`--dir` (default $WASTE_SCALE_DIR or /work/scale, outside the repository: 28.7 GB) and reused.
Each store then runs in its own child process (a fresh RSS peak, nothing shared):

- `streaming`: the store `waste run` picks by default when the experts do not fit: a cache of
  the room the memory planner leaves (`waste.engine.memory`), filled with O_DIRECT reads, so
  the experts never sit in the page cache as well;
- `mmap`: the container's memory map; the kernel's page cache is the expert cache;
- `streaming-unguessed`, `mmap-unguessed`: the same without the decode's guesses of the next
  MoE layers' experts (`waste.engine.model`), `mmap-unguessed` being the plain memory map;
- `streaming-page-cache`: the streaming cache with `--expert-io page-cache`: blobs read into
  the page cache and used as views of the map (`waste.expert_io` for the trade-off).

Same RAM for both: the machine's own. The q4 experts (26 GB) exceed this machine's RAM, so the
page cache can hold only part of them, and the streaming cache is sized from the same
available memory (`--ram` sizes the streaming budget as if the machine had that much; the
mmap run cannot be capped without a memory cgroup, which this benchmark does not create).
experts.bin is dropped from the page cache (posix_fadvise) before each child.

Per store: a `--prompt-len` token prompt (random ids) timed as prefill (cold: nothing of
experts.bin in the page cache or the expert cache), then `--new` greedy decode steps;
steady-state decode speed is over the steps after the first `--warm` (their cache is warm);
then a second prompt of `--warm-prompt-len` other random ids in a new session, timed as the
"warm" prefill: the expert cache (or page cache) holds what the first prompt and the decode
left in it (0 skips it). Both stores get the decode's guesses of the next MoE layers' experts
(`waste.engine.model`): streaming reads them ahead, the map passes them on to the kernel
(POSIX_FADV_WILLNEED). Reported: tokens/s, peak RSS against the planner's figure, the
decode's cache budget (the JSON also has the smaller one a prompt is read in,
`prefill_cache_budget`, and `read_ahead_peak`, the most the cache, the reads under way and the
prefill's reads ahead held at once), hit rate, the share of decode misses a guess had read ahead (`guessed`)
and expert GB read per decoded token, next to the planner's
decode bound at the hit rate measured and what `waste plan` predicts (`predict_run`, the same
code: uniform routing, at the RAM and runtime the run planned with; its decode estimate from a
step's compute measured as `waste plan` measures it, in a child of its own before the stores,
with the disk's time for the misses after it or under it), its cold prefill bound
(expert bytes over the disk's speed, compute left out), with the NVMe bandwidth (a sequential
O_DIRECT read of experts.bin) and the RAM bandwidth `waste plan` measures (what the q8g matvec
reads, `measure_memory`) taken in the same run; and where a steady decode step's time went: the
model's regions (`Model.times`, the MoE's including its waits for the store) and the CPU of the
thread running the model, the store's reader threads and the rest (Numba's workers).
Other engineers may share the cores: the load average is recorded before and after.

    python bench/scale.py [--dir D] [--preset kimi-linear-48b-a3b] [--prompt-len 512] [--new 64]
                          [--stores streaming mmap] [--ram 24G]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import common
import numba
import numpy as np

from waste.analysis.budget import copy_bandwidth, decode_speed_bound, predict_run
from waste.analysis.compute import DecodeCompute, measure_decode_compute
from waste.analysis.machine import Bandwidth, Bandwidths, measure_memory
from waste.container import open_container
from waste.engine.experts import READER_THREAD_PREFIX, MmapExpertStore, StreamingExpertStore
from waste.engine.memory import measure_runtime, peak_rss, plan_run_memory
from waste.engine.model import DEFAULT_PREFILL_CHUNK, PREFILL_PASS_TOKENS
from waste.expert_io import DEFAULT_IO
from waste.plan import make_plan
from waste.synth_container import synthesize_container
from waste.units import parse_size

# Each store with the decode's guesses (as `waste run` does) and without them ("-unguessed"); the
# streaming store reads with `waste run`'s default io, "-page-cache" into the page cache.
STORES = ("streaming", "mmap", "streaming-unguessed", "mmap-unguessed", "streaming-page-cache")
COMPUTE_CHILD = "compute"  # the child that measures a decode step's compute (`measure_compute`)


def store_io(store: str) -> str:
    return "page-cache" if store.endswith("-page-cache") else DEFAULT_IO


def is_streaming(store: str) -> bool:
    return store.startswith("streaming")


def default_dir() -> Path:
    return Path(os.environ.get("WASTE_SCALE_DIR", "/work/scale"))


def container_path(args: argparse.Namespace) -> tuple[Path, float | None]:
    """The container (synthesised when missing) and the seconds its synthesis took (None: reused)."""
    path = args.dir / f"{args.preset}-{args.quant}.waste"
    if (path / "manifest.json").is_file():
        return path, None
    args.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    synthesize_container(args.preset, path, quant=args.quant, seed=0)
    return path, time.perf_counter() - t0


def run_store(args: argparse.Namespace) -> dict[str, Any]:
    """One store, in this (child) process: prefill, decode, counters and the memory plan."""
    rng = np.random.default_rng(0)
    with open_container(args.container) as c:
        cfg = c.config
        prompt = rng.integers(0, cfg.vocab_size, args.prompt_len)
        context = args.prompt_len + args.new + 8
        available = None if args.ram is None else parse_size(args.ram, "--ram")
        # As `waste run` does: load the model and every kernel on the path (a few tokens through
        # each kind of store, `measure_runtime`), measure what the process holds, plan, then pick
        # the store. The warm-up's counters are not kept; the experts its map pass brought into
        # the page cache are dropped below with the rest, before the cold prefill.
        model, runtime = measure_runtime(c, chunk=args.prefill_chunk)
        memory = plan_run_memory(c, context, chunk=args.prefill_chunk, pass_tokens=PREFILL_PASS_TOKENS,
                                 runtime=runtime, decode_tokens=args.new, available=available)
        if is_streaming(args.child):
            store: Any = StreamingExpertStore(c, memory.cache_budget, "lru", args.read_threads, store_io(args.child),
                                              memory.prefill_cache_budget)
        else:
            store = MmapExpertStore(c, advise_guesses=True)
        model.store = store
        model.guess_experts = not args.child.endswith("-unguessed")
        dropped = common.drop_page_cache(c.experts_path)
        session = model.new_session(context)
        cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        model.prefill(session, prompt, chunk=args.prefill_chunk, all_logits=False)
        prefill_s, cpu1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        prefill = store.stats.total.as_dict()
        store.stats.reset()
        token = int(np.argmax(session.last_logits))
        step_s = []
        warm_stats = None
        warm_regions, warm_threads = dict(model.times.seconds), common.thread_cpu_seconds()
        for i in range(args.new):
            if i == args.warm:
                warm_stats = store.stats.total.as_dict()
                warm_regions, warm_threads = dict(model.times.seconds), common.thread_cpu_seconds()
            t0 = time.perf_counter()
            token = int(np.argmax(model.decode(session, token)))
            step_s.append(time.perf_counter() - t0)
        total, cpu2 = store.stats.total, resource.getrusage(resource.RUSAGE_SELF)
        steady_tokens = max(1, args.new - args.warm)
        # Where a steady decode step's time goes: each region of the model (`Model.times`; "moe"
        # includes waiting for the store), and whose CPU it took: the thread that runs the model,
        # the store's reader threads (reads, CRC checks), the rest (Numba's workers).
        steady_region_ms = {k: 1000 * (v - warm_regions.get(k, 0.0)) / steady_tokens
                            for k, v in model.times.seconds.items()}
        main_tid = threading.main_thread().native_id
        steady_thread_cpu = common.thread_cpu_split(warm_threads, common.thread_cpu_seconds(), {
            "model": lambda tid, name: tid == main_tid,
            "expert readers": lambda tid, name: name.startswith(READER_THREAD_PREFIX)})
        steady_thread_cpu_ms = {g: {k: (1000 * v / steady_tokens if k != "threads" else v) for k, v in d.items()}
                                for g, d in steady_thread_cpu.items()}
        peak_after_decode, layer_seconds = peak_rss(), dict(model.times.seconds)
        warm_prefill: dict[str, Any] = {}
        if args.warm_prompt_len:
            del session
            store.stats.reset()
            second = model.new_session(args.warm_prompt_len)
            t0 = time.perf_counter()
            model.prefill(second, rng.integers(0, cfg.vocab_size, args.warm_prompt_len), chunk=args.prefill_chunk,
                          all_logits=False)
            warm_s = time.perf_counter() - t0
            warm_prefill = {"warm_prefill_s": warm_s, "warm_prefill_tps": args.warm_prompt_len / warm_s,
                            "warm_prefill_stats": store.stats.total.as_dict(),
                            "peak_rss_after_warm_prefill": peak_rss()}
        steady = step_s[args.warm:]
        steady_read = total.bytes_read - (warm_stats or {}).get("bytes_read", 0)
        steady_hits = total.hits - (warm_stats or {}).get("hits", 0)
        steady_requests = total.requests - (warm_stats or {}).get("requests", 0)
        steady_misses = total.misses - (warm_stats or {}).get("misses", 0)
        steady_guessed = total.ahead_used - (warm_stats or {}).get("ahead_used", 0)
        out = {
            "store": args.child, "context": context, "prompt_len": args.prompt_len, "decode_tokens": args.new,
            "io_mode": store.io_mode,
            "io_note": getattr(store, "io_note", ""),
            "cache_dropped": dropped, "memory_plan": memory.as_dict(),
            "cache_budget": getattr(store, "budget_bytes", None),
            "prefill_cache_budget": getattr(store, "prefill_budget_bytes", None),
            "read_ahead_peak": getattr(store, "read_ahead_peak", None),
            "prefill_s": prefill_s, "prefill_tps": args.prompt_len / prefill_s, "prefill_stats": prefill,
            # CPU seconds of all the process's threads during the cold prefill: user (kernels, checks)
            # and system (page faults populating fresh buffers or page cache, reads)
            "prefill_cpu_user_s": cpu1.ru_utime - cpu0.ru_utime, "prefill_cpu_sys_s": cpu1.ru_stime - cpu0.ru_stime,
            # page faults: minor (the page was in memory, or new), major (read from the disk)
            "prefill_faults": {"minor": cpu1.ru_minflt - cpu0.ru_minflt, "major": cpu1.ru_majflt - cpu0.ru_majflt},
            "decode_cpu_user_s": cpu2.ru_utime - cpu1.ru_utime, "decode_cpu_sys_s": cpu2.ru_stime - cpu1.ru_stime,
            "decode_faults": {"minor": cpu2.ru_minflt - cpu1.ru_minflt, "major": cpu2.ru_majflt - cpu1.ru_majflt},
            "prefill_expert_bytes_vs_model": prefill["bytes_read"] / c.byte_counts()["expert_bytes"],
            "decode_step_s": step_s, "decode_tps_all": len(step_s) / sum(step_s),
            "decode_tps_steady": len(steady) / sum(steady),
            "decode_hit_rate_steady": steady_hits / steady_requests if is_streaming(args.child) else None,
            "decode_expert_gb_per_token_steady": steady_read / len(steady) / 1e9,
            # misses whose read a guess issued before their layer asked (streaming only)
            "decode_guessed_steady": steady_guessed / steady_misses if is_streaming(args.child) and steady_misses
            else None,
            "decode_stats": total.as_dict(), "peak_rss": peak_after_decode,
            "layer_seconds": layer_seconds, "decode_steady_region_ms_per_token": steady_region_ms,
            "decode_steady_thread_cpu_ms_per_token": steady_thread_cpu_ms, **warm_prefill,
        }
        store.close()
    return out


def child_run(args: argparse.Namespace, store: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", store, "--container", str(args.container_path),
           "--prompt-len", str(args.prompt_len), "--new", str(args.new), "--warm", str(args.warm),
           "--prefill-chunk", str(args.prefill_chunk), "--read-threads", str(args.read_threads),
           "--warm-prompt-len", str(args.warm_prompt_len)]
    if args.ram:
        cmd += ["--ram", args.ram]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {store} run failed, {common.describe_exit(done.returncode)}:\n{done.stderr}".rstrip())
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_compute(path: Path) -> dict[str, Any]:
    """A decode step's compute on this container's model, as `waste plan` measures it
    (`measure_decode_compute`, experts pooled), in a process of its own: its pool does not stay in
    the stores' page cache or RSS."""
    with open_container(path) as c:
        model, _ = measure_runtime(c, chunk=DEFAULT_PREFILL_CHUNK)
        return measure_decode_compute(model).as_dict()


def predictions(path: Path, result: dict[str, Any], nvme_gbps: float, mem_gbps: float,
                compute: dict[str, Any]) -> dict[str, Any]:
    """What `waste plan` predicts for this run (`predict_run`, the same code, at the RAM and runtime
    the run measured and planned with, and with the decode step's `compute` measured in this run),
    and the bound at the hit rate the run reached."""
    mp = result["memory_plan"]
    plan = make_plan(str(path), context=result["context"])
    rates = Bandwidths(Bandwidth(nvme_gbps, "measured in this run: sequential O_DIRECT read of experts.bin"),
                       Bandwidth(mem_gbps, "measured in this run: q8g matvec reads (measure_memory)"))
    predicted = predict_run(plan, mp["available"], rates, runtime=mp["runtime"], decode_tokens=result["decode_tokens"],
                            prompt_tokens=result["prompt_len"], compute=DecodeCompute(**compute))
    out: dict[str, Any] = {"planned_peak_rss": mp["planned_peak"], "waste_plan": predicted.as_dict(),
                           "prefill_bound_tps": predicted.prefill.tokens_per_second}
    # The uniform-routing figure is the prediction for the streaming store `waste run` picks here.
    hits = {"uniform": predicted.hit_rate if is_streaming(result["store"]) else None,
            "measured_hit": result["decode_hit_rate_steady"]}
    for label, hit in hits.items():
        if hit is not None:
            b = decode_speed_bound(plan, min(1.0, hit), nvme_gbps, mem_gbps)
            out[f"decode_bound_tps_{label}"] = b.tokens_per_second
            out[f"decode_serial_tps_{label}"] = b.serial_tokens_per_second
            out[f"hit_rate_{label}"] = hit
    return out


def plan_estimate(predicted: dict[str, Any]) -> str:
    """`waste plan`'s decode estimate, "serial-overlapped" tok/s."""
    return f"{predicted['decode_estimate_serial_tps']:.2f}-{predicted['decode_estimate_tps']:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=default_dir(), help="where the container lives (default "
                        "$WASTE_SCALE_DIR or /work/scale)")
    parser.add_argument("--preset", default="kimi-linear-48b-a3b")
    parser.add_argument("--quant", default="q4", choices=("q4", "q8"))
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new", type=int, default=72)
    parser.add_argument("--warm", type=int, default=8, help="decode steps left out of the steady state")
    parser.add_argument("--warm-prompt-len", type=int, default=512, help="a second prompt after the decode, timed "
                        "with the cache as the first run left it (0: none)")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK)
    parser.add_argument("--read-threads", type=int, default=4)
    parser.add_argument("--stores", nargs="+", choices=STORES, default=list(STORES))
    parser.add_argument("--ram", default=None, help="size the streaming budget for this much RAM (default: "
                        "what the machine has available)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", choices=(*STORES, COMPUTE_CHILD), help=argparse.SUPPRESS)
    parser.add_argument("--container", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.new <= args.warm or args.prompt_len < 1 or args.warm_prompt_len < 0:
        parser.error("--new must exceed --warm, --prompt-len be at least 1 and --warm-prompt-len not negative")
    if args.child == COMPUTE_CHILD:
        print(json.dumps(measure_compute(args.container)))
        return 0
    if args.child:
        print(json.dumps(run_store(args), default=common._jsonable))
        return 0
    load_before = list(os.getloadavg())
    info = common.machine_info()
    print(f"{info['cpu']}, {info['cores']} cores, load average {load_before}")
    path, synth_s = container_path(args)
    args.container_path = path
    with open_container(path) as c:
        counts = c.byte_counts()
        seq = common.sequential_read(c.experts_path, direct=True, limit=4 << 30)
    mem = copy_bandwidth(threads=numba.config.NUMBA_NUM_THREADS)
    reads = measure_memory()  # what `waste plan` plans with
    fresh = common.fresh_memory_cost()
    reporting = ("; this guest's balloon gives freed memory back to its host, so memory freed a while ago "
                 "costs more (common.free_page_reporting)") if info["free_page_reporting"] else ""
    print("fresh memory (4 GB of new anonymous maps, populated): " +
          ", ".join(f"{s:.2f}" for s in fresh) + f" s of system CPU per GB, GB by GB{reporting}")
    print(f"{path}: trunk {counts['trunk_bytes'] / 1e9:.2f} GB, experts {counts['expert_bytes'] / 1e9:.2f} GB"
          f"{'' if synth_s is None else f', synthesised in {synth_s:.0f} s'}; experts.bin read "
          f"{seq['gbps']:.2f} GB/s ({seq['io_mode']}), RAM copy {mem['gbps']:.1f} GB/s, q8g matvec reads "
          f"{reads['gbps']:.1f} GB/s")
    compute = child_run(args, COMPUTE_CHILD)
    print(f"a decode step's compute with every expert it asks for in RAM (waste plan's measure): "
          f"{1000 * compute['step_seconds']:.0f} ms, median of {compute['steps']} steps")
    results = []
    for store in args.stores:
        r = child_run(args, store)
        r["prediction"] = predictions(path, r, seq["gbps"], reads["gbps"], compute)
        results.append(r)
    rows = []
    for r in results:
        p = r["prediction"]
        rows.append([r["store"], r["io_mode"], r["prefill_tps"], p["prefill_bound_tps"], r.get("warm_prefill_tps"),
                     r["decode_tps_steady"],
                     plan_estimate(p["waste_plan"]) if is_streaming(r["store"]) else None,
                     p.get("decode_bound_tps_measured_hit", p.get("decode_bound_tps_uniform")),
                     r["peak_rss"] / 2**30, p["planned_peak_rss"] / 2**30,
                     None if r["cache_budget"] is None else r["cache_budget"] / 2**30,
                     None if r["decode_hit_rate_steady"] is None else 100 * r["decode_hit_rate_steady"],
                     None if r.get("decode_guessed_steady") is None else 100 * r["decode_guessed_steady"],
                     r["decode_expert_gb_per_token_steady"], r["prefill_expert_bytes_vs_model"]])
    print(common.format_table(["store", "io", "cold prefill tok/s", "prefill bound tok/s", "warm prefill tok/s",
                               "decode tok/s", "waste plan tok/s",
                               "bound at hit tok/s", "peak GiB",
                               "plan GiB", "cache GiB", "hit %", "guessed %", "GB/token", "prefill reads/model"],
                              rows))
    for r in results:
        print(f"{r['store']}: the cold prefill took {r['prefill_s']:.1f} s and {r['prefill_cpu_user_s']:.1f} s user, "
              f"{r['prefill_cpu_sys_s']:.1f} s system CPU, {r['prefill_faults']['minor']} minor and "
              f"{r['prefill_faults']['major']} major page faults; the decode {sum(r['decode_step_s']):.1f} s and "
              f"{r['decode_cpu_user_s']:.1f} s user, {r['decode_cpu_sys_s']:.1f} s system CPU, "
              f"{r['decode_faults']['minor']} minor and {r['decode_faults']['major']} major page faults")
    for r in results:
        regions = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["decode_steady_region_ms_per_token"].items(),
                                                              key=lambda kv: -kv[1]) if v >= 0.5)
        cpu = ", ".join(f"{g} {d['user_s'] + d['system_s']:.0f}"
                        for g, d in r["decode_steady_thread_cpu_ms_per_token"].items())
        steady = r["decode_step_s"][args.warm:]
        print(f"{r['store']}: a steady decode step {1000 * sum(steady) / len(steady):.0f} ms: {regions} ms; "
              f"CPU ms by thread: {cpu}")
    decode = {r["store"]: r["decode_tps_steady"] for r in results}
    for a, b in (("streaming", "mmap"), ("streaming", "mmap-unguessed"), ("streaming-unguessed", "mmap-unguessed")):
        if a in decode and b in decode:
            print(f"{a} / {b} decode: {decode[a] / decode[b]:.2f}x")
    load_after = list(os.getloadavg())
    print(f"load average before {load_before}, after {load_after}")
    out = args.out or common.RESULTS_DIR / f"scale-{args.preset}-{args.quant}.json"
    common.write_json(out, {
        "benchmark": "scale", "preset": args.preset, "scheme": args.quant, "container": str(path),
        "machine": info, "load_average_before": load_before, "load_average_after": load_after,
        "synth_seconds": synth_s, "trunk_bytes": counts["trunk_bytes"], "expert_bytes": counts["expert_bytes"],
        "sequential_read": seq, "copy_bandwidth": mem, "matvec_read": reads, "fresh_memory_sys_s_per_gb": fresh,
        "settings": {"prompt_len": args.prompt_len, "warm_prompt_len": args.warm_prompt_len, "new": args.new,
                     "warm": args.warm, "prefill_chunk": args.prefill_chunk, "read_threads": args.read_threads,
                     "ram": args.ram},
        "runs": results,
    })
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
