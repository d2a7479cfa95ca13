"""Streamed experts on the `mini` preset in `q4` (issue #7): decode tokens per second and expert
bytes read per token at cache budgets of 0, 10, 25, 50 and 100% of the expert bytes, with the
achieved read bandwidth next to a plain sequential read of experts.bin in the same run.

Experts come from `StreamingExpertStore` (positional reads into an LRU cache with a byte
budget), opened with O_DIRECT so the page cache cannot serve them; when the file system
refuses O_DIRECT the store reads buffered and the table says so (`io`). Before every budget
the page cache of experts.bin is dropped (posix_fadvise DONTNEED; with --drop-all-caches, as
root, also /proc/sys/vm/drop_caches, which empties the whole machine's page cache). Per
budget: a fresh store and session, a prompt of `--prompt-len` tokens (which fills the cache),
then `--new` greedy decode steps; the store's counters are reset between the two, so the
decode columns count decode alone.

`read GB/s` is the store's bytes over its wall time inside reads (the pool's reads overlap, so
this is what the reads achieved together); `read %` is that time's share of the decode time
(a MoE layer computes its cached and shared experts while its misses are read, so this is the
time with reads in flight, not all of it spent waiting).
The integrity check's cost (issue 14; target under 5% of decode time) is measured step by step,
so that the rest of the machine's load falls on both sides alike: the decode steps of a run
alternate between checking the CRC32C of the expert blobs they read and not checking them (the
store's switch that `waste run --no-verify` sets), and every budget runs `--repeats` pairs of
runs, the second of a pair checking the steps the first did not. Every step is so timed checked
and unchecked, on the same tokens, cache state and reads, at the same read and Numba thread
counts, with experts.bin evicted from the page cache before every run and read with O_DIRECT. The
store checks each blob in its reader thread after handing it out, and each step waits for its
checks before its logits (`waste.engine.experts`). `crc cost %` is the checked steps' time less
the unchecked ones', over the checked ones'; `crc cost med %` the median of the step pairs'
differences over the median checked step (either can come out negative when the difference is
below the noise; the JSON keeps every run's decode time); `decode tok/s` and `no-verify tok/s`
are the checked and unchecked steps' rates. `crc thread %` is the time spent in `check_expert`
on the blobs decode read, over the checked steps' time (summed over reader threads, so an upper
bound on what it adds to the wall time). The trunk's CRCs, checked once per open, are timed
separately: `open_container` with and without them.
The sequential baseline reads experts.bin start to end in 8 MiB reads in the same I/O mode,
before and after the budgets (the better is kept). Prints a table, writes
bench/results/streaming.json. Asserts nothing.

    python bench/streaming.py [--budgets 0 10 25 50 100] [--prompt-len 64] [--new 64] [--repeats 2]
                              [--quick] [--drop-all-caches]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import common
import numpy as np

from waste.container import open_container
from waste.engine.experts import POLICIES, StreamingExpertStore
from waste.engine.model import DEFAULT_PREFILL_CHUNK, Model

QUANT = "q4"
CRC_COST_METHOD = ("decode steps alternate between checking the expert CRC32C of the blobs they read (in the "
                   "reader threads, after hand-out; each step waits for its checks) and not checking them; each "
                   "budget runs --repeats pairs of runs that swap which steps check, so every step is timed both "
                   "ways on the same tokens and cache state, at the same read and Numba thread counts, with "
                   "experts.bin evicted from the page cache before every run and read with O_DIRECT unless io says "
                   "buffered; cost = (checked - unchecked step time) / checked step time, summed, and from the "
                   "median step pair")


def run_budget(container: Any, fraction: float, prompt: np.ndarray, args: argparse.Namespace,
               checked_parity: int) -> dict[str, Any]:
    """One cache budget: drop the page cache, prefill `prompt` through a fresh store, decode `args.new`
    tokens; the decode steps whose index has parity `checked_parity` check the blobs they read."""
    expert_bytes = container.byte_counts()["expert_bytes"]
    budget = int(fraction * expert_bytes)
    dropped = common.drop_page_cache(container.experts_path, whole_machine=args.drop_all_caches)
    crc_seconds: list[float] = []
    check = container.check_expert

    def timed_check(layer: int, expert: int, blob: np.ndarray) -> None:
        t = time.perf_counter()
        check(layer, expert, blob)
        crc_seconds.append(time.perf_counter() - t)  # list.append is atomic: reader threads share it

    container.check_expert = timed_check
    try:
        with StreamingExpertStore(container, budget, args.policy, args.read_threads,
                                  io="buffered" if args.buffered else "direct") as store:
            model = Model(container, store=store)
            session = model.new_session(len(prompt) + args.new)
            t0 = time.perf_counter()
            logits = model.prefill(session, prompt, chunk=args.prefill_chunk, all_logits=False)
            prefill_s = time.perf_counter() - t0
            prefill = store.stats.total
            store.stats.reset()
            crc_seconds.clear()
            token = int(np.argmax(logits[-1]))
            tokens, step_s, checked = [], [], []
            for step in range(args.new):
                checked.append(step % 2 == checked_parity)
                # The switch `waste run --no-verify` sets through the container, here per step: the
                # store checks the blobs it reads from now on, or not (each step waits for its own).
                store._verify = checked[-1]
                t0 = time.perf_counter()
                token = int(np.argmax(model.decode(session, token)))
                step_s.append(time.perf_counter() - t0)
                tokens.append(token)
            dec = store.stats.total
    finally:
        del container.check_expert
    decode_s = sum(step_s)
    checked_s = sum(t for t, c in zip(step_s, checked, strict=True) if c)
    return {
        "budget_fraction": fraction, "budget_bytes": budget, "cached_bytes_at_end": store.cached_bytes,
        "io_mode": store.io_mode, "io_note": store.io_note, "cache_dropped": dropped,
        "prefill_s": prefill_s, "prefill_tps": len(prompt) / prefill_s, "prefill_bytes_read": prefill.bytes_read,
        "decode_s": decode_s, "decode_bytes_per_token": dec.bytes_read / args.new,
        "decode_hit_rate": None if np.isnan(dec.hit_rate) else dec.hit_rate,
        "decode_read_s": dec.read_seconds, "decode_read_share": dec.read_seconds / decode_s,
        "decode_read_gbps": None if np.isnan(dec.gbps) else dec.gbps,
        "checked_step_s": checked_s, "decode_crc_s": sum(crc_seconds),
        "step_s": step_s, "step_checked": checked, "tokens": tokens, "decode_stats": dec.as_dict(),
    }


def checked_and_unchecked(container: Any, fraction: float, prompt: np.ndarray, args: argparse.Namespace
                          ) -> dict[str, Any]:
    """One budget in `args.repeats` pairs of runs whose decode steps alternate between checking the
    expert CRCs and not, the second run of a pair checking the steps the first did not: the CRC's
    cost from every step timed both ways, and the first run's figures for the rest."""
    runs = [run_budget(container, fraction, prompt, args, r % 2) for r in range(2 * args.repeats)]
    checked = [t for run in runs for t, c in zip(run["step_s"], run["step_checked"], strict=True) if c]
    unchecked = [t for run in runs for t, c in zip(run["step_s"], run["step_checked"], strict=True) if not c]
    # Step k checked in run 2j against step k unchecked in run 2j + 1, and the other way round.
    pairs = [(a, b) if ca else (b, a) for first, second in zip(runs[::2], runs[1::2], strict=True)
             for a, b, ca in zip(first["step_s"], second["step_s"], first["step_checked"], strict=True)]
    tokens_agree = all(run["tokens"] == runs[0]["tokens"] for run in runs)
    out = runs[0]
    for key in ("step_s", "step_checked", "tokens"):
        del out[key]
    out["decode_tps"] = len(checked) / sum(checked)
    out["unchecked_decode_tps"] = len(unchecked) / sum(unchecked)
    out["crc_cost_share"] = (sum(checked) - sum(unchecked)) / sum(checked)
    out["crc_cost_share_median"] = float(np.median([a - b for a, b in pairs]) / np.median(checked))
    out["decode_crc_share"] = sum(run["decode_crc_s"] for run in runs) / sum(checked)
    out["decode_s_runs"] = [run["decode_s"] for run in runs]
    out["tokens_agree"] = tokens_agree
    out["repeats"] = args.repeats
    return out


def time_open_check(path: Path, rounds: int = 5) -> dict[str, Any]:
    """Best-of-`rounds` seconds of open_container with and without the trunk's CRCs (page cache warm:
    the check's own cost, not the disk's)."""
    best = {}
    for verify in (False, True, False, True):
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            with open_container(path, verify=verify) as c:
                trunk_bytes = c.byte_counts()["trunk_bytes"]
            times.append(time.perf_counter() - t0)
        best[verify] = min(best.get(verify, np.inf), min(times))
    crc_s = max(best[True] - best[False], 1e-9)
    return {"verified_s": best[True], "unverified_s": best[False], "trunk_bytes": trunk_bytes,
            "crc_gbps": trunk_bytes / crc_s / 1e9}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0, 10, 25, 50, 100],
                        help="cache budgets in percent of experts.bin")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new", type=int, default=64, help="tokens to decode per budget")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK)
    parser.add_argument("--policy", choices=POLICIES, default="lru")
    parser.add_argument("--read-threads", type=int, default=4)
    parser.add_argument("--buffered", action="store_true", help="read without O_DIRECT")
    parser.add_argument("--drop-all-caches", action="store_true",
                        help="as root, also drop the whole machine's page cache before each budget "
                             "(by default only experts.bin is evicted, with posix_fadvise)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="pairs of runs per budget, each step checked in one run of a pair and not in the other")
    parser.add_argument("--quick", action="store_true", help="budgets 0 and 100 only, 16 decoded tokens")
    parser.add_argument("--cache-dir", type=Path, default=common.CACHE_DIR)
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR / "streaming.json")
    args = parser.parse_args()
    if args.quick:
        args.budgets, args.new = [0, 100], 16
    if args.prompt_len < 1 or args.new < 1 or args.repeats < 1 or any(not 0 <= b <= 100 for b in args.budgets):
        parser.error("--prompt-len, --new and --repeats must be at least 1, budgets within 0..100")
    info = common.machine_info()
    print(f"{info['cpu']}, {info['cores']} cores, Numba {info['numba']} ({info['numba_threads']} threads), "
          f"load average {info['load_average']}")
    path = common.mini_container(QUANT, args.cache_dir)
    rng = np.random.default_rng(0)
    with open_container(path) as c:
        counts = c.byte_counts()
        prompt = rng.integers(0, c.config.vocab_size, args.prompt_len)
        # Compile every kernel on the streamed path before anything is timed.
        with StreamingExpertStore(c, 0, args.policy, args.read_threads,
                                  io="buffered" if args.buffered else "direct") as store:
            model = Model(c, store=store)
            session = model.new_session(16)
            model.prefill(session, prompt[:8], chunk=args.prefill_chunk)
            model.decode(session, 0)
            direct = store.io_mode == "direct"
        seq_start = common.sequential_read(c.experts_path, direct=direct)
        print(f"mini {QUANT}: experts.bin {counts['expert_bytes'] / 1e6:.1f} MB ({counts['expert_layers']} layers x "
              f"{counts['num_experts']} blobs of {counts['expert_blob_bytes'] / 1024:.0f} KiB); sequential read "
              f"{seq_start['gbps']:.2f} GB/s ({seq_start['io_mode']}, page cache dropped by "
              f"{seq_start['cache_dropped']}); prompt {args.prompt_len}, {args.new} decoded, {args.policy}, "
              f"{args.read_threads} read threads")
        results = [checked_and_unchecked(c, b / 100, prompt, args) for b in args.budgets]
        seq_end = common.sequential_read(c.experts_path, direct=direct)
    open_check = time_open_check(path)
    print(f"trunk CRC32C on open: {open_check['verified_s'] * 1e3:.1f} ms against "
          f"{open_check['unverified_s'] * 1e3:.1f} ms without ({open_check['trunk_bytes'] / 1e6:.1f} MB, "
          f"{open_check['crc_gbps']:.2f} GB/s)")
    seq_gbps = max(seq_start["gbps"], seq_end["gbps"])
    rows = []
    for r in results:
        r["read_vs_sequential"] = None if r["decode_read_gbps"] is None else r["decode_read_gbps"] / seq_gbps
        hit = r["decode_hit_rate"]
        rows.append([f"{100 * r['budget_fraction']:g}%", r["budget_bytes"] / 1e6, r["io_mode"], r["decode_tps"],
                     r["unchecked_decode_tps"], 100 * r["crc_cost_share"], 100 * r["crc_cost_share_median"],
                     100 * r["decode_crc_share"],
                     r["decode_bytes_per_token"] / 1e6, None if hit is None else 100 * hit, r["decode_read_gbps"],
                     None if r["read_vs_sequential"] is None else 100 * r["read_vs_sequential"],
                     100 * r["decode_read_share"], r["prefill_tps"]])
    print(common.format_table(["budget", "MB", "io", "decode tok/s", "no-verify tok/s", "crc cost %",
                               "crc cost med %", "crc thread %", "expert MB/tok", "hit %", "read GB/s", "% seq",
                               "read %", "prefill tok/s"], rows))
    print(f"crc cost: {CRC_COST_METHOD}")
    print(f"sequential read of experts.bin: {seq_start['gbps']:.2f} GB/s before, {seq_end['gbps']:.2f} GB/s after "
          f"({seq_start['io_mode']})")
    common.write_json(args.out, {
        "benchmark": "streaming", "preset": "mini", "scheme": QUANT, "machine": info,
        "load_average_at_end": list(os.getloadavg()),
        "settings": {"prompt_len": args.prompt_len, "new": args.new, "prefill_chunk": args.prefill_chunk,
                     "repeats": args.repeats, "crc_cost_method": CRC_COST_METHOD,
                     "policy": args.policy, "read_threads": args.read_threads, "direct_io": not args.buffered},
        "expert_bytes": counts["expert_bytes"], "expert_blob_bytes": counts["expert_blob_bytes"],
        "sequential_read": {"start": seq_start, "end": seq_end, "gbps": seq_gbps},
        "trunk_check_on_open": open_check,
        "budgets": results,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
