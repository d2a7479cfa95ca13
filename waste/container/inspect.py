"""`waste info` (what a container holds) and `waste verify` (every CRC and bound)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

from tqdm import tqdm

from waste.container.format import ContainerError
from waste.container.reader import Container, open_container
from waste.container.verify import verify_files
from waste.tokenizer import tokenizer_problems
from waste.units import human_bytes


def info(c: Container) -> dict[str, Any]:
    """A JSON-able summary: config, scheme, storage formats, bytes by class."""
    cfg = c.config
    counts = c.byte_counts()
    formats = Counter(f"{c.entry(n).kind} {c.entry(n).storage}" for n in c.names())
    return {
        "path": str(c.path),
        "format_version": c.manifest["format_version"],
        "scheme": c.scheme,
        "manifest_sha256": c.manifest_sha256,
        "model_type": cfg.model_type,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
        "kda_layers": cfg.kda_layers,
        "mla_layers": cfg.mla_layers,
        "vocab_size": cfg.vocab_size,
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_token,
        "moe_layers": cfg.moe_layers,
        "trunk_tensors": len(c.names()),
        "trunk_formats": dict(formats),
        "expert_format": c.manifest["experts"]["parts"][0]["storage"],
        "source": c.manifest.get("source"),
        **counts,
    }


def _print_info(d: dict[str, Any]) -> None:
    print(f"{d['path']}  (WASTE container v{d['format_version']}, scheme {d['scheme']})")
    print(f"  model      {d['model_type']}: hidden {d['hidden_size']}, {d['num_layers']} layers "
          f"({len(d['kda_layers'])} KDA, {len(d['mla_layers'])} MLA), vocab {d['vocab_size']}")
    print(f"  experts    {d['num_experts']} per layer, top-{d['num_experts_per_token']}, "
          f"{len(d['moe_layers'])} MoE layers, stored {d['expert_format']}")
    print(f"  trunk      {human_bytes(d['trunk_bytes'])} in {d['trunk_tensors']} tensors "
          f"({', '.join(f'{v} {k}' for k, v in sorted(d['trunk_formats'].items()))})")
    for cls, n in sorted(d["per_class"].items(), key=lambda kv: -kv[1]):
        print(f"    {cls:<15}{human_bytes(n):>12}")
    print(f"  experts    {human_bytes(d['expert_bytes'])} = {d['expert_layers']} x {d['num_experts']} blobs of "
          f"{human_bytes(d['expert_blob_bytes'])} ({human_bytes(d['expert_data_bytes'])} data)")
    print(f"  manifest   sha256 {d['manifest_sha256']}")


def cmd_info(args: argparse.Namespace) -> int:
    """`waste info CONTAINER [--json]`: the manifest only (checked, with its checksum); no data is read."""
    with open_container(args.container, verify=False) as c:
        d = info(c)
    if getattr(args, "json", False):
        print(json.dumps(d, indent=2))
    else:
        _print_info(d)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """`waste verify CONTAINER`: exit 0 when every CRC matches, all padding is zero and every stored
    float is a number (and no MXFP4 scale is E8M0's NaN), else 2.

    Both files are read once, sequentially (`waste.container.verify`). A progress bar shows on
    stderr only when stderr is a terminal, so logs and pipes get nothing but the result line."""
    with open_container(args.container, verify=False) as c:  # verify_files below checks everything, and lists it
        counts = c.byte_counts()
        n_tensors = len(c.names())
        total = counts["trunk_bytes"] + counts["expert_bytes"]
        with tqdm(total=total, unit="B", unit_scale=True, desc="verify", file=sys.stderr, disable=None,
                  leave=False) as bar:
            report = verify_files(c, bar.update)
        problems = report.problems + tokenizer_problems(c)
    if problems:
        # Every problem is verify's report, on stdout; stderr keeps its one line: the first of them.
        if len(problems) > 1:
            for p in problems:
                print(p)
        more = len(problems) - 1
        raise ContainerError(problems[0] + (f" (and {more} more problem{'s' if more > 1 else ''}, listed on stdout)"
                                            if more else ""))
    blobs = counts["expert_layers"] * counts["num_experts"]
    print(f"{args.container}: OK ({n_tensors} trunk tensors, {blobs} expert blobs, {human_bytes(total)} checked in "
          f"{report.seconds:.2f} s, {report.gbps:.2f} GB/s, {'+'.join(sorted(report.io_modes)) or 'no'} reads)")
    return 0
