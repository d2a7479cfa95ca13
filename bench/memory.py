"""This machine's memory as a decode step meets it: how fast a plain read goes by the size of
what it reads, against the copy that bench/peer.py holds the q4 decode to (issue 17).

- a plain read (`waste.analysis.budget.read_bandwidth`) of buffers from 2 MiB to 1 GiB, read
  again and again at 1 thread and at all cores: where it falls from the cache's speed to the
  memory's shows how much of the last-level cache this process gets (on a VM, a share of the
  host's);
- the copy of 512 MiB (`copy_bandwidth`, counting the bytes read plus the bytes written) at the
  same thread counts, and each read against it;
- the one-token q4g and q8g products streaming their weights from memory: a batch of
  4096 x 2048 matrices (16 MiB of q4g codes a call), stepping through copies that together
  exceed the last-level cache and its floor (`common.rotation`), at the same thread counts.

A decode step only reads its weights. Where the read of a buffer larger than the cache share
stays below 85% of the copy, a decode of a model larger than that share cannot reach 85% of
the copy either. Prints a table, writes bench/results/memory.json. Asserts nothing.

    python bench/memory.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import common
import numpy as np

from waste.analysis.budget import copy_bandwidth, copy_buffers, read_bandwidth
from waste.kernels.qbatch import QBatch
from waste.kernels.quant import quantize

READ_SIZES_MIB = (2, 8, 32, 64, 128, 256, 512, 1024)
PRODUCT_SHAPE = (4096, 2048)  # rows x inputs of each matrix of the product batch
PRODUCT_BATCH = 4  # matrices per call


def read_curve(threads: tuple[int, ...], rounds: int) -> list[dict[str, Any]]:
    """Best plain-read GB/s of one buffer per size and thread count."""
    rows = []
    for mib in READ_SIZES_MIB:
        buffer = np.ones((mib << 20) // 4, np.float32)
        for n in threads:
            rows.append({"mib": mib, "threads": n,
                         "gbps": read_bandwidth(buffer, rounds=rounds, threads=n)["gbps"]})
        del buffer
    return rows


def product_streams(threads: tuple[int, ...], rounds: int) -> list[dict[str, Any]]:
    """GB/s of weights the one-token q products stream from memory (median call of `rounds`
    passes over a rotation larger than the last-level cache, `common.rotation_bytes()`)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(PRODUCT_SHAPE).astype(np.float32)
    x = rng.standard_normal((1, PRODUCT_SHAPE[1])).astype(np.float32)
    rows_of = np.zeros(PRODUCT_BATCH, np.int64)
    out = []
    for fmt in ("q4g", "q8g"):
        one = quantize(w, fmt)
        batch_bytes = PRODUCT_BATCH * one.nbytes

        def batch(i: int, fmt: str = fmt) -> QBatch:  # distinct matrices: no call reads another's weights
            return QBatch([quantize(w * np.float32(1 + 1e-3 * (i * PRODUCT_BATCH + j)), fmt)
                           for j in range(PRODUCT_BATCH)])

        batches = common.rotation(batch, batch_bytes)
        for n in threads:
            with common.at_threads(n):
                for b in batches:  # compile, start the threads, fault the pages in
                    b(x, rows_of)
                times = []
                for _ in range(rounds):
                    for b in batches:
                        t0 = time.perf_counter()
                        b(x, rows_of)
                        times.append(time.perf_counter() - t0)
            out.append({"format": fmt, "threads": n, "batch_bytes": batch_bytes, "batches": len(batches),
                        "gbps": batch_bytes / float(np.median(times)) / 1e9})
        del batches
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR / "memory.json")
    args = parser.parse_args()
    threads = common.thread_counts()
    buffers = copy_buffers()
    copies = {n: copy_bandwidth(rounds=args.rounds, threads=n, buffers=buffers)["gbps"] for n in threads}
    del buffers
    reads = read_curve(threads, args.rounds)
    products = product_streams(threads, max(3, args.rounds // 3))

    print("plain read of one buffer, read again and again (GB/s); copy of 512 MiB counting reads and writes: "
          + ", ".join(f"{copies[n]:.1f} GB/s at {n} thread(s)" for n in threads))
    headers = ["MiB"] + [f"read {n}t" for n in threads] + [f"read/copy {n}t" for n in threads]
    table = []
    for mib in READ_SIZES_MIB:
        at = {r["threads"]: r["gbps"] for r in reads if r["mib"] == mib}
        table.append([mib, *(at[n] for n in threads), *(at[n] / copies[n] for n in threads)])
    print(common.format_table(headers, table))
    print(common.format_table(["product", "threads", "MiB a call", "GB/s", "of copy"],
                              [[p["format"], p["threads"], p["batch_bytes"] / 2**20, p["gbps"],
                                p["gbps"] / copies[p["threads"]]] for p in products]))
    common.write_json(args.out, {"benchmark": "memory", "machine": common.machine_info(),
                                 "l3_bytes": common.l3_bytes(), "rounds": args.rounds,
                                 "copy_gbps": {str(n): g for n, g in copies.items()},
                                 "reads": reads, "products": products})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
