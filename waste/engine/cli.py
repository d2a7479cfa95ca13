"""`waste run` and `waste check`."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from waste.errors import CheckFailed, WasteError
from waste.units import human_bytes, parse_size


def parse_ids(text: str, where: str) -> list[int]:
    """Token ids separated by commas and/or whitespace."""
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    try:
        return [int(p) for p in parts]
    except ValueError:
        bad = next(p for p in parts if not p.lstrip("-").isdigit())
        raise WasteError(f"{where}: {bad!r} is not a token id (expected integers such as 1,2,3)") from None


def _text_args(args: Any) -> bool:
    return getattr(args, "prompt", None) is not None or getattr(args, "chat", None) is not None


def _prompt(args: Any) -> list[int]:
    if args.prompt_ids is not None:
        return parse_ids(args.prompt_ids, "--prompt-ids")
    if args.prompt_file is not None:
        try:
            return parse_ids(Path(args.prompt_file).read_text(), f"--prompt-file {args.prompt_file}")
        except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError):
            raise WasteError(f"--prompt-file {args.prompt_file}: cannot read it") from None
    return []


def save_npy_atomic(path: str | Path, array: np.ndarray) -> None:
    """np.save to a temporary name, then rename into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def cmd_run(args: Any) -> int:
    from waste.container.reader import open_container
    from waste.engine.experts import open_expert_store
    from waste.engine.model import Model
    from waste.engine.runner import generate
    from waste.engine.sampling import Sampler
    from waste.engine.text import chat_turn_ids, text_printer
    from waste.engine.trace import TraceRecorder
    from waste.tokenizer import require_tokenizer

    if args.max_new < 0:
        raise WasteError(f"--max-new {args.max_new}: must not be negative")
    if args.read_threads < 1:
        raise WasteError(f"--read-threads {args.read_threads}: must be at least 1")
    container = open_container(args.container)
    tokenizer = require_tokenizer(args.container) if _text_args(args) else None
    prompt = tokenizer.encode(args.prompt) if getattr(args, "prompt", None) is not None else _prompt(args)
    budget = None if args.expert_cache is None else parse_size(args.expert_cache, "--expert-cache")
    store = open_expert_store(container, budget, args.cache_policy, args.read_threads, args.direct_io)
    model = Model(container, store=store, router_weights=args.router_weights)
    if args.session_in:
        session = model.load_session(args.session_in)
        sampler = Sampler.from_state(session.sampler_state) if session.sampler_state else Sampler(
            args.temperature, args.top_p, args.seed)
        if getattr(args, "chat", None) is not None:
            prompt = chat_turn_ids(tokenizer, args.chat, continuing=session.position > 0,
                                   last_token=session.tokens[-1] if session.position else None)
    else:
        if getattr(args, "chat", None) is not None:
            prompt = chat_turn_ids(tokenizer, args.chat, continuing=False, last_token=None)
        if not prompt:
            raise WasteError("the prompt is empty: give --prompt-ids or --prompt-file")
        session = model.new_session(capacity=len(prompt) + args.max_new)
        sampler = Sampler(args.temperature, args.top_p, args.seed)
    if not prompt and session.last_logits is None:
        raise WasteError(f"session {args.session_in} has no tokens to continue from; give --prompt-ids")
    cfg = container.config
    needed = session.position + len(prompt) + args.max_new
    if needed > cfg.max_position_embeddings:
        raise WasteError(f"context of {needed} tokens (session {session.position} + prompt {len(prompt)} + "
                         f"--max-new {args.max_new}) exceeds the model's capacity of {cfg.max_position_embeddings}")
    recorder = TraceRecorder(cfg.num_layers, cfg.moe_layers, cfg.num_experts_per_token) if args.trace_out else None
    on_token, finish = text_printer(tokenizer, sys.stdout) if tokenizer else (None, None)
    run = generate(model, session, prompt, args.max_new, sampler, chunk=args.prefill_chunk, observer=recorder,
                   all_prompt_logits=bool(args.logits_out), on_token=on_token)
    if finish is not None:
        finish()
    print("generated:", ",".join(str(t) for t in run.generated))
    print(f"prefill: {run.prompt_len} tokens in {run.prefill_seconds:.3f} s ({run.prefill_tps:.1f} tok/s); "
          f"decode: {len(run.generated)} tokens in {run.decode_seconds:.3f} s ({run.decode_tps:.1f} tok/s)")
    if model.times.dedup:
        print(f"prefill expert dedup ratio (token-expert pairs per unique expert fetched): "
              f"{np.mean(model.times.dedup):.2f}")
    print(store.stats.format_table())
    if args.logits_out:
        save_npy_atomic(args.logits_out, run.all_logits().astype(np.float32))
        print(f"logits: {args.logits_out}")
    if recorder is not None:
        recorder.save(args.trace_out)
        print(f"trace: {args.trace_out}")
    if args.session_out:
        session.save(args.session_out)
        sizes = session.state_bytes
        print(f"session: {args.session_out} at position {session.position} "
              f"(state {human_bytes(sum(sizes.values()))})")
    store.close()
    container.close()
    return 0


def cmd_check(args: Any) -> int:
    from waste.container.reader import open_container
    from waste.engine.check import check_against_oracle

    if args.prompt_len < 1 or args.new < 0:
        raise WasteError("--prompt-len must be at least 1 and --new not negative")
    container = open_container(args.container)
    cfg = container.config
    if args.prompt_len + args.new > cfg.max_position_embeddings:
        raise WasteError(f"--prompt-len + --new = {args.prompt_len + args.new} exceeds the model's capacity "
                         f"of {cfg.max_position_embeddings}")
    rng = np.random.default_rng(args.seed)
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, args.prompt_len)]
    report = check_against_oracle(container, prompt, args.new, chunk=args.prefill_chunk, tolerance=args.tolerance)
    print(report.format())
    sys.stdout.flush()
    if not report.passed:
        worst = max(report.layer_errors + [report.logits_error])
        raise CheckFailed(f"relative error {worst:.3e} above tolerance {report.tolerance:.1e} or greedy "
                          f"disagreement at {report.greedy_disagreements[:5]}")
    return 0
