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
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from waste.errors import WasteError

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
    tokens: list[int] = field(default_factory=list)
    last_logits: np.ndarray | None = None  # [vocab] float32
    sampler_state: dict[str, Any] | None = None

    @property
    def position(self) -> int:
        """Tokens consumed so far (the next token's position)."""
        return len(self.tokens)

    @property
    def state_bytes(self) -> dict[str, int]:
        """Bytes of the attention-side state, by kind, as the planner itemises them."""
        return {
            "kda_state": sum(s.base.nbytes for s in self.kda.values()),
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
            "position": self.position,
            "sampler_state": self.sampler_state,
            "sha256": {name: _digest(a) for name, a in arrays.items()},
        }
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def read_session_file(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read and check a session file: (meta, arrays). Damage is a WasteError naming the file."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
    except FileNotFoundError:
        raise WasteError(f"session file {path}: no such file") from None
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as e:
        raise WasteError(f"session file {path}: damaged or not a session ({type(e).__name__})") from None
    try:
        meta = json.loads(arrays.pop("meta").tobytes().decode())
    except (KeyError, UnicodeDecodeError, json.JSONDecodeError):
        raise WasteError(f"session file {path}: missing or unreadable metadata") from None
    if not isinstance(meta, dict) or meta.get("magic") != SESSION_MAGIC:
        raise WasteError(f"session file {path}: not a waste session")
    if meta.get("version") != SESSION_VERSION:
        raise WasteError(f"session file {path}: version {meta.get('version')!r} is not supported "
                         f"(this waste reads version {SESSION_VERSION})")
    digests = meta.get("sha256", {})
    if set(digests) != set(arrays):
        raise WasteError(f"session file {path}: array set does not match its checksum table")
    for name, a in arrays.items():
        if _digest(a) != digests[name]:
            raise WasteError(f"session file {path}: checksum mismatch in {name!r}")
    return meta, arrays
