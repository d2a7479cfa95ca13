"""`waste run` and `waste check`."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from waste.errors import CheckFailed, WasteError
from waste.fileio import NPY_MAGIC, check_output, file_starts_with, read_bounded, write_atomic
from waste.units import human_bytes, parse_size

# A prompt file is token ids as text: a few MB hold a million of them.
MAX_PROMPT_FILE = 64 << 20
_MAX_ID = (1 << 62) - 1


def parse_ids(text: str, where: str) -> list[int]:
    """Token ids separated by commas and/or whitespace."""
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    # ASCII digits only: int() also reads "1_0" as 10 and full-width digits, and isdigit() takes "²".
    bad = next((p for p in parts if not re.fullmatch(r"-?[0-9]+", p)), None)
    if bad is not None:
        raise WasteError(f"{where}: {bad!r} is not a token id (expected integers such as 1,2,3)")
    ids = [int(p) for p in parts]
    bad_ids = [i for i in ids if not 0 <= i <= _MAX_ID]
    if bad_ids:
        raise WasteError(f"{where}: token id {bad_ids[0]} is out of range")
    return ids


def _text_args(args: Any) -> bool:
    return getattr(args, "prompt", None) is not None or getattr(args, "chat", None) is not None


def _prompt(args: Any) -> list[int]:
    if args.prompt_ids is not None:
        return parse_ids(args.prompt_ids, "--prompt-ids")
    if args.prompt_file is not None:
        data = read_bounded(args.prompt_file, MAX_PROMPT_FILE, "--prompt-file")
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise WasteError(f"--prompt-file {args.prompt_file}: not text") from None
        return parse_ids(text, f"--prompt-file {args.prompt_file}")
    return []


class _PlainWriter:
    """A file seen only through its write(): np.save then writes in chunks with it, and a full
    device raises OSError(ENOSPC) naming its reason, instead of ndarray.tofile's bare "N requested
    and M written"."""

    def __init__(self, f: Any):
        self.write = f.write


def save_npy_atomic(path: str | Path, array: np.ndarray) -> None:
    """np.save to a temporary name, then rename into place."""
    write_atomic(path, lambda f: np.save(_PlainWriter(f), array))


def _output_paths(args: Any) -> list[tuple[str, Path]]:
    """Check every output path before the prompt runs (see waste.fileio.check_output)."""
    from waste.engine.session import is_session_file
    from waste.engine.trace import is_trace_file

    kinds = (("--logits-out", args.logits_out, lambda p: file_starts_with(p, NPY_MAGIC)),
             ("--trace-out", args.trace_out, is_trace_file),
             ("--session-out", args.session_out, is_session_file))
    out = [(flag, check_output(path, flag, args.force, same_kind)) for flag, path, same_kind in kinds if path]
    resolved = [p.resolve() for _, p in out]
    if len(set(resolved)) != len(resolved):
        raise WasteError("two outputs name the same file")
    return out


def _sampler(args: Any, saved: dict[str, Any] | None) -> Any:
    """The saved sampler of a resumed session with any option given on this command line applied on top."""
    from waste.engine.sampling import Sampler

    sampler = Sampler.from_state(saved) if saved else Sampler()
    return sampler.with_options(args.temperature, args.top_p, args.seed)


def cmd_run(args: Any) -> int:
    from waste.container.reader import open_container
    from waste.engine.experts import open_expert_store
    from waste.engine.memory import measure_runtime, peak_rss, plan_run_memory
    from waste.engine.model import DEFAULT_PREFILL_CHUNK, PREFILL_PASS_TOKENS, Model
    from waste.engine.runner import generate
    from waste.engine.text import chat_turn_ids, text_printer
    from waste.engine.trace import TraceRecorder
    from waste.tokenizer import require_tokenizer

    # The streaming store's options the user gave (by its keyword, with the flag that set it)
    streaming = {key: (flag, value) for key, flag, value in (
        ("policy", "--cache-policy", args.cache_policy), ("read_threads", "--read-threads", args.read_threads),
        ("io", "--expert-io", args.expert_io)) if value is not None}
    given = [flag for flag, _ in streaming.values()]
    if args.expert_cache == "mmap" and given:
        raise WasteError(f"{', '.join(given)}: options of the streaming store, which --expert-cache mmap does not use")
    budget = None if args.expert_cache in (None, "mmap") else parse_size(args.expert_cache, "--expert-cache")
    prefill_budget = budget
    outputs = dict(_output_paths(args))
    container = open_container(args.container, verify=not args.no_verify)
    tokenizer = require_tokenizer(container) if _text_args(args) else None
    prompt = tokenizer.encode(args.prompt) if getattr(args, "prompt", None) is not None else _prompt(args)
    cfg = container.config
    chunk = args.prefill_chunk or DEFAULT_PREFILL_CHUNK
    if len(prompt) + args.max_new > cfg.max_position_embeddings:
        raise WasteError(f"context of {len(prompt) + args.max_new} tokens (prompt {len(prompt)} + --max-new "
                         f"{args.max_new}) exceeds the model's capacity of {cfg.max_position_embeddings}")
    memory, model = None, None
    if args.expert_cache is None:
        # Load the model and its kernels first, so the plan counts what they take (measure_runtime);
        # plan against the context this run reaches (a resumed session adds its own tokens, which
        # the planner cannot know before the session is read: its state is small).
        model, runtime = measure_runtime(container, chunk=chunk, router_weights=args.router_weights)
        memory = plan_run_memory(container, len(prompt) + args.max_new, chunk=chunk,
                                 pass_tokens=PREFILL_PASS_TOKENS, runtime=runtime, decode_tokens=args.max_new,
                                 all_logits=bool(args.logits_out))
        budget = None if memory.experts_fit else memory.cache_budget
        prefill_budget = None if memory.experts_fit else memory.prefill_cache_budget
        if memory.experts_fit:
            # Each expert copied into memory on huge pages on first use (the plan counts them all):
            # the map's 4 KiB pages cost the products TLB misses. `--expert-cache mmap` keeps the map.
            container.hold_experts_in_memory()
        else:
            # The one line saying why the run streams (stdout may carry the generated text);
            # when every expert fits, the memory-mapped store needs no word.
            print(memory.describe(), file=sys.stderr)
    store = open_expert_store(container, budget, prefill_budget_bytes=prefill_budget,
                              **{key: value for key, (_, value) in streaming.items()})
    if model is None:
        model = Model(container, store=store, router_weights=args.router_weights)
    else:
        model.store = store
    if args.session_in:
        session = model.load_session(args.session_in)
        sampler = _sampler(args, session.sampler_state)
        if getattr(args, "chat", None) is not None:
            prompt = chat_turn_ids(tokenizer, args.chat, continuing=session.position > 0,
                                   last_token=session.tokens[-1] if session.position else None)
    else:
        if getattr(args, "chat", None) is not None:
            prompt = chat_turn_ids(tokenizer, args.chat, continuing=False, last_token=None)
        if not prompt:
            raise WasteError("the prompt is empty: give --prompt-ids or --prompt-file")
        session = model.new_session(capacity=len(prompt) + args.max_new)
        sampler = _sampler(args, None)
    if not prompt and session.last_logits is None:
        raise WasteError(f"session {args.session_in} has no tokens to continue from; give --prompt-ids")
    needed = session.position + len(prompt) + args.max_new
    if needed > cfg.max_position_embeddings:
        raise WasteError(f"context of {needed} tokens (session {session.position} + prompt {len(prompt)} + "
                         f"--max-new {args.max_new}) exceeds the model's capacity of {cfg.max_position_embeddings}")
    # The container named in the trace, so that `waste plan --trace` can tell another model's routing.
    recorder = TraceRecorder(cfg.num_layers, cfg.moe_layers, cfg.num_experts_per_token,
                             metadata={"container": str(container.path),
                                       "container_sha256": container.manifest_sha256}) if args.trace_out else None
    on_token, finish = text_printer(tokenizer, sys.stdout) if tokenizer else (None, None)
    run = generate(model, session, prompt, args.max_new, sampler, chunk=chunk, observer=recorder,
                   all_prompt_logits=bool(args.logits_out), on_token=on_token)
    if finish is not None:
        finish()
    # Outputs before the summary, each tried even if one before it failed.
    writers = {"--logits-out": lambda p: save_npy_atomic(p, run.all_logits().astype(np.float32)),
               "--trace-out": lambda p: recorder.save(p),
               "--session-out": lambda p: session.save(p)}
    written, failures = [], []
    for flag, path in outputs.items():
        try:
            writers[flag](path)
            written.append(f"{flag.removeprefix('--').removesuffix('-out')}: {path}")
            if flag == "--session-out":
                written[-1] += (f" at position {session.position} "
                                f"(state {human_bytes(sum(session.state_bytes.values()))})")
        except OSError as e:
            failures.append(f"{flag} {path}: {e.strerror or e}")
    print("generated:", ",".join(str(t) for t in run.generated))
    print(f"prefill: {run.prompt_len} tokens in {run.prefill_seconds:.3f} s ({_speed(run.prefill_tps)}); "
          f"decode: {len(run.generated)} tokens in {run.decode_seconds:.3f} s ({_speed(run.decode_tps)})")
    if run.prefill_compile_seconds or run.decode_compile_seconds:
        print(f"of these, compiling kernels: {run.prefill_compile_seconds:.1f} s of the prefill, "
              f"{run.decode_compile_seconds:.1f} s of the decode (their first use since waste was installed or "
              "updated; the next run loads them from the cache)")
    if model.times.prefill_dedup is not None:
        print(f"prefill expert dedup ratio (token-expert pairs per unique expert fetched): "
              f"{model.times.prefill_dedup:.2f}")
    print(store.stats.format_table())
    total = store.stats.total
    hit = "-" if total.requests == 0 or store.io_mode == "mmap" else f"{100 * total.hit_rate:.1f}%"
    planned = f"planned peak {human_bytes(memory.planned_peak)}, " if memory is not None else ""
    held = " (experts copied into memory)" if container.experts_in_memory else ""
    cache = human_bytes(getattr(store, "budget_bytes", 0))
    prefill_cache = getattr(store, "prefill_budget_bytes", None)  # a streaming store's
    if prefill_cache is not None and prefill_cache != store.budget_bytes:
        cache += f" ({human_bytes(prefill_cache)} while the prompt was read)"
    print(f"memory: {planned}peak RSS {human_bytes(peak_rss())}; experts: store {store.io_mode}{held}, "
          f"cache budget {cache}, hit rate {hit}, "
          f"read {total.bytes_read / 1e9:.2f} GB")
    for line in written:
        print(line)
    store.close()
    container.close()
    if failures:
        raise WasteError("; ".join(failures))
    return 0


def _speed(tokens_per_second: float) -> str:
    """A speed for the stats line; "-" when no token was timed (--max-new 0, a resumed empty prompt)."""
    return f"{tokens_per_second:.1f} tok/s" if math.isfinite(tokens_per_second) else "- tok/s"


def cmd_check(args: Any) -> int:
    from waste.container.reader import open_container
    from waste.engine.check import check_against_oracle
    from waste.engine.model import DEFAULT_PREFILL_CHUNK

    container = open_container(args.container, verify=not args.no_verify)
    cfg = container.config
    if args.prompt_len + args.new > cfg.max_position_embeddings:
        raise WasteError(f"--prompt-len + --new = {args.prompt_len + args.new} exceeds the model's capacity "
                         f"of {cfg.max_position_embeddings}")
    rng = np.random.default_rng(args.seed)
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, args.prompt_len)]
    source = None
    if args.source is not None:
        from waste.container.source import CheckpointSource, check_source_matches

        source = CheckpointSource(args.source)
        check_source_matches(source, container)
    report = check_against_oracle(container, prompt, args.new, chunk=args.prefill_chunk or DEFAULT_PREFILL_CHUNK,
                                  tolerance=args.tolerance, source=source)
    print(report.format())
    sys.stdout.flush()
    if not report.passed:
        raise CheckFailed("; ".join(report.failures()))
    return 0
