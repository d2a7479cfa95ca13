"""A session: everything decoding needs, in one place, saved and restored bit for bit.

Per KDA layer the recurrent state [H, K, V] and the three conv rings [3, kernel-1, H*K];
per MLA layer the latent cache [length, kv_lora + rope]; the position, every token seen,
the logits of the last position (the next token is drawn from them) and the sampler state.

File format (`SESSION_VERSION`): a NumPy .npz archive holding the arrays and a `meta`
entry (UTF-8 JSON: magic, version, container manifest hash, position, sampler state and
a SHA-256 of every array). Written to a temporary name and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from waste.errors import WasteError
from waste.fileio import NotRegularFile, open_regular, write_atomic

SESSION_MAGIC = "WASTE-SESSION"
SESSION_VERSION = 1


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


@dataclass
class Session:
    """Decoding state of one conversation with one model."""

    kda: dict[int, Any]  # layer -> KDAState
    mla: dict[int, Any]  # layer -> MLACache
    container_hash: str
    router_weights: str = "unbiased"  # the model's --router-weights: a resumed run must route as this one did
    tokens: list[int] = field(default_factory=list)
    last_logits: np.ndarray | None = None  # [vocab] float32
    sampler_state: dict[str, Any] | None = None

    @property
    def position(self) -> int:
        """Tokens consumed so far (the next token's position)."""
        return len(self.tokens)

    @property
    def state_bytes(self) -> dict[str, int]:
        """Bytes of the attention-side state, by kind, as the planner itemises them (`state_bytes`,
        and `kda_pending_bytes` for the decode's deferred updates)."""
        return {
            "kda_state": sum(s.base.nbytes for s in self.kda.values()),
            "kda_pending": sum(s.pending_k.nbytes + s.pending_d.nbytes for s in self.kda.values()),
            "conv_rings": sum(s.conv.nbytes for s in self.kda.values()),
            "mla_latent": sum(c.nbytes for c in self.mla.values()),
        }

    def ensure_capacity(self, tokens: int) -> None:
        """Grow every MLA cache so it can hold `tokens` positions (amortised doubling)."""
        for cache in self.mla.values():
            capacity = cache.latent.shape[0]
            if tokens > capacity:
                grown = np.empty((max(tokens, 2 * capacity), cache.latent.shape[1]), np.float32)
                grown[: cache.length] = cache.latent[: cache.length]
                cache.latent = grown

    def _arrays(self) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = {"tokens": np.asarray(self.tokens, np.int64)}
        if self.last_logits is not None:
            arrays["last_logits"] = np.asarray(self.last_logits, np.float32)
        for layer, s in self.kda.items():
            arrays[f"kda{layer}.recurrent"] = s.recurrent
            arrays[f"kda{layer}.conv"] = s.conv
        for layer, c in self.mla.items():
            arrays[f"mla{layer}.latent"] = c.latent[: c.length]
        return arrays

    def save(self, path: str | Path) -> None:
        """Write the session atomically (temporary name, then rename)."""
        path = Path(path)
        arrays = self._arrays()
        meta = {
            "magic": SESSION_MAGIC,
            "version": SESSION_VERSION,
            "container_hash": self.container_hash,
            "router_weights": self.router_weights,
            "position": self.position,
            "sampler_state": self.sampler_state,
            "sha256": {name: _digest(a) for name, a in arrays.items()},
        }
        write_atomic(path, lambda f: np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
                                              **arrays))


def _open_regular(path: Path) -> Any:
    """The file opened for reading, refusing FIFOs and devices (np.load would block or read forever)."""
    try:
        return os.fdopen(open_regular(path), "rb")
    except FileNotFoundError:
        raise WasteError(f"session file {path}: no such file") from None
    except NotRegularFile:
        raise WasteError(f"session file {path}: not a regular file") from None
    except OSError as e:
        raise WasteError(f"session file {path}: {e.strerror}") from None


def is_session_file(path: str | Path) -> bool:
    """Whether `path` is a waste session (by its metadata only; an earlier --session-out may be replaced)."""
    try:
        with _open_regular(Path(path)) as f, np.load(f, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes().decode())
        return isinstance(meta, dict) and meta.get("magic") == SESSION_MAGIC
    except Exception:  # noqa: BLE001 - any failure to read it means "not a session"
        return False


def read_session_file(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read and check a session file: (meta, arrays). Damage is a WasteError naming the file."""
    path = Path(path)
    try:
        with _open_regular(path) as f:
            loaded = np.load(f, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise WasteError(f"session file {path}: not a waste session (a single .npy array)")
            with loaded as z:
                arrays = {name: z[name] for name in z.files}
    except OSError as e:
        raise WasteError(f"session file {path}: cannot read ({e.strerror or e})") from None
    # What zipfile raises for archives a session never is: damaged (BadZipFile, zlib.error, EOFError),
    # encrypted (RuntimeError) or compressed by a method it lacks (NotImplementedError).
    except (zipfile.BadZipFile, zlib.error, ValueError, EOFError, KeyError, RuntimeError, NotImplementedError) as e:
        raise WasteError(f"session file {path}: damaged or not a session ({type(e).__name__})") from None
    # np.load hands out a member that is not an .npy array as its raw bytes
    if not all(isinstance(a, np.ndarray) for a in arrays.values()):
        raise WasteError(f"session file {path}: damaged or not a session (a member is not an array)")
    try:
        meta = json.loads(arrays.pop("meta").tobytes().decode())
    except (KeyError, ValueError, RecursionError):
        raise WasteError(f"session file {path}: missing or unreadable metadata") from None
    if not isinstance(meta, dict) or meta.get("magic") != SESSION_MAGIC:
        raise WasteError(f"session file {path}: not a waste session")
    if meta.get("version") != SESSION_VERSION:
        raise WasteError(f"session file {path}: version {meta.get('version')!r} is not supported "
                         f"(this waste reads version {SESSION_VERSION})")
    digests = meta.get("sha256")
    if not isinstance(digests, dict) or set(digests) != set(arrays):
        raise WasteError(f"session file {path}: array set does not match its checksum table")
    for name, a in arrays.items():
        if _digest(a) != digests[name]:
            raise WasteError(f"session file {path}: checksum mismatch in {name!r}")
    return meta, arrays


def _fail(path: str | Path, what: str) -> WasteError:
    return WasteError(f"session file {path}: {what}")


def _uint(value: Any, bits: int) -> bool:
    """Whether `value` is an int (bool included) that fits in `bits` unsigned bits, as NumPy's PCG64 takes it."""
    return isinstance(value, int) and 0 <= value < 1 << bits


def _check_sampler_state(state: Any, path: str | Path) -> None:
    """A saved sampler state: finite temperature >= 0, top_p in (0, 1], a PCG64 state of integers
    in the ranges NumPy takes (128-bit state and increment, a 0/1 flag, a 32-bit buffered value)."""
    if state is None:
        return
    ok = isinstance(state, dict) and set(state) == {"temperature", "top_p", "rng"}
    if ok:
        t, p, rng = state["temperature"], state["top_p"], state["rng"]
        ok = (all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (t, p))
              and t >= 0 and 0 < p <= 1 and isinstance(rng, dict) and rng.get("bit_generator") == "PCG64"
              and isinstance(rng.get("state"), dict)
              and all(_uint(rng["state"].get(k), 128) for k in ("state", "inc"))
              and _uint(rng.get("has_uint32"), 1) and _uint(rng.get("uinteger"), 32))
    if not ok:
        raise _fail(path, "sampler_state is malformed")


def restore_session(session: Session, meta: dict[str, Any], arrays: dict[str, np.ndarray], vocab_size: int,
                    path: str | Path) -> Session:
    """Fill a fresh `session` (of the right model) from a file's checked meta and arrays.

    Every array must have exactly the dtype and shape the model's own state has (nothing is
    broadcast into place), hold finite values, and agree with the others: as many tokens as
    the position, each inside the vocabulary, and an MLA cache row per token.
    """
    expected = {"tokens", *(f"kda{i}.{part}" for i in session.kda for part in ("recurrent", "conv")),
                *(f"mla{i}.latent" for i in session.mla)}
    names = set(arrays)
    if names - {"last_logits"} != expected:
        extra, missing = sorted(names - expected - {"last_logits"}), sorted(expected - names)
        raise _fail(path, f"does not match this model's layers (unexpected {extra[:3]}, missing {missing[:3]})")
    tokens = arrays["tokens"]
    position = meta.get("position")
    if tokens.dtype != np.int64 or tokens.ndim != 1 or isinstance(position, bool) or position != tokens.size:
        raise _fail(path, "tokens must be int64 [position]")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise _fail(path, f"a token id lies outside the vocabulary 0..{vocab_size - 1}")
    if ("last_logits" in arrays) != (tokens.size > 0):
        raise _fail(path, "last_logits must be present exactly when tokens are")
    shapes = {"last_logits": (vocab_size,)}
    for i, state in session.kda.items():
        shapes[f"kda{i}.recurrent"] = state.base.shape
        shapes[f"kda{i}.conv"] = state.conv.shape
    for i, cache in session.mla.items():
        shapes[f"mla{i}.latent"] = (tokens.size, cache.latent.shape[1])
    for name, shape in shapes.items():
        a = arrays.get(name)
        if a is None:
            continue
        if a.dtype != np.float32 or a.shape != tuple(shape):
            raise _fail(path, f"{name!r} is {a.dtype} {list(a.shape)}, this model needs float32 {list(shape)}")
        if not np.isfinite(a).all():
            raise _fail(path, f"{name!r} holds NaN or infinite values")
    _check_sampler_state(meta.get("sampler_state"), path)
    session.ensure_capacity(max(tokens.size, 1))
    for i, state in session.kda.items():
        state.recurrent[...] = arrays[f"kda{i}.recurrent"]
        state.conv[...] = arrays[f"kda{i}.conv"]
    for i, cache in session.mla.items():
        latent = arrays[f"mla{i}.latent"]
        cache.latent[: len(latent)] = latent
        cache.length = len(latent)
    session.tokens = [int(t) for t in tokens]
    session.last_logits = arrays.get("last_logits")
    session.sampler_state = meta.get("sampler_state")
    return session
