"""What a decode step pays outside its kernels' arithmetic: with warm caches, and with the caches
emptied the way a step's weights empty them (a buffer of COLD_BYTES, about what a `mini` q4
step reads, 112.6 MB of weights, streamed before each call).

- Numba's dispatch of a call with 33 array arguments (a MoE layer's decode step takes 21 arrays
  and 12 scalars, a KDA layer's about 30 arrays) and of a call with one;
- an empty parallel region (a prange over two) against a serial call (a `mini` step opens
  about 48 regions: 4 per KDA layer, 2 per MoE layer);
- the residual step between two layers: add, finite check and RMSNorm as the three calls the
  model made before `f46b587`, against `PlainResidual.add_normed` (`norm.add_check_norm`);
- the embedding row (`QMatrix.take_rows`, one id) of `mini` q4;
- one MoE layer's decode step of `mini` q4 (`MoELayer.forward`), its kernel call
  (`_moe_one_token`, Numba's dispatch included) timed apart: the rest is the Python around it.

The two sides of each pair alternate call by call; medians over --rounds calls. "In a step":
the dispatch and region pairs once more, each call made before every attention and FFN layer of
`mini` q4 decode steps (steps with either call or with neither, in turn): the median step's growth
over the calls it made. That is what a call costs where a decode makes it; "cold" (after 128 MiB
streamed, several milliseconds in which the pool's worker goes to sleep) overstates it. Prints a
table, writes bench/results/overhead.json. Asserts nothing.

    python bench/overhead.py [--rounds 300]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import numpy as np

import waste.kernels.moe_step as moe_kernels
from waste.container import open_container
from waste.engine.model import Model, check_finite
from waste.engine.moe_layer import MoELayer
from waste.engine.residual import PlainResidual
from waste.jit import kernel, parallel_kernel, prange
from waste.kernels.norm import rms_norm

# Streamed before each cold call: a step's weights, not the sysfs L3 (32 MiB on guests whose
# process still read 64 MiB at cache speed, bench/memory.py).
COLD_BYTES = 128 << 20


@kernel
def _first_of_33(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20,
                 a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32):
    return a0[0]


@kernel
def _first_of_1(a0):
    return a0[0]


@parallel_kernel
def _empty_region(out):
    for i in prange(2):
        out[i] += 1.0


@kernel
def _serial_pair(out):
    for i in range(2):
        out[i] += 1.0


def _medians(pairs: dict[str, Callable[[], Any]], rounds: int, cold: bool, flush: np.ndarray) -> dict[str, float]:
    """Median microseconds of each callable, called in turn `rounds` times (after streaming
    `flush` before every call when `cold`)."""
    times: dict[str, list[float]] = {name: [] for name in pairs}
    for _ in range(rounds):
        for name, fn in pairs.items():
            if cold:
                flush += 1.0
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) * 1e6 for name, t in times.items()}


def _moe_layer_step(model: Model, rng: np.random.Generator) -> tuple[Callable[[], None], list[float]]:
    """A MoE layer's decode step (the layers in turn, fresh tokens) and the seconds its kernel
    call (Numba's dispatch included) took, accumulated in the returned list; every expert handed
    out first, so each step runs from the layer's tables."""
    layers = [f for f in model.ffn if isinstance(f, MoELayer)]
    hidden = model.config.hidden_size
    for layer in layers:
        for _ in range(64 * model.config.num_experts // model.config.num_experts_per_token):
            layer.forward(rng.standard_normal((1, hidden)).astype(np.float32), model.store)
    kernel_seconds = [0.0]
    inner = moe_kernels._moe_one_token

    def timed_kernel(*args: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(*args)
        kernel_seconds[0] += time.perf_counter() - t0
        return out

    moe_kernels._moe_one_token = timed_kernel  # route_and_sum calls it by its module name
    tokens = [rng.standard_normal((1, hidden)).astype(np.float32) for _ in range(64)]
    state = {"i": 0}

    def step() -> None:
        i = state["i"]
        state["i"] = i + 1
        layers[i % len(layers)].forward(tokens[i % len(tokens)], model.store)

    return step, kernel_seconds


def _in_decode_steps(model: Model, calls: dict[str, Callable[[], Any]], rounds: int,
                     rng: np.random.Generator) -> dict[str, float]:
    """Microseconds each of `calls` adds to a decode step when it is made before every attention
    and FFN layer: steps alternate between each call and none; the median step's growth over the
    step without, per call made."""
    extra: dict[str, Callable[[], Any] | None] = {"call": None}

    def before(method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any) -> Any:
            if extra["call"] is not None:
                extra["call"]()
            return method(*args)
        return wrapped

    for attn in model.attn:
        attn.decode = before(attn.decode)
    for ffn in model.ffn:
        ffn.forward = before(ffn.forward)
    per_step = 2 * len(model.attn)
    options: dict[str, Callable[[], Any] | None] = {"none": None, **calls}
    steps: dict[str, list[float]] = {name: [] for name in options}
    session = model.new_session(512)
    try:
        for _ in range(rounds):
            for name, call in options.items():
                if session.position >= 500:
                    session = model.new_session(512)
                extra["call"] = call
                t0 = time.perf_counter()
                model.decode(session, int(rng.integers(0, model.config.vocab_size)))
                steps[name].append(time.perf_counter() - t0)
    finally:  # the classes' methods again
        for attn in model.attn:
            del attn.decode
        for ffn in model.ffn:
            del ffn.forward
    base = float(np.median(steps["none"]))
    return {name: (float(np.median(steps[name])) - base) / per_step * 1e6 for name in calls}


def measure(rounds: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    flush = np.ones(COLD_BYTES // 4, np.float32)
    arrays = [np.zeros(i + 3, np.float32) for i in range(33)]
    pair = np.zeros(2)
    width = 1024
    weight = rng.standard_normal(width).astype(np.float32)
    positions = np.array([0])

    inputs = rng.standard_normal((64, 2, 1, width)).astype(np.float32)  # (h, delta) pairs, made beforehand
    turn = {"three": 0, "one": 0}

    def three_calls() -> None:
        h, delta = inputs[turn["three"] % len(inputs)]
        turn["three"] += 1
        stream = PlainResidual(h)
        stream.add(delta)
        check_finite(delta, "layer", positions)
        rms_norm(stream.hidden, weight, 1e-6)

    def one_call() -> None:
        h, delta = inputs[turn["one"] % len(inputs)]
        turn["one"] += 1
        PlainResidual(h).add_normed(delta, weight, 1e-6)

    groups: list[tuple[str, dict[str, Callable[[], Any]]]] = [
        ("dispatch", {"33 array arguments": lambda: _first_of_33(*arrays),
                      "1 array argument": lambda: _first_of_1(arrays[0])}),
        ("parallel region", {"empty parallel region": lambda: _empty_region(pair),
                             "serial call": lambda: _serial_pair(pair)}),
        ("residual step", {"add, check, norm: 3 calls": three_calls, "add_check_norm: 1 call": one_call}),
    ]
    rows = []
    path = common.mini_container("q4")
    with open_container(path) as c:
        model = Model(c)
        ids = rng.integers(0, model.config.vocab_size, 64)
        embed_state = {"i": 0}

        def embed_row() -> None:
            embed_state["i"] += 1
            model.embed.take_rows(ids[embed_state["i"] % len(ids):][:1])

        for name, fns in groups[:2]:  # the dispatch and region pairs where a decode makes its calls
            for label, us in _in_decode_steps(model, fns, rounds, rng).items():
                rows.append({"group": name, "what": label, "caches": "in a step", "us": us})
        groups.append(("embedding", {"take_rows, one id": embed_row}))
        unpatched = moe_kernels._moe_one_token
        step, kernel_seconds = _moe_layer_step(model, rng)
        for name, fns in groups:
            for fn in fns.values():
                fn()  # compiled and warm
            for cold in (False, True):
                for label, us in _medians(fns, rounds, cold, flush).items():
                    rows.append({"group": name, "what": label, "caches": "cold" if cold else "warm", "us": us})
        for cold in (False, True):
            totals, kernels = [], []
            for _ in range(rounds):
                if cold:
                    flush += 1.0
                before = kernel_seconds[0]
                t0 = time.perf_counter()
                step()
                totals.append(time.perf_counter() - t0)
                kernels.append(kernel_seconds[0] - before)
            caches = "cold" if cold else "warm"
            for what, seconds in (("forward", totals), ("its kernel call", kernels),
                                  ("the Python around it", np.subtract(totals, kernels))):
                rows.append({"group": "MoE layer (mini q4)", "what": what, "caches": caches,
                             "us": float(np.median(seconds)) * 1e6})
        moe_kernels._moe_one_token = unpatched
    return {"machine": common.machine_info(), "rounds": rounds, "cold_bytes": COLD_BYTES, "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300, help="calls of each callable, alternating")
    parser.add_argument("--out", default=str(common.RESULTS_DIR / "overhead.json"))
    args = parser.parse_args()
    report = measure(args.rounds)
    table = [(r["group"], r["what"], r["caches"], r["us"]) for r in report["rows"]]
    print(f"microseconds, median of {args.rounds} alternating calls; cold: {COLD_BYTES >> 20} MiB streamed before each")
    print(common.format_table(("group", "what", "caches", "us"), table, floats=".1f"))
    common.write_json(Path(args.out), report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
