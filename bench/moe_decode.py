"""Decode with a MoE layer's experts run together against one expert at a time (issue 17).

A decode step runs each MoE layer's routed experts (and the shared ones when their format and
shape match) in one kernel call, `waste.kernels.moe.gated_experts_one_token` (with their weighted
sum, `gated_experts_sum_one_token`, when the store hands out every expert at once). The baseline
is the per-expert path (swiglu / situ_mlp per expert, four calls and two parallel regions
each), which the layer takes when those functions decline; here they are made to. One model,
two sessions, decode steps alternated one by one between the two (the first of each pair
alternating too), so the machine's load and the caches touch both alike; the logits of every
step must be identical. Per preset and scheme: min and median ms per step and MoE ms per step,
and the median ratios. Prints a table, writes bench/results/moe_decode.json. Asserts the bits only.

    python bench/moe_decode.py [--runs mini:q8 mini:q4 mini:q4all k3-mini:q8] [--new 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import common
import numpy as np

import waste.engine.moe_layer as moe_layer
from waste.container import open_container
from waste.engine.model import LayerTimes, Model

# Per mode, the two functions the layer calls (both declining: the per-expert path).
TABLES_FOR = moe_layer.MoELayer._tables_for
MODES = {"per_expert": (lambda *args: None, lambda *args: None),
         "together": (moe_layer.gated_experts_one_token, moe_layer.gated_experts_sum_one_token)}


def use(mode: str) -> None:
    moe_layer.gated_experts_one_token, moe_layer.gated_experts_sum_one_token = MODES[mode]
    # The layer's expert tables (a memory-mapped store's decode) run the one-call kernel too.
    moe_layer.MoELayer._tables_for = TABLES_FOR if mode == "together" else (lambda *args: None)


def alternate(path: Path, new: int, rounds: int, prompt_len: int) -> dict[str, Any]:
    """Per mode: the decode step times and MoE times of `rounds` x `new` alternated steps."""
    steps: dict[str, list[float]] = {m: [] for m in MODES}
    moe: dict[str, list[float]] = {m: [] for m in MODES}
    with open_container(path) as c:
        model = Model(c)
        prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, prompt_len)
        for r in range(rounds + 1):  # round 0 warms up (compiles, faults the weights in)
            sessions, tokens = {}, {}
            for m in MODES:
                use(m)
                sessions[m] = model.new_session(prompt_len + new + 1)
                tokens[m] = int(np.argmax(model.prefill(sessions[m], prompt, all_logits=False)[-1]))
            for i in range(new if r else 3):
                logits = {}
                for m in list(MODES)[:: 1 if (i + r) % 2 == 0 else -1]:
                    use(m)
                    model.times = LayerTimes()
                    t0 = time.perf_counter()
                    logits[m] = model.decode(sessions[m], tokens[m])
                    if r:
                        steps[m].append(time.perf_counter() - t0)
                        moe[m].append(model.times.seconds["moe"])
                    tokens[m] = int(np.argmax(logits[m]))
                if not np.array_equal(logits["together"], logits["per_expert"]):
                    raise AssertionError(f"{path.name}: the logits of step {i} differ between the two paths")
    use("together")
    out: dict[str, Any] = {}
    for m in MODES:
        out[m] = {"step_ms_min": 1e3 * min(steps[m]), "step_ms_median": 1e3 * float(np.median(steps[m])),
                  "moe_ms_min": 1e3 * min(moe[m]), "moe_ms_median": 1e3 * float(np.median(moe[m]))}
    out["step_ratio_median"] = out["per_expert"]["step_ms_median"] / out["together"]["step_ms_median"]
    out["moe_ratio_median"] = out["per_expert"]["moe_ms_median"] / out["together"]["moe_ms_median"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["mini:q8", "mini:q4", "mini:q4all", "k3-mini:q8"],
                        help="preset:scheme pairs")
    parser.add_argument("--new", type=int, default=32, help="decode steps per mode and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--cache-dir", type=Path, default=common.CACHE_DIR)
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR / "moe_decode.json")
    args = parser.parse_args()
    info = common.machine_info()
    print(f"{info}\n{common.uptime()}")
    rows = []
    for run in args.runs:
        preset, scheme = run.split(":")
        r = alternate(common.mini_container(scheme, args.cache_dir, preset=preset), args.new, args.rounds,
                      args.prompt_len)
        rows.append({"preset": preset, "scheme": scheme, **r, "load_average": list(os.getloadavg())})
    print(common.format_table(
        ["preset", "scheme", "step ms per-expert", "step ms together", "ratio", "MoE ms per-expert",
         "MoE ms together", "ratio", "load"],
        [[r["preset"], r["scheme"], r["per_expert"]["step_ms_median"], r["together"]["step_ms_median"],
          r["step_ratio_median"], r["per_expert"]["moe_ms_median"], r["together"]["moe_ms_median"],
          r["moe_ratio_median"], r["load_average"][0]] for r in rows]))
    print("medians over alternated decode steps; logits identical at every step")
    common.write_json(args.out, {"benchmark": "moe_decode", "machine": info, "threads": common.num_threads(),
                                 "settings": vars(args) | {"cache_dir": str(args.cache_dir), "out": str(args.out)},
                                 "runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
