"""`waste demo` (`make demo`): the whole pipeline on the embedded `tiny` preset.

Synthesise a random tiny checkpoint (kept between runs), convert it to a container,
print the memory plans of every preset and of the container, generate from a prompt, answer a
chat turn through the container's tokenizer, check the engine against the float64 oracle, and
print a summary.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from waste.config import PRESETS
from waste.errors import CheckFailed, WasteError

# Written into the work directory by the demo: a directory holding it is the demo's own, whose
# checkpoint and container a later demo may replace; any other non-empty one is refused.
DEMO_MARK = ".waste-demo"


def _section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def _claim_work_dir(work: Path, force: bool) -> None:
    """Make `work` the demo's directory, refusing one that holds files the demo did not write
    (its tiny-hf and tiny.waste would be replaced) unless `force`."""
    if work.exists() and not work.is_dir():
        raise WasteError(f"--work-dir {work}: not a directory")
    if work.is_dir() and not (work / DEMO_MARK).exists() and any(work.iterdir()) and not force:
        raise WasteError(f"--work-dir {work} holds files waste demo did not write (its tiny-hf and tiny.waste "
                         "would be replaced); give a new or empty directory, or pass --force")
    work.mkdir(parents=True, exist_ok=True)
    (work / DEMO_MARK).write_text("made by waste demo: its tiny-hf and tiny.waste are replaced by the next demo\n")


def cmd_demo(args: Any) -> int:
    from waste.container.convert import convert
    from waste.container.reader import open_container
    from waste.engine.check import check_against_oracle
    from waste.engine.model import Model
    from waste.engine.runner import generate
    from waste.engine.sampling import Sampler
    from waste.engine.text import chat_turn_ids, text_printer
    from waste.plan import format_plan, make_plan
    from waste.synth import synthesize
    from waste.tokenizer import container_tokenizer, has_tokenizer

    start = time.perf_counter()
    work = Path(args.work_dir)
    _claim_work_dir(work, args.force)
    hf_dir, container_path = work / "tiny-hf", work / "tiny.waste"

    _section("memory plans of the embedded presets (4K context, q4 weights, 24 GiB RAM)")
    for name in PRESETS:
        print(format_plan(make_plan(name, context="4K", ram="24G")), end="\n\n")

    _section("synthesise and convert tiny")
    if (hf_dir / "config.json").is_file() and has_tokenizer(hf_dir):
        print(f"reusing {hf_dir}")
    else:
        synthesize("tiny", hf_dir, seed=0, dtype="f32", force=True)
        print(f"synthesised {hf_dir} (random weights and a small tokenizer in Kimi's format)")
    convert(hf_dir, container_path, quant="f32", force=True, progress=False)
    print(f"converted to {container_path}")
    print(format_plan(make_plan(str(container_path), context="4K", ram="64M")))

    _section("generate")
    container = open_container(container_path)
    model = Model(container)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, container.config.vocab_size, 40)]
    # A short throwaway run first, so the timed one measures the kernels and not their compilation.
    generate(model, model.new_session(), prompt[:4], 2, Sampler(), all_prompt_logits=False)
    session = model.new_session(capacity=len(prompt) + 16)
    run = generate(model, session, prompt, 16, Sampler(), all_prompt_logits=False)
    print("prompt:   ", ",".join(map(str, prompt)))
    print("generated:", ",".join(map(str, run.generated)))
    print(f"prefill {run.prefill_tps:.0f} tok/s, decode {run.decode_tps:.0f} tok/s")

    _section("text in and out (waste run --chat): Kimi's chat template, the reply streamed as text")
    tokenizer = container_tokenizer(container_path)
    chat = chat_turn_ids(tokenizer, "What is the capital of France?", continuing=False, last_token=None)
    print(tokenizer.decode(chat))
    on_token, finish = text_printer(tokenizer, sys.stdout)
    generate(model, model.new_session(capacity=len(chat) + 12), chat, 12, Sampler(), all_prompt_logits=False,
             on_token=on_token)
    finish()
    print("(random weights: the reply is noise, but every id decodes to text)")

    _section("engine against the float64 oracle")
    report = check_against_oracle(container, prompt, 8, model=model)
    print(report.format())

    _section("summary")
    print(f"tiny: {container.config.num_layers} layers ({len(container.config.kda_layers)} KDA, "
          f"{len(container.config.mla_layers)} MLA), worst relative error "
          f"{max(report.layer_errors + [report.logits_error]):.2e} (tolerance {report.tolerance:.0e}), "
          f"{'PASS' if report.passed else 'FAIL'}; demo took {time.perf_counter() - start:.1f} s")
    container.close()
    if not report.passed:
        raise CheckFailed("the engine disagrees with the oracle on tiny")
    return 0
