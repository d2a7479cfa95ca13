"""Next-token choice: greedy, temperature and top-p (nucleus), seeded and resumable."""

from __future__ import annotations

from typing import Any

import numpy as np

from waste.errors import WasteError


class Sampler:
    """Chooses tokens from logits; its random state can be saved and restored exactly."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
        if not temperature >= 0 or temperature == float("inf"):
            raise WasteError(f"--temperature {temperature}: must be 0 (greedy) or a finite positive number")
        if not 0.0 < top_p <= 1.0:
            raise WasteError(f"--top-p {top_p}: must lie in (0, 1]")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray) -> int:
        """One token id from logits [vocab]."""
        if self.temperature == 0.0:
            return int(np.argmax(logits))
        # Shifted before the division: a tiny temperature sends every logit below the largest to
        # -inf (weight 0) instead of all of them to inf (inf - inf = NaN).
        shifted = logits.astype(np.float64)
        shifted -= shifted.max()
        with np.errstate(over="ignore"):
            p = np.exp(shifted / self.temperature)
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            keep = order[: int(np.searchsorted(np.cumsum(p[order]), self.top_p)) + 1]
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        return int(self.rng.choice(p.size, p=p))

    def get_state(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "rng": self.rng.bit_generator.state}

    def with_options(self, temperature: float | None, top_p: float | None, seed: int | None) -> Sampler:
        """This sampler with the options that were given (not None) replacing its own; a seed restarts
        the random stream, otherwise a resumed stream continues where it was saved."""
        out = Sampler(self.temperature if temperature is None else temperature,
                      self.top_p if top_p is None else top_p, 0 if seed is None else seed)
        if seed is None:
            out.rng.bit_generator.state = self.rng.bit_generator.state
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Sampler:
        s = cls(state["temperature"], state["top_p"])
        s.rng.bit_generator.state = state["rng"]
        return s
