"""Conversion streams: peak RSS grows with the largest tensor, not with the checkpoint."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from waste.config import parse_config
from waste.container.format import expected_expert_tensors, expected_tensors
from waste.testing import tiny_config

# Many experts of modest size: the checkpoint is far larger than its largest tensor.
CONFIG = tiny_config(hidden_size=256, vocab_size=2048, moe_intermediate_size=256, num_experts=64,
                     num_hidden_layers=6, linear_attn_config={"kda_layers": [1, 2, 3, 5, 6],
                                                              "full_attn_layers": [4]})
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
import numpy as np
from waste.container.convert import convert
from waste.engine.memory import peak_rss as peak  # VmHWM: ru_maxrss carries pytest's size across exec
from waste.kernels.quant import quantize
from waste.synth import synthesize
import waste.container.reader, tqdm, ml_dtypes

# Imports and the quantiser's compiled kernels settle before the baseline.
for fmt in ("q8g", "q4g"):
    quantize(np.ones((32, 64), np.float32), fmt).matvec(np.ones(64, np.float32))
cfg, work, quant = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
base = peak()
hf = synthesize(cfg, work + "/hf", dtype="bf16", shard_bytes=1 << 30)
after_synth = peak()
convert(hf, work + "/out.waste", quant=quant, progress=False)
print(json.dumps({"base": base, "synth": after_synth, "convert": peak()}))
"""


def test_peak_rss_is_bounded_by_the_largest_tensor(tmp_path: Path) -> None:
    cfg = parse_config(CONFIG)
    shapes = list(expected_tensors(cfg).values()) + list(expected_expert_tensors(cfg).values())
    largest_f32 = max(4 * math.prod(s) for s in shapes)
    n_expert_values = len(cfg.moe_layers) * cfg.num_experts * sum(
        a * b for a, b in expected_expert_tensors(cfg).values())
    total_f32 = 4 * n_expert_values + sum(4 * math.prod(s) for s in shapes)
    # quantize() works on float64 copies of a tensor: allow a dozen float32 copies of the
    # largest tensor plus allocator slack (measured with VmHWM after the kernels compiled: 5.6 MiB
    # for q4 on 2026-12-01).
    bound = 12 * largest_f32 + (16 << 20)
    assert total_f32 > 4 * bound, "the checkpoint must dwarf the bound for the test to mean anything"

    run = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CONFIG), str(tmp_path), "q4"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rss = json.loads(run.stdout.strip().splitlines()[-1])
    assert rss["synth"] - rss["base"] < bound, (rss, bound, total_f32)
    assert rss["convert"] - rss["base"] < bound, (rss, bound, total_f32)
