"""`waste synth PRESET OUT.waste --quant q4|q8|f32`: random weights straight into a container.

The values are exactly those `waste.synth` writes to a float32 checkpoint (each tensor from
its own generator seeded by (seed, CRC32 of its name)), and they go through the same
`ContainerWriter` as `waste convert`, so the container's trunk.bin and experts.bin are byte
for byte those of `synth --dtype f32` followed by `convert` (a test holds it); only the
manifest's `source` differs. A K3 config's routed experts are MXFP4, quantised as synth's
checkpoint has them and stored so, as convert stores a checkpoint's. No checkpoint is written:
Kimi-Linear-48B-A3B would take 96 GB in bf16, its q4 container takes 27 GB.

Work is a pipeline: a small thread pool draws tensors' values (NumPy's generators release
the GIL while they fill), the calling thread quantises each (the Numba quantiser, itself on
every core) and writes it. Tensors are drawn in file order, and the bytes drawn but not yet
written are bounded (`max_pending_bytes`, or the one tensor larger than that), so memory
stays bounded whatever the model's size.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from waste.config import ModelConfig, parse_config
from waste.container.format import SCHEMES, expected_tensors, parse_expert_name
from waste.container.writer import ContainerWriter
from waste.errors import WasteError
from waste.kernels.mxfp4 import quantize_mxfp4
from waste.kernels.quant import QMatrix, from_buffers
from waste.synth import checkpoint_tensors, resolve_config, synth_values
from waste.tokenizer import CONTAINER_DIR as TOKENIZER_DIR
from waste.tokenizer import file_record, synthetic_tokenizer_files
from waste.units import human_bytes

DEFAULT_PENDING_BYTES = 256 << 20


def synthesize_container(cfg_or_preset: ModelConfig | dict[str, Any] | str | Path, out: str | Path, *,
                         quant: str = "q4", seed: int = 0, force: bool = False, progress: bool = True,
                         threads: int = 2, max_pending_bytes: int = DEFAULT_PENDING_BYTES) -> Path:
    """Write a container of random weights for a config at `out` (scheme `quant`); its path."""
    from tqdm import tqdm

    hf = resolve_config(cfg_or_preset).to_hf_dict()
    hf["dtype"] = "float32"  # the values are drawn in float32: the config synth's f32 checkpoint records
    cfg = parse_config(hf)
    if cfg.expert_quant not in (None, "mxfp4"):
        raise WasteError(f"synth --quant cannot write {cfg.expert_quant} experts: use waste synth then waste convert")
    mxfp4 = cfg.expert_quant == "mxfp4"
    if quant not in SCHEMES:
        raise WasteError(f"unknown quantisation scheme {quant!r}; expected one of {', '.join(SCHEMES)}")
    if threads < 1:
        raise WasteError(f"synth threads must be at least 1, got {threads}")
    tensors = checkpoint_tensors(cfg)
    trunk = expected_tensors(cfg)
    total = sum(4 * int(np.prod(s)) for s in tensors.values())
    source: dict[str, Any] = {"synth": {"seed": seed, "dtype": "f32"}}
    tokenizer = synthetic_tokenizer_files(cfg) or {}  # as synth writes it and convert carries it
    if tokenizer:
        source["tokenizer"] = file_record(tokenizer)
    names = iter(tensors.items())
    pending: deque[tuple[str, int, Future[np.ndarray]]] = deque()
    pending_bytes = 0
    with ContainerWriter(out, cfg, quant, trunk, force=force, extra={"source": source}) as w, \
            ThreadPoolExecutor(threads, "waste-synth") as pool, \
            tqdm(total=total, unit="B", unit_scale=True, desc=f"synth {quant}", file=sys.stderr,
                 disable=None if progress else True, leave=False) as bar:  # None: a terminal only
        while True:
            # Keep the pool busy, but never hold more than max_pending_bytes of drawn values
            # (one tensor may exceed it on its own: the embedding and lm_head at real sizes).
            while not pending or pending_bytes < max_pending_bytes:
                item = next(names, None)
                if item is None:
                    break
                name, shape = item
                nbytes = 4 * int(np.prod(shape))
                pending.append((name, nbytes, pool.submit(synth_values, name, shape, cfg, seed)))
                pending_bytes += nbytes
            if not pending:
                break
            name, nbytes, future = pending.popleft()
            values = future.result()
            expert = parse_expert_name(name)
            if expert is not None:
                # A K3 config ships MXFP4 experts: quantised as synth writes them to its checkpoint,
                # kept as they are by the writer (as convert keeps a checkpoint's).
                w.write_expert(*expert, _mxfp4_matrix(values) if mxfp4 else values)
            else:
                w.write_tensor(name, values)
            del values
            pending_bytes -= nbytes
            bar.update(nbytes)
        w.add_files(TOKENIZER_DIR, tokenizer)
        return w.finish()


def _mxfp4_matrix(values: np.ndarray) -> QMatrix:
    packed, scales = quantize_mxfp4(values)
    return from_buffers("mxfp4", values.shape, {"packed": packed, "scales": scales})


def cmd_synth_container(args: argparse.Namespace) -> int:
    """`waste synth PRESET OUT.waste --quant f32|q8|q4|q4all [--seed S] [--force] [--quiet]`."""
    from waste.container.reader import open_container

    given = [flag for flag, key in (("--dtype", "dtype"), ("--shard-size", "shard_size"),
                                    ("--expert-format", "expert_format"), ("--attn-res-spelling", "attn_res_spelling"))
             if getattr(args, key, None) is not None]
    if given:
        raise WasteError(f"{', '.join(given)} describe{'s' if len(given) == 1 else ''} a checkpoint; with --quant the "
                         "values are float32 and go straight into the container, its experts stored as --quant says")
    t0 = time.perf_counter()
    out = synthesize_container(args.preset, args.out_dir, quant=args.quant, seed=args.seed, force=args.force,
                               progress=not getattr(args, "quiet", False))
    with open_container(out) as c:
        counts = c.byte_counts()
    print(f"{out}: scheme {args.quant}, seed {args.seed}, trunk {human_bytes(counts['trunk_bytes'])}, experts "
          f"{human_bytes(counts['expert_bytes'])} ({counts['expert_layers']} x {counts['num_experts']} blobs of "
          f"{human_bytes(counts['expert_blob_bytes'])}), {time.perf_counter() - t0:.0f} s")
    return 0
