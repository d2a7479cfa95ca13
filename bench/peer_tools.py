"""The llama.cpp side of bench/peer.py, run by the Python of its own venv (outside the repo).

It never imports waste. Two commands:

    peer_tools.py convert LLAMA_DIR HF_DIR OUT.gguf --outtype f32|bf16
        llama.cpp's own convert_hf_to_gguf.py on a `waste synth` checkpoint. The converter
        reads a Kimi tokenizer only through Kimi's own remote code (tokenization_kimi.py, which
        a synthesised checkpoint does not ship beside its small tiktoken.model) and accepts it
        only when its pre-tokenizer hash is Kimi-K2's, which a small synthetic vocabulary
        cannot match. So Kimi-Linear's vocabulary step is replaced by the converter's smallest
        documented fallback, the built-in vocabulary it gives models that ship none
        (`_set_vocab_builtin("llama-spm", vocab_size)`, as for Mamba and OpenELM): 32000
        tokens, the `mini` vocabulary size. Token ids are all the bench uses.

    peer_tools.py logits SOURCE_DIR LIB_DIR MODEL.gguf IDS.npy OUT.npy --threads N
        feeds the ids one at a time to llama.cpp through its C API (the ctypes bindings in the
        llama-cpp-python sdist at SOURCE_DIR, loading libllama from LIB_DIR) and saves the
        logits after each, float32 [len(ids), vocab].
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import sys
import types
from pathlib import Path

import numpy as np


def convert(llama_dir: Path, hf_dir: Path, out: Path, outtype: str) -> None:
    # The converter finds its built-in vocabularies under sys.path[0]/models.
    sys.path.insert(0, str(llama_dir))
    import convert_hf_to_gguf
    from conversion.kimi_linear import KimiLinearModel

    def builtin_vocab(self) -> None:  # noqa: ANN001
        self._set_vocab_builtin("llama-spm", self.hparams["vocab_size"])

    KimiLinearModel.set_vocab = builtin_vocab
    tmp = out.with_name(out.name + ".tmp")
    sys.argv = ["convert_hf_to_gguf.py", str(hf_dir), "--outfile", str(tmp), "--outtype", outtype]
    convert_hf_to_gguf.main()
    os.replace(tmp, out)


def _bindings(source_dir: Path, lib_dir: Path) -> types.ModuleType:
    """llama_cpp.llama_cpp from the sdist, without the package's __init__ (which wants the
    high-level API's dependencies)."""
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    package = types.ModuleType("llama_cpp")
    package.__path__ = [str(source_dir / "llama_cpp")]
    sys.modules["llama_cpp"] = package
    return importlib.import_module("llama_cpp.llama_cpp")


def logits(source_dir: Path, lib_dir: Path, model_path: Path, ids_path: Path, out: Path, threads: int) -> None:
    ll = _bindings(source_dir, lib_dir)
    ids = np.load(ids_path).astype(np.int32)
    ll.llama_backend_init()
    mparams = ll.llama_model_default_params()
    model = ll.llama_model_load_from_file(str(model_path).encode(), mparams)
    if not model:
        raise SystemExit(f"llama.cpp could not load {model_path}")
    cparams = ll.llama_context_default_params()
    cparams.n_ctx = len(ids) + 16
    cparams.n_batch = cparams.n_ubatch = 64
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = ll.llama_init_from_model(model, cparams)
    vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    result = np.empty((len(ids), vocab), np.float32)
    token = (ll.llama_token * 1)()
    for i, t in enumerate(ids):
        token[0] = int(t)
        if ll.llama_decode(ctx, ll.llama_batch_get_one(token, 1)) != 0:
            raise SystemExit(f"llama_decode failed at position {i}")
        row = ll.llama_get_logits_ith(ctx, -1)
        result[i] = np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), (vocab,))
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    tmp = out.with_name(out.name + ".tmp.npy")
    np.save(tmp, result)
    os.replace(tmp, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert")
    c.add_argument("llama_dir", type=Path)
    c.add_argument("hf_dir", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--outtype", choices=("f32", "bf16"), required=True)
    g = sub.add_parser("logits")
    for name in ("source_dir", "lib_dir", "model", "ids", "out"):
        g.add_argument(name, type=Path)
    g.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    if args.command == "convert":
        convert(args.llama_dir, args.hf_dir, args.out, args.outtype)
    else:
        logits(args.source_dir, args.lib_dir, args.model, args.ids, args.out, args.threads)


if __name__ == "__main__":
    main()
