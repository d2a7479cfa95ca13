"""manifest.json: its checked reading (`parse_manifest`, which raises nothing but
`ContainerError` whatever bytes it is given), its writing (`manifest_json`) and the SHA-256
it carries over its own content (`manifest_checksum`). The layout rules it checks against
are in `waste.container.format`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from waste.config import ModelConfig, parse_config
from waste.container.format import (
    BLOB_ALIGN,
    EXPERT_PARTS,
    EXPERT_STORAGES,
    EXPERTS,
    FORMAT_VERSION,
    GROUP_SIZE,
    MAGIC,
    MANIFEST,
    SCHEME_EXPERT_STORAGE,
    SCHEMES,
    TRUNK,
    TRUNK_ALIGN,
    BufferSpec,
    ContainerError,
    ExpertsLayout,
    Shape,
    TensorEntry,
    expected_tensors,
    plan_experts,
    shape_accepted,
    span_layout,
    storage_of,
)
from waste.errors import WasteError

_MAX_INT = 1 << 62
_MAX_LAYERS = 100_000
CHECKSUM_KEY = "checksum"  # manifest key: "sha256:<hex>" over the rest of the manifest


def manifest_checksum(doc: dict[str, Any]) -> str:
    """"sha256:<hex>" of the manifest without its `checksum` key, as canonical JSON (sorted keys,
    no spaces), so re-indenting the file keeps it valid and any change of a value does not."""
    body = {k: v for k, v in doc.items() if k != CHECKSUM_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Manifest:
    """A checked manifest.json."""

    raw: dict[str, Any]
    config: ModelConfig
    scheme: str
    file_bytes: dict[str, int]  # trunk.bin / experts.bin sizes the manifest promises
    tensors: dict[str, TensorEntry]
    experts: ExpertsLayout


class _Obj:
    """Typed reads from one JSON object; every failure is a ContainerError naming the key path."""

    def __init__(self, d: Any, where: str):
        if not isinstance(d, dict):
            raise ContainerError(f"{where}: expected a JSON object, got {type(d).__name__}")
        self.d, self.where = d, where

    def get(self, key: str) -> Any:
        if key not in self.d:
            raise ContainerError(f"{self.where}: key {key!r} is missing")
        return self.d[key]

    def int(self, key: str) -> int:
        v = self.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < _MAX_INT:
            raise ContainerError(f"{self.where}.{key}: expected a non-negative integer, got {_short(v)}")
        return v

    def str(self, key: str) -> str:
        v = self.get(key)
        if not isinstance(v, str):
            raise ContainerError(f"{self.where}.{key}: expected a string, got {_short(v)}")
        return v

    def list(self, key: str) -> list[Any]:
        v = self.get(key)
        if not isinstance(v, list):
            raise ContainerError(f"{self.where}.{key}: expected a list, got {_short(v)}")
        return v

    def shape(self, key: str) -> Shape:
        v = self.list(key)
        if not all(isinstance(s, int) and not isinstance(s, bool) and 0 < s < _MAX_INT for s in v) or len(v) > 8:
            raise ContainerError(f"{self.where}.{key}: expected a list of positive integers, got {_short(v)}")
        return tuple(v)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _entry(d: Any, where: str) -> TensorEntry:
    o = _Obj(d, where)
    tname = o.str("name")
    buffers = []
    for i, b in enumerate(o.list("buffers")):
        bo = _Obj(b, f"{where}.buffers[{i}]")
        buffers.append(BufferSpec(bo.str("name"), bo.str("dtype"), bo.shape("shape"), bo.int("offset"),
                                  bo.int("bytes")))
    crc = o.int("crc32c") if "crc32c" in o.d else None
    return TensorEntry(tname, o.str("file"), o.int("offset"), o.int("bytes"), o.shape("shape"), o.str("kind"),
                       o.str("storage"), tuple(buffers), crc, o.get("group_size"))


def _check_entry(e: TensorEntry, kind: str, storage: str, where: str) -> None:
    """The entry is stored as (kind, storage) with this reader's buffer layout."""
    if (e.kind, e.storage, e.group_size) != (kind, storage, GROUP_SIZE[storage]):
        raise ContainerError(f"{where}: tensor {e.name!r} is stored as {e.kind} {e.storage} (group "
                             f"{_short(e.group_size)}), expected {kind} {storage}")
    try:
        buffers, span = span_layout(kind, storage, e.shape)
    except WasteError as err:
        raise ContainerError(f"{where}: tensor {e.name!r}: {err}") from None
    if e.buffers != buffers or e.nbytes != span:
        raise ContainerError(f"{where}: tensor {e.name!r}: buffer layout differs from this reader's {storage} layout")


def parse_manifest(data: bytes, where: str = MANIFEST) -> Manifest:
    """Check and parse manifest.json bytes; any problem raises ContainerError naming it."""
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ContainerError(f"{where}: not valid JSON ({_short(str(e))})") from None
    top = _Obj(raw, where)
    if top.d.get("magic") != MAGIC:
        raise ContainerError(f"{where}: not a WASTE container (magic {_short(top.d.get('magic'))}, "
                             f"expected {MAGIC!r})")
    version = top.get("format_version")
    if version == 1 and not isinstance(version, bool):
        raise ContainerError(f"{where}: format version 1 has no manifest checksum and uses zlib CRCs; this "
                             f"reader needs version {FORMAT_VERSION}: convert the checkpoint again")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise ContainerError(f"{where}: unknown format version {_short(version)} (this reader knows "
                             f"{FORMAT_VERSION}); convert the checkpoint again with this version of waste")
    scheme = top.str("scheme")
    if scheme not in SCHEMES:
        raise ContainerError(f"{where}: unknown quantisation scheme {_short(scheme)}")
    cfg = _parse_config(top.get("config"), where)
    files = _Obj(top.get("files"), f"{where}.files")
    file_bytes = {f: _Obj(files.get(f), f"{where}.files.{f}").int("bytes") for f in (TRUNK, EXPERTS)}
    tensors = _parse_tensors(top.list("tensors"), cfg, scheme, file_bytes[TRUNK], where)
    experts = _parse_experts(_Obj(top.get("experts"), f"{where}.experts"), cfg, scheme, where)
    if experts.file_bytes != file_bytes[EXPERTS]:
        raise ContainerError(f"{where}: files.{EXPERTS}.bytes is {file_bytes[EXPERTS]}, the expert layout needs "
                             f"{experts.file_bytes}")
    _check_checksum(top, where)
    return Manifest(raw, cfg, scheme, file_bytes, tensors, experts)


def _check_checksum(top: _Obj, where: str) -> None:
    # Checked after the structure so that a damaged manifest is still described by what is wrong
    # in it; what passes every structural check but was edited (a config value) stops here.
    stored = top.str(CHECKSUM_KEY)
    try:
        actual = manifest_checksum(top.d)
    except (ValueError, RecursionError) as e:
        raise ContainerError(f"{where}: cannot checksum the manifest ({_short(str(e))})") from None
    if stored != actual:
        raise ContainerError(f"{where}: checksum mismatch (the manifest says {_short(stored)}, its content hashes "
                             f"to {actual[:19]}...): it was edited or damaged; convert the checkpoint again")


def _parse_config(raw: Any, where: str) -> ModelConfig:
    # parse_config allocates a list per layer before checking the layer lists: bound it first.
    for d in (raw, raw.get("text_config") if isinstance(raw, dict) else None):
        n = d.get("num_hidden_layers") if isinstance(d, dict) else None
        if isinstance(n, int) and n > _MAX_LAYERS:
            raise ContainerError(f"{where}: config: num_hidden_layers {_short(n)} is not a plausible layer count")
    try:
        cfg = parse_config(raw)
    except WasteError as e:
        raise ContainerError(f"{where}: config: {e}") from None
    except OverflowError as e:  # a number too large for a float, e.g. rms_norm_eps 1e400 written as an integer
        raise ContainerError(f"{where}: config: {e}") from None
    return cfg


def _parse_tensors(rows: list[Any], cfg: ModelConfig, scheme: str, trunk_bytes: int,
                   where: str) -> dict[str, TensorEntry]:
    expected = dict(expected_tensors(cfg))
    tensors: dict[str, TensorEntry] = {}
    for i, row in enumerate(rows):
        e = _entry(row, f"{where}.tensors[{i}]")
        if e.name in tensors:
            raise ContainerError(f"{where}: tensor {e.name!r} is listed twice")
        if e.name not in expected:
            raise ContainerError(f"{where}: unexpected tensor {e.name!r} for this config")
        if e.file != TRUNK:
            raise ContainerError(f"{where}: tensor {e.name!r} names file {_short(e.file)}, expected {TRUNK!r}")
        if e.crc32c is None:
            raise ContainerError(f"{where}: tensor {e.name!r} has no crc32c")
        if not shape_accepted(e.name, e.shape, expected[e.name], cfg):
            raise ContainerError(f"{where}: tensor {e.name!r} has shape {list(e.shape)}, expected "
                                 f"{list(expected[e.name])}")
        _check_entry(e, *storage_of(e.name, e.shape, scheme), where)
        if e.offset % TRUNK_ALIGN:
            raise ContainerError(f"{where}: tensor {e.name!r} offset {e.offset} is not {TRUNK_ALIGN}-byte aligned")
        if e.offset + e.nbytes > trunk_bytes:
            raise ContainerError(f"{where}: tensor {e.name!r} ends at byte {e.offset + e.nbytes}, past the end of "
                                 f"{TRUNK} ({trunk_bytes} bytes)")
        tensors[e.name] = e
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise ContainerError(f"{where}: {len(missing)} tensor(s) missing, first {missing[0]!r}")
    spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in tensors.values())
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise ContainerError(f"{where}: tensors {a!r} and {b!r} overlap in {TRUNK}")
    return tensors


def _parse_experts(o: _Obj, cfg: ModelConfig, scheme: str, where: str) -> ExpertsLayout:
    # Containers written before MXFP4 experts existed name no storage: theirs follows the scheme.
    storage = o.str("storage") if "storage" in o.d else SCHEME_EXPERT_STORAGE[scheme]
    if storage not in EXPERT_STORAGES:
        raise ContainerError(f"{o.where}.storage: unknown expert storage {_short(storage)}")
    try:
        plan = plan_experts(cfg, storage)
    except WasteError as err:  # e.g. mxfp4 experts whose width is not a multiple of 32
        raise ContainerError(f"{o.where}.storage: {err}") from None
    if o.str("file") != EXPERTS:
        raise ContainerError(f"{o.where}.file: expected {EXPERTS!r}")
    if o.list("layers") != list(plan.layers) or o.int("num_experts") != plan.num_experts:
        raise ContainerError(f"{o.where}: layers / num_experts do not match the config")
    if o.int("blob_bytes") != plan.blob_bytes:
        raise ContainerError(f"{o.where}.blob_bytes: {o.d['blob_bytes']}, the {storage} layout needs {plan.blob_bytes}")
    rows = o.list("parts")
    if len(rows) != len(plan.parts):
        raise ContainerError(f"{o.where}.parts: expected {len(plan.parts)} parts {EXPERT_PARTS}")
    for i, (row, want) in enumerate(zip(rows, plan.parts, strict=True)):
        e = _entry(row, f"{o.where}.parts[{i}]")
        if e.name != want.name or e.file != EXPERTS or e.offset != want.offset:
            raise ContainerError(f"{o.where}.parts[{i}]: expected part {want.name!r} in {EXPERTS} at blob offset "
                                 f"{want.offset}")
        if e.shape != want.shape:
            raise ContainerError(f"{o.where}.parts[{i}]: tensor {e.name!r} has shape {list(e.shape)}, expected "
                                 f"{list(want.shape)}")
        _check_entry(e, "matrix", storage, f"{o.where}.parts[{i}]")
    shape = (len(plan.layers), plan.num_experts, len(EXPERT_PARTS))
    crc = o.list("crc32c")

    def ok(v: Any, depth: int) -> bool:
        if depth == len(shape):
            return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 0xFFFFFFFF
        return isinstance(v, list) and len(v) == shape[depth] and all(ok(x, depth + 1) for x in v)

    if not ok(crc, 0):
        raise ContainerError(f"{o.where}.crc32c: expected {list(shape)} unsigned 32-bit CRCs")
    table = np.array(crc, dtype=np.uint32).reshape(shape)
    return ExpertsLayout(plan.layers, plan.num_experts, plan.blob_bytes, plan.parts, storage, table)


def manifest_json(cfg: ModelConfig, scheme: str, tensors: list[TensorEntry], experts: ExpertsLayout,
                  trunk_bytes: int, extra: dict[str, Any] | None = None) -> bytes:
    """The manifest.json bytes for a finished container."""
    doc = {"magic": MAGIC, "format_version": FORMAT_VERSION, "scheme": scheme, "config": cfg.to_hf_dict(),
           "files": {TRUNK: {"bytes": trunk_bytes}, EXPERTS: {"bytes": experts.file_bytes}},
           "alignment": {"trunk": TRUNK_ALIGN, "experts_blob": BLOB_ALIGN},
           **(extra or {}),
           "tensors": [e.to_json() for e in tensors], "experts": experts.to_json()}
    doc[CHECKSUM_KEY] = manifest_checksum(doc)
    return (json.dumps(doc, indent=1) + "\n").encode()
