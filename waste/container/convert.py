"""`waste convert`: a Hugging Face checkpoint (config.json + safetensors shards) to NAME.waste.

The safetensors headers are read first (they are small), and the tensor set is checked
against `expected_tensors(cfg)` before any data is touched: missing, unexpected and
misshapen tensors are all named. Data is then streamed shard by shard, one tensor at a
time, read with plain file reads (not a memory map, so resident memory stays bounded by
the largest tensor rather than growing with the shard) and decoded through ml_dtypes for
bfloat16.

K3 checkpoints are read through `k3_layout`: the `language_model.` prefix goes, the vision
tensors are skipped, both AttnRes spellings and both router-bias spellings are accepted, and
MXFP4 routed experts (`weight_packed` + `weight_scale`) reach the container byte for byte unless
`--experts` asks for another storage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from waste.config import ModelConfig, load_config_file
from waste.container import k3_layout
from waste.container.format import (
    EXPERT_PARTS,
    SCHEMES,
    Shape,
    canonical_name,
    expected_expert_tensors,
    expected_tensors,
    expert_name,
    expert_storage,
    is_container_dir,
    parse_expert_name,
    shape_accepted,
)
from waste.container.writer import ContainerWriter
from waste.errors import WasteError
from waste.fileio import NotRegularFile, check_output_dir, open_regular, read_bounded, recover_stale
from waste.tokenizer import CONTAINER_DIR as TOKENIZER_DIR
from waste.tokenizer import file_record, tokenizer_file_bytes
from waste.units import human_bytes

INDEX = "model.safetensors.index.json"
_ST_DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
              "U8": np.dtype(np.uint8)}
_E8M0_NAN = 255  # the one scale byte that is not a power of two
_MAX_HEADER = 100_000_000  # bytes: the safetensors library's own limit


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of a safetensors file: where its bytes are."""

    name: str  # as spelled in the checkpoint
    path: Path
    dtype: str  # safetensors dtype: BF16, F16, F32
    shape: Shape
    start: int  # absolute offset in the file
    nbytes: int


class _DuplicateKey(ValueError):
    """A JSON object gives one key twice."""


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object's pairs as a dict, refusing a key given twice (json.loads would keep the last)."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def read_header(path: Path) -> list[SourceTensor]:
    """The tensors a safetensors file declares, checked against the file's size and against each
    other (no two share bytes). A K3 checkpoint's vision tensors may have any dtype: they are listed
    (for `inventory` to count) but never read."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise WasteError(f"{path}: no such file") from None
    except NotRegularFile:
        raise WasteError(f"{path}: not a regular file") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        head = f.read(8)
        if len(head) < 8:
            raise WasteError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise WasteError(f"{path}: header of {n} bytes is larger than the {_MAX_HEADER} safetensors allows")
        if n > size - 8:
            raise WasteError(f"{path}: header of {n} bytes runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
        except _DuplicateKey as e:
            raise WasteError(f"{path}: safetensors header names {e.args[0]!r} twice") from None
        except (ValueError, RecursionError) as e:
            raise WasteError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise WasteError(f"{path}: safetensors header is not a JSON object")
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (lo, hi) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            ok = isinstance(dtype, str) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                for v in (*shape, lo, hi))
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise WasteError(f"{path}: tensor {name!r} has a malformed header entry")
        if hi < lo:
            raise WasteError(f"{path}: tensor {name!r}: data_offsets [{lo}, {hi}] end before they start")
        if k3_layout.is_vision(name):
            out.append(SourceTensor(name, path, dtype, shape, 8 + n + lo, hi - lo))
            continue
        if dtype not in _ST_DTYPES:
            raise WasteError(f"{path}: tensor {name!r} has dtype {dtype}; expected one of {', '.join(_ST_DTYPES)}")
        if hi - lo != math.prod(shape) * _ST_DTYPES[dtype].itemsize:
            raise WasteError(f"{path}: tensor {name!r}: {hi - lo} bytes do not hold {dtype} {list(shape)}")
        if 8 + n + hi > size:
            raise WasteError(f"{path}: truncated: tensor {name!r} ends at byte {8 + n + hi}, the file has {size}")
        out.append(SourceTensor(name, path, dtype, shape, 8 + n + lo, hi - lo))
    # Two tensors over the same bytes would both be converted from them, one silently wrong.
    spans = sorted((t.start, t.start + t.nbytes, t.name) for t in out if t.nbytes and not k3_layout.is_vision(t.name))
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise WasteError(f"{path}: tensors {a!r} and {b!r} share bytes (their data_offsets overlap)")
    return out


def checkpoint_files(hf_dir: Path) -> list[Path]:
    """The shards of a checkpoint: from the index json, else model.safetensors, else *.safetensors."""
    index = hf_dir / INDEX
    if os.path.lexists(index):
        try:
            doc = json.loads(read_bounded(index, _MAX_HEADER, "safetensors index"))
        except (ValueError, RecursionError) as e:
            raise WasteError(f"{index}: not a safetensors index (not valid JSON: {e})") from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            raise WasteError(f"{index}: not a safetensors index (expected a \"weight_map\" object of tensor "
                             "name -> shard file)")
        try:
            files = sorted(set(weight_map.values()))
        except TypeError:  # unhashable or mixed values: each is checked to be a file name below
            raise WasteError(f"{index}: not a safetensors index (its weight_map's values must be shard file "
                             "names)") from None
        for f in files:
            # A shard is a file beside its index: a path elsewhere is no part of this checkpoint
            if not isinstance(f, str) or f in ("", ".", "..") or Path(f).name != f or "\\" in f:
                raise WasteError(f"{index}: names shard {f!r}, which is not a file name beside the index")
            if not (hf_dir / f).is_file():
                raise WasteError(f"{index}: names shard {f!r}, which is missing")
        return [hf_dir / f for f in files]
    single = hf_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise WasteError(f"{hf_dir}: no safetensors files")
    return files


def _names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def expected_checkpoint_tensors(cfg: ModelConfig) -> dict[str, Shape]:
    """Every tensor the checkpoint must hold, canonical name -> shape (MXFP4 experts as their two
    uint8 tensors)."""
    expected = dict(expected_tensors(cfg))
    parts = expected_expert_tensors(cfg)
    for layer in cfg.moe_layers:
        for e in range(cfg.num_experts):
            for part in EXPERT_PARTS:
                name = expert_name(layer, e, part)
                if cfg.expert_quant == "mxfp4":
                    shapes = k3_layout.mxfp4_shapes(parts[part])
                    for buf, bname in k3_layout.mxfp4_expert_names(name).items():
                        expected[bname] = shapes[buf]
                else:
                    expected[name] = parts[part]
    return expected


def inventory(hf_dir: Path, cfg: ModelConfig) -> tuple[dict[str, SourceTensor], int]:
    """(canonical name -> source tensor, number of vision tensors skipped), checked against the
    config's expected tensors, shapes and dtypes (uint8 for MXFP4 buffers only)."""
    found: dict[str, SourceTensor] = {}
    skipped = 0
    k3 = cfg.model_type == "kimi_k3"
    for path in checkpoint_files(hf_dir):
        for t in read_header(path):
            name = k3_layout.canonical(t.name) if k3 else t.name
            if name is None:
                skipped += 1
                continue
            name = canonical_name(name, cfg)
            if name in found:
                raise WasteError(f"{hf_dir}: tensor {name!r} appears twice ({found[name].path.name}, {path.name})")
            found[name] = t
    expected = expected_checkpoint_tensors(cfg)
    # Named as the file spells them: a found tensor by its own name, a missing one as the file's
    # other names suggest (K3: prefix, AttnRes spelling).
    spell = k3_layout.spelled_like([t.name for t in found.values()]) if k3 else str
    missing = [spell(n) for n in expected if n not in found]
    unexpected = [t.name for n, t in found.items() if n not in expected]
    misshapen = [f"{t.name} {list(t.shape)} (expected {list(expected[n])})" for n, t in found.items()
                 if n in expected and not shape_accepted(n, t.shape, expected[n], cfg)]
    mistyped = [f"{t.name} {t.dtype}" for n, t in found.items()
                if n in expected and (t.dtype == "U8") != (k3_layout.mxfp4_expert(n) is not None)]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s): {_names(unexpected)}")
    if misshapen:
        problems.append(f"misshapen {len(misshapen)} tensor(s): {_names(misshapen)}")
    if mistyped:
        problems.append(f"wrong dtype in {len(mistyped)} tensor(s) (U8 is for MXFP4 experts only): "
                        f"{_names(mistyped)}")
    if problems:
        raise WasteError(f"checkpoint {hf_dir} does not match its config.json: " + "; ".join(problems))
    return found, skipped


def read_tensor(f: object, t: SourceTensor) -> np.ndarray:
    """The tensor's values as float32 in its checkpoint shape (bfloat16 and float16 widen exactly);
    uint8 tensors (MXFP4 buffers) as their bytes."""
    buf = np.empty(t.nbytes, np.uint8)
    f.seek(t.start)  # type: ignore[attr-defined]
    if f.readinto(buf) != t.nbytes:  # type: ignore[attr-defined]
        raise WasteError(f"{t.path}: truncated while reading tensor {t.name!r}")
    if t.dtype == "U8":
        if t.name.endswith(".weight_scale") and np.any(buf == _E8M0_NAN):
            raise WasteError(f"{t.path}: tensor {t.name!r} holds the E8M0 NaN scale byte 255")
        return buf.reshape(t.shape)
    values = buf.view(_ST_DTYPES[t.dtype]).reshape(t.shape).astype(np.float32, copy=False)
    if not np.isfinite(values).all():
        raise WasteError(f"{t.path}: tensor {t.name!r} holds NaN or infinite values")
    return values


def _read_from(f: object, path: Path, t: SourceTensor) -> np.ndarray:
    """`read_tensor` of `t` through `f` (the open file `path`) when it lives there, else through its own file."""
    if t.path == path:
        return read_tensor(f, t)
    with open(t.path, "rb") as other:
        return read_tensor(other, t)


def _check_a_log(name: str, values: np.ndarray, cfg: ModelConfig, path: Path) -> None:
    if values.ndim == 1 and np.any(values[cfg.kda_num_heads:]):
        raise WasteError(f"{path}: tensor {name!r} [{values.size}] is not zero past the {cfg.kda_num_heads} heads")


def convert(hf_dir: str | Path, out: str | Path, *, quant: str = "q8", experts: str | None = None,
            force: bool = False, progress: bool = True) -> Path:
    """Convert a checkpoint directory into a container at `out`; the container's path.

    `experts` (f32, q8, q4, mxfp4) overrides how routed experts are stored; by default MXFP4
    experts stay MXFP4 byte for byte and others follow `quant`."""
    from tqdm import tqdm

    from waste.kernels.quant import from_buffers  # not at import: see waste/container/reader.py

    hf_dir, out = Path(hf_dir), Path(out)
    if quant not in SCHEMES:
        raise WasteError(f"unknown quantisation scheme {quant!r}; expected one of {', '.join(SCHEMES)}")
    recover_stale(out)
    src, dst = hf_dir.resolve(), out.resolve()
    if dst == src or dst in src.parents:
        raise WasteError(f"{out}: is or contains the checkpoint {hf_dir} being converted; choose another output")
    # Before reading the checkpoint, so that a refused output fails at once; ContainerWriter
    # checks again when it opens (it also serves synth, which has no such early point).
    check_output_dir(out, "waste container", force, is_container_dir)
    cfg = load_config_file(hf_dir / "config.json")
    expert_storage(cfg, quant, experts)  # a bad --experts fails before any reading
    found, skipped = inventory(hf_dir, cfg)
    trunk = {n: found[n].shape for n in expected_tensors(cfg)}
    parts = expected_expert_tensors(cfg)
    by_file: dict[Path, list[tuple[str, SourceTensor]]] = {}
    for name, t in found.items():
        by_file.setdefault(t.path, []).append((name, t))
    source = {"dtypes": sorted({t.dtype for t in found.values()}), "shards": len(by_file),
              "experts": cfg.expert_quant or "float", "ignored_tensors": skipped}
    tokenizer = tokenizer_file_bytes(hf_dir)
    if tokenizer:
        source["tokenizer"] = file_record(tokenizer)
    total = sum(t.nbytes for t in found.values())
    # An MXFP4 expert matrix is two tensors, which need not be neighbours (or in one shard): the
    # first one met reads both, so that nothing waits in memory for its other half.
    done: set[str] = set()
    with ContainerWriter(out, cfg, quant, trunk, experts=experts, force=force,
                         extra={"source": source}) as w, \
            tqdm(total=total, unit="B", unit_scale=True, desc=f"convert {quant}", file=sys.stderr,
                 disable=None if progress else True, leave=False) as bar:  # None: a terminal only
        for path, items in by_file.items():
            with open(path, "rb") as f:
                for name, t in sorted(items, key=lambda it: it[1].start):
                    if name in done:
                        continue
                    expert = parse_expert_name(name)
                    mx = k3_layout.mxfp4_expert(name)
                    if mx is not None:
                        layer, e, part, _ = mx
                        bufs = {}
                        for buf, bname in k3_layout.mxfp4_expert_names(expert_name(layer, e, part)).items():
                            bufs[buf] = _read_from(f, path, found[bname])
                            done.add(bname)
                            bar.update(found[bname].nbytes)
                        w.write_expert(layer, e, part, from_buffers("mxfp4", parts[part], bufs))
                        del bufs
                        continue
                    values = read_tensor(f, t)
                    if expert is not None:
                        w.write_expert(expert[0], expert[1], expert[2], values)
                    else:
                        if name.endswith(".self_attn.A_log"):
                            _check_a_log(name, values, cfg, path)
                        w.write_tensor(name, values)
                    del values
                    bar.update(t.nbytes)
        w.add_files(TOKENIZER_DIR, tokenizer)
        return w.finish()


def cmd_convert(args: argparse.Namespace) -> int:
    """`waste convert HF_DIR OUT.waste --quant f32|bf16|q8|q4|q4all [--experts f32|bf16|q8|q4|mxfp4] [--force]
    [--quiet]`."""
    from waste.container.reader import open_container

    out = convert(args.hf_dir, args.out, quant=args.quant, experts=args.experts, force=args.force,
                  progress=not args.quiet)
    with open_container(out) as c:
        counts = c.byte_counts()
    print(f"{out}: scheme {args.quant}, trunk {human_bytes(counts['trunk_bytes'])}, experts "
          f"{counts['expert_storage']} {human_bytes(counts['expert_bytes'])} ({counts['expert_layers']} x "
          f"{counts['num_experts']} blobs of {human_bytes(counts['expert_blob_bytes'])})")
    return 0
