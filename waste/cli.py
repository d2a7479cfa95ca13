"""The `waste` command line: plan, synth, convert, info, verify, run, check, demo.

Exit codes: 0 success, 1 a check failed, 2 bad input (a one-line message naming the
problem; `--debug` shows the traceback). Each subcommand's work lives in its own module;
this file only declares the arguments and dispatches.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import math
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence

from waste.env import blas_threads, check_numba_threads
from waste.errors import CheckFailed, WasteError
from waste.expert_io import DEFAULT_IO, IO_MODES
from waste.qformat import EXPERT_CHOICES, SCHEMES
from waste.units import MAX_GBPS

# subcommand -> "module:function" taking the parsed args and returning an exit code
HANDLERS = {
    "plan": "waste.plan:cmd_plan",
    "synth": "waste.synth:cmd_synth",
    "convert": "waste.container.convert:cmd_convert",
    "info": "waste.container.inspect:cmd_info",
    "verify": "waste.container.inspect:cmd_verify",
    "run": "waste.engine.cli:cmd_run",
    "check": "waste.engine.cli:cmd_check",
    "demo": "waste.demo:cmd_demo",
}

ROOT_PROG = "waste"


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line with exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        # A subcommand's parser names itself ("waste run: ..."); the root's name is already the
        # line's own prefix ("waste: error: ...").
        raise WasteError(message if self.prog == ROOT_PROG else f"{self.prog}: {message}")


def _int(low: int, high: int = (1 << 63) - 1) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (every count and seed is checked before work starts)."""

    def parse(text: str) -> int:
        # ASCII digits only: int() would also take "1_000" and full-width digits.
        if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", text):
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
        v = int(text)
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"{v} is outside {low}..{high}")
        return v

    return parse


def _float(low: float, high: float = math.inf, *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] (or (low, high] with low_open)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or v < low or v > high or (low_open and v == low):
            upper = f"{high:g}]" if math.isfinite(high) else "inf)"
            raise argparse.ArgumentTypeError(f"{text} is not a finite number in {'(' if low_open else '['}{low:g}, "
                                             f"{upper}")
        return v

    return parse


SEED = _int(0, (1 << 63) - 1)
# Tokens one run may add: far above any model's context, low enough that nothing is sized from it first.
MAX_NEW = _int(0, 1 << 24)
# The default lives with the engine (waste.engine.model.DEFAULT_PREFILL_CHUNK), which this module
# does not import: it compiles kernels.
PREFILL_CHUNK_HELP = "prompt tokens per KDA prefill call (default: the engine's fastest measured)"


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: given after the subcommand it sets args.debug, and never resets one given before it.
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks on errors")
    p = _Parser(prog=ROOT_PROG, description="WASTE research workbench")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name: str, help: str) -> argparse.ArgumentParser:  # noqa: A002 - argparse's own name
        return sub.add_parser(name, help=help, parents=[common])

    s = command("plan", help="memory plan of a preset, config.json or container")
    s.add_argument("target", help="preset name, path to config.json (or its directory), or a NAME.waste container")
    s.add_argument("--context", default="4K", help="context length in tokens: 4096, 4K, 128K, 1M (default 4K)")
    s.add_argument("--ram", help="RAM budget, e.g. 24G: shows the room left for the expert cache")
    s.add_argument("--state-dtype", choices=("f32", "bf16"), default="f32", help="dtype of KDA state and MLA cache")
    s.add_argument("--quant", choices=SCHEMES, default=None,
                   help="weight scheme to size (default: the container's, else q4)")
    s.add_argument("--experts", choices=tuple(EXPERT_CHOICES), default=None,
                   help="routed expert storage to size (default: MXFP4 when the checkpoint's experts are, else "
                        "the scheme's)")
    s.add_argument("--sweep", action="store_true", help="context-dependent lines from 1K to the model's maximum")
    s.add_argument("--json", action="store_true", help="print the plan as JSON")
    s.add_argument("--disk-gbps", type=_float(0.0, MAX_GBPS, low_open=True), default=None,
                   help="disk read bandwidth for the decode prediction with --ram (default: measured on the "
                        "container's disk once and cached)")
    s.add_argument("--mem-gbps", type=_float(0.0, MAX_GBPS, low_open=True), default=None,
                   help="memory bandwidth for the decode prediction with --ram (default: measured once and cached)")
    s.add_argument("--measure", action="store_true", help="measure the bandwidths again instead of using the cache")
    s.add_argument("--trace", help="routing trace (.npz from waste run --trace-out) whose decode lookups give the "
                   "hit rate, instead of uniform routing")

    s = command("synth", help="write a random Hugging Face style checkpoint (or, with --quant, a container)")
    s.add_argument("preset", help="preset name or path to a config.json")
    s.add_argument("out_dir", help="checkpoint directory, or NAME.waste with --quant")
    s.add_argument("--quant", choices=tuple(x for x in SCHEMES if x != "bf16"), default=None,
                   help="write a container in this scheme directly (no checkpoint; float32 values)")
    s.add_argument("--quiet", action="store_true", help="no progress bar (with --quant)")
    s.add_argument("--seed", type=SEED, default=0, help="of the random weights (default 0)")
    s.add_argument("--dtype", choices=("bf16", "f32"), default=None, help="checkpoint values (default bf16)")
    s.add_argument("--expert-format", choices=("mxfp4", "bf16", "f32"), default=None,
                   help="routed experts: MXFP4 (the default for K3, as it ships) or a float dtype (default --dtype)")
    s.add_argument("--attn-res-spelling", choices=("canonical", "dotted"), default=None,
                   help="K3 AttnRes names: <x>_res_norm.weight (canonical) or <x>_res.norm_weight (dotted)")
    s.add_argument("--shard-size", default=None, help="largest shard before a new one starts (default 512M)")
    s.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")

    s = command("convert", help="convert a Hugging Face checkpoint into a NAME.waste container")
    s.add_argument("hf_dir")
    s.add_argument("out")
    s.add_argument("--quant", choices=SCHEMES, default="q8",
                   help="q4all: the trunk in q4g too, except embedding and lm_head (q8g); routers stay float32")
    s.add_argument("--experts", choices=tuple(EXPERT_CHOICES), default=None,
                   help="routed expert storage (default: MXFP4 experts stay MXFP4 byte for byte, others follow "
                        "--quant); any other choice dequantises and stores again")
    s.add_argument("--force", action="store_true", help="replace OUT if it exists")
    s.add_argument("--quiet", action="store_true", help="no progress bar")

    s = command("info", help="summary of a container (the manifest only: no data CRCs)")
    s.add_argument("container")
    s.add_argument("--json", action="store_true")

    s = command("verify", help="check every CRC, padding byte and stored float of a container")
    s.add_argument("container", help="a NAME.waste container directory")

    s = command("run", help="generate tokens from a container")
    s.add_argument("container")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--prompt-file", help="file of whitespace- or comma-separated token ids")
    src.add_argument("--prompt", help="text, encoded by the container's tokenizer; the reply streams as text")
    src.add_argument("--chat", help="a user's turn: Kimi's chat template around it (continues a --session-in "
                     "conversation); the reply streams as text and stops at the end of the turn")
    s.add_argument("--max-new", type=MAX_NEW, default=16, help="tokens to generate (default 16)")
    # None = not given: a resumed session keeps its saved sampler unless these are given.
    s.add_argument("--temperature", type=_float(0.0), default=None, help="0 = greedy (default)")
    s.add_argument("--top-p", type=_float(0.0, 1.0, low_open=True), default=None, help="default 1")
    s.add_argument("--seed", type=SEED, default=None, help="default 0")
    s.add_argument("--prefill-chunk", type=_int(1, 1 << 20), default=None, help=PREFILL_CHUNK_HELP)
    s.add_argument("--router-weights", choices=("unbiased", "biased"), default="unbiased",
                   help="weigh the chosen experts by their scores without the routing bias (transformers, "
                        "vLLM; default) or with it (the official remote code)")
    s.add_argument("--logits-out", help="write float32 logits [prompt_len + max_new, vocab] to this .npy")
    s.add_argument("--expert-cache", default=None,
                   help="byte budget of the streaming expert cache (0 disables), e.g. 2G, or 'mmap' for the memory "
                        "map; default: the memory map when every expert fits in the available RAM, else streaming "
                        "with the room the planner leaves")
    # The streaming store's options; None (not given) takes the store's defaults.
    s.add_argument("--cache-policy", choices=("lru", "lfu"), default=None, help="the streaming cache's (default lru)")
    s.add_argument("--read-threads", type=_int(1, 256), default=None, help="the streaming store's (default 4)")
    s.add_argument("--expert-io", choices=IO_MODES, default=None,
                   help="how the streaming store reads experts: into the page cache (views of the map), with "
                        f"O_DIRECT into buffers of its own, or buffered into them (default {DEFAULT_IO})")
    s.add_argument("--trace-out", help="write the routing trace to this .npz")
    s.add_argument("--session-in", help="resume from this session file")
    s.add_argument("--session-out", help="save the session after the run")
    s.add_argument("--force", action="store_true",
                   help="let outputs replace existing files that are not earlier outputs of the same kind")
    s.add_argument("--no-verify", action="store_true",
                   help="skip the CRC checks of trunk and expert data (the manifest is always checked)")

    s = command("check", help="engine against the float64 oracle, per layer")
    s.add_argument("container")
    s.add_argument("--prompt-len", type=_int(1, 1 << 24), default=80,
                   help="random prompt tokens, prefilled and compared (default 80)")
    s.add_argument("--new", type=MAX_NEW, default=8, help="greedy tokens decoded and compared after it (default 8)")
    s.add_argument("--seed", type=SEED, default=0, help="of the random prompt (default 0)")
    s.add_argument("--prefill-chunk", type=_int(1, 1 << 20), default=None, help=PREFILL_CHUNK_HELP)
    s.add_argument("--tolerance", type=_float(0.0, low_open=True), default=None,
                   help="relative error allowed (default: 1e-5 for f32, else from the modelled rounding error)")
    s.add_argument("--source", metavar="CHECKPOINT_DIR", default=None,
                   help="the oracle reads this checkpoint (the one the container was converted from) instead of "
                        "the container's weights, so the weight format's own error counts too, and holds every stored "
                        "matrix to its format's error estimate")
    s.add_argument("--no-verify", action="store_true", help="skip the CRC checks of trunk and expert data")

    s = command("demo", help="the whole pipeline on the tiny preset")
    s.add_argument("--work-dir", default=".demo", help="where the synthesised checkpoint and container live")
    s.add_argument("--force", action="store_true",
                   help="use a --work-dir that holds files the demo did not write (its tiny-hf and tiny.waste "
                        "are replaced)")
    return p


def describe_os_error(e: OSError) -> str:
    """One line for an OSError: the file(s) it names and the system's reason."""
    reason = e.strerror or errno.errorcode.get(e.errno or 0, "") or str(e)
    names = [str(f) for f in (e.filename, e.filename2) if f is not None]
    return f"{' -> '.join(names)}: {reason}" if names else reason


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the flush at exit cannot fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        blas_threads()  # a bad WASTE_BLAS_THREADS fails here, whether or not the command loads kernels
        check_numba_threads()
        module_name, func_name = HANDLERS[args.command].split(":")
        handler = getattr(importlib.import_module(module_name), func_name)
        code = int(handler(args) or 0)
        # A full device or a closed pipe on stdout shows up here, inside the handlers below.
        sys.stdout.flush()
        return code
    except (WasteError, CheckFailed) as e:
        if debug:
            traceback.print_exc()
        print(f"waste: error: {e}" if isinstance(e, WasteError) else f"waste: check failed: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("waste: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return 0
    except OSError as e:
        if debug:
            traceback.print_exc()
        print(f"waste: error: {describe_os_error(e)}", file=sys.stderr)
        if e.errno in (errno.ENOSPC, errno.EIO, errno.EDQUOT):
            _silence_stdout()
        return 2
    except MemoryError as e:
        # A model or shape too large for this machine's memory (NumPy names the allocation).
        if debug:
            traceback.print_exc()
        detail = str(e).strip()
        print(f"waste: error: out of memory{': ' + detail if detail else ''}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
