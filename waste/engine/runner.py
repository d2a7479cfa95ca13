"""Generation loop shared by `waste run`, the demo, notebooks and benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from waste.engine.model import DEFAULT_PREFILL_CHUNK, Model, Observer
from waste.engine.sampling import Sampler
from waste.engine.session import Session
from waste.jit import compile_time


@dataclass
class RunResult:
    """What one run produced and how long its phases took."""

    prompt_len: int
    generated: list[int]
    # prompt rows [T, vocab] (or only the last, [1, vocab]), then one [vocab] per generated token
    logits: list[np.ndarray] = field(repr=False)
    prefill_seconds: float
    decode_seconds: float
    # of those, seconds spent compiling kernels (`waste.jit.compile_time`): 0 once they are cached
    prefill_compile_seconds: float = 0.0
    decode_compile_seconds: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_len / self.prefill_seconds if self.prefill_seconds > 0 and self.prompt_len else float("nan")

    @property
    def decode_tps(self) -> float:
        n = len(self.generated)
        return n / self.decode_seconds if self.decode_seconds > 0 and n else float("nan")

    def all_logits(self) -> np.ndarray:
        """float32 [prompt rows + len(generated), vocab]: the prompt's logits rows (every position,
        or the last only), then each generated token's."""
        rows = [np.atleast_2d(x) for x in self.logits]
        return np.concatenate(rows, axis=0) if rows else np.zeros((0, 0), np.float32)


def generate(
    model: Model,
    session: Session,
    prompt: Sequence[int],
    max_new: int,
    sampler: Sampler,
    *,
    chunk: int = DEFAULT_PREFILL_CHUNK,
    observer: Observer | None = None,
    all_prompt_logits: bool = True,
    on_token: Callable[[int], bool] | None = None,
) -> RunResult:
    """Prefill `prompt` (may be empty when resuming) then sample `max_new` tokens.

    The token after the prompt is drawn from the last prompt position's logits; each
    generated token is then fed back with a decode step. The session keeps the logits of
    its last position, so a resumed run continues exactly where the saved one stopped.
    Generated tokens are decoded (fed back) before returning, so the session always ends
    with every token it returned consumed. Without `all_prompt_logits` only the last prompt
    position's logits are computed and kept.
    """
    logits: list[np.ndarray] = []
    t0 = time.perf_counter()
    with compile_time() as prefill_compiling:
        if len(prompt):
            logits.append(model.prefill(session, prompt, chunk=chunk, observer=observer,
                                        all_logits=all_prompt_logits))
    t1 = time.perf_counter()
    generated: list[int] = []
    with compile_time() as decode_compiling:
        for _ in range(max_new):
            token = sampler(session.last_logits)
            generated.append(token)
            logits.append(model.decode(session, token, observer=observer))
            if on_token is not None and on_token(token):
                break
    t2 = time.perf_counter()
    session.sampler_state = sampler.get_state()
    return RunResult(len(prompt), generated, logits, t1 - t0, t2 - t1, prefill_compiling[0], decode_compiling[0])
