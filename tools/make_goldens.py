"""Regenerate the external golden vectors in tests/golden/ (not needed for `make test`).

The goldens are numbers from implementations that share no code with waste, so a misreading of
the specification that waste's kernels and its float64 oracle have in common shows up:

- kda_fla_naive.npz: fla-core's `naive_recurrent_kda` and `naive_chunk_kda`
  (fla/ops/kda/naive.py, plain PyTorch, float32) on random inputs at fla's default decays,
  weak decays (exp(g) in [0.99, 1)) and K3's floor (g = -5), with an initial state; q and k
  are L2-normalised beforehand by transformers' own `l2norm` (the naive functions expect it).
- kimi_linear_tiny/ (config.json + model.safetensors) and kimi_linear_tiny.npz: a tiny random
  Kimi-Linear checkpoint in the Hugging Face layout (written by `waste synth tiny`, f32), and
  the logits and hidden states transformers' `KimiLinearForCausalLM` computes from it, loaded
  by transformers' own checkpoint conversion. fla is made unimportable for this step, so the
  model runs transformers' PyTorch fallbacks for the short convolution and KDA (fla's Triton
  kernels need a GPU); the file records which path ran.

- k3_tiny/ (config.json + model.safetensors) and k3_tiny_mlx.npz: a tiny random Kimi K3
  checkpoint in K3's own layout (`waste synth k3-tiny`, f32 trunk, MXFP4 routed experts under a
  compressed-tensors quantization_config), and what mlx-lm's `kimi_k3` model computes from it on
  the CPU, loaded by mlx-lm's own `load_model` and `sanitize`: the logits of a 96-token prompt in
  one call, then greedy tokens decoded one at a time through its cache with their logits.
  k3_tiny_variant/ and k3_tiny_variant_mlx.npz the same for k3-tiny's other forms
  (K3_VARIANT): the latent MoE's norm, SiTU with a null beta and a linear beta, AttnRes blocks of
  3 over 5 layers with the dotted tensor names, MLA with a plain query and no output gate.
- kimi_linear_tiny_mlx.npz: the same from mlx-lm's `kimi_linear` on kimi_linear_tiny/ (which
  transformers' golden covers for a prompt only): a second implementation of its prefill and the
  only independent one of its decode through a cache.

Every .npz records the versions used under `versions`: torch, transformers, fla-core and Python
for the first two; mlx, mlx-lm and Python for mlx-lm's.

The first two need an environment with torch, transformers and fla-core, mlx-lm's an
environment with mlx (its CPU build runs on Linux) and mlx-lm; both use the repository's own venv
for `waste synth`:

    python3 -m venv /work/goldens-venv
    /work/goldens-venv/bin/pip install torch==2.13.0 transformers==5.23.0 einops
    /work/goldens-venv/bin/pip install --no-deps fla-core==0.6.0
    /work/goldens-venv/bin/python tools/make_goldens.py --waste .venv/bin/waste --goldens kda model

    python3 -m venv /work/mlx-venv
    /work/mlx-venv/bin/pip install "mlx[cpu]==0.32.4" mlx-lm==0.32.2
    /work/mlx-venv/bin/python tools/make_goldens.py --waste .venv/bin/waste --goldens mlx
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
KDA_SHAPE = (256, 2, 32, 32)  # T, H, K, V: four fla chunks of 64
FLOOR = -5.0
PROMPT_LEN = 24
CHECKPOINT_SEED = 11
# mlx-lm's prompts are longer than transformers' (PROMPT_LEN, their first tokens): past MLA
# prefill's 64-key blocks and several AttnRes and KDA passes. Then greedy tokens one at a time.
MLX_PROMPT_LEN = 96
MLX_DECODED = 8
# k3-tiny's text_config with the forms the preset leaves out, for k3_tiny_variant.
K3_VARIANT = {"latent_moe_use_norm": True, "activation_situ_beta": None, "activation_situ_linear_beta": 1.5,
              "attn_res_block_size": 3, "q_lora_rank": None, "mla_use_output_gate": False}
TORCH_PACKAGES = ("torch", "transformers", "fla-core", "numpy")
MLX_PACKAGES = ("mlx", "mlx-lm", "numpy")


def versions(names: tuple[str, ...] = TORCH_PACKAGES) -> str:
    """The packages behind a golden, as a JSON string (np.savez keeps it as a 0-d array)."""
    found = {n: importlib.metadata.version(n) for n in names}
    found["python"] = platform.python_version()
    return json.dumps(found, sort_keys=True)


def load_fla_naive():
    """fla/ops/kda/naive.py by path: fla's package __init__ imports Triton kernels."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("fla-core is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def kda_case(rng: np.random.Generator, decays: str) -> dict[str, np.ndarray]:
    """Random float32 inputs [T, H, ...] (batch dimension dropped) for one decay regime."""
    T, H, K, V = KDA_SHAPE
    f = np.float32
    x = {"q": rng.standard_normal((T, H, K)).astype(f), "k": rng.standard_normal((T, H, K)).astype(f),
         "v": rng.standard_normal((T, H, V)).astype(f)}
    if decays == "fla_default":
        g = -np.logaddexp(0.0, -rng.standard_normal((T, H, K)))  # logsigmoid(N(0, 1))
    elif decays == "weak":
        g = np.log(rng.uniform(0.99, 1.0, (T, H, K)))
    else:
        g = np.full((T, H, K), FLOOR)
    x["g"] = g.astype(f)
    x["beta"] = (1.0 / (1.0 + np.exp(-rng.standard_normal((T, H))))).astype(f)
    x["initial_state"] = (0.1 * rng.standard_normal((H, K, V))).astype(f)
    return x


def make_kda_goldens() -> Path:
    import torch
    from transformers.models.kimi_linear.modeling_kimi_linear import l2norm

    naive = load_fla_naive()
    rng = np.random.default_rng(2026)
    out: dict[str, np.ndarray] = {"versions": np.array(versions()),
                                  "source": np.array("fla/ops/kda/naive.py naive_recurrent_kda, naive_chunk_kda "
                                                     "(float32); q, k normalised by transformers' l2norm, eps 1e-6")}
    for decays in ("fla_default", "weak", "floor"):
        x = kda_case(rng, decays)
        t = {n: torch.from_numpy(a)[None] for n, a in x.items() if n != "initial_state"}
        s0 = torch.from_numpy(x["initial_state"])[None]
        q, k = l2norm(t["q"], dim=-1, eps=1e-6), l2norm(t["k"], dim=-1, eps=1e-6)
        o_rec, s_rec = naive.naive_recurrent_kda(q, k, t["v"], t["g"], t["beta"], initial_state=s0,
                                                 output_final_state=True)
        o_chk, s_chk = naive.naive_chunk_kda(q, k, t["v"], t["g"], t["beta"], initial_state=s0,
                                             output_final_state=True, chunk_size=64)
        for name, a in x.items():
            out[f"{decays}/{name}"] = a
        out[f"{decays}/o_recurrent"] = o_rec[0].numpy()
        out[f"{decays}/state_recurrent"] = s_rec[0].numpy()
        out[f"{decays}/o_chunk"] = o_chk[0].numpy()
        out[f"{decays}/state_chunk"] = s_chk[0].numpy()
    path = GOLDEN / "kda_fla_naive.npz"
    np.savez_compressed(path, **out)
    return path


def synth_checkpoint(waste: str, preset: str, name: str, *extra: str) -> Path:
    """tests/golden/<name>/: `waste synth preset --dtype f32 *extra` at CHECKPOINT_SEED (preset: a
    name or a config.json), its config.json and safetensors only (no tokenizer: the goldens take
    token ids)."""
    ckpt = GOLDEN / name
    with tempfile.TemporaryDirectory() as tmp:
        synth = Path(tmp) / "ckpt"
        subprocess.run([waste, "synth", preset, str(synth), "--dtype", "f32", "--seed", str(CHECKPOINT_SEED), *extra],
                       check=True, stdout=subprocess.DEVNULL)
        if ckpt.exists():
            shutil.rmtree(ckpt)
        ckpt.mkdir(parents=True)
        for f in synth.iterdir():
            if f.name == "config.json" or f.suffix == ".safetensors" or f.name.endswith(".index.json"):
                shutil.copy(f, ckpt / f.name)
    return ckpt


def prompt_ids(vocab_size: int, length: int = PROMPT_LEN) -> np.ndarray:
    """The goldens' prompt: a longer one begins with a shorter one's tokens."""
    return np.random.default_rng(CHECKPOINT_SEED).integers(0, vocab_size, length)


def make_model_goldens(waste: str) -> Path:
    sys.modules["fla"] = None  # make `import fla` fail: transformers then runs its PyTorch paths
    import torch
    import transformers
    from transformers import KimiLinearForCausalLM
    from transformers.models.kimi_linear import modeling_kimi_linear as mk

    ckpt = synth_checkpoint(waste, "tiny", "kimi_linear_tiny")
    torch.manual_seed(0)
    model = KimiLinearForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model.eval()
    kda_path = {fn: getattr(mk, fn).__module__ for fn in ("chunk_kimi_delta_attention",
                                                          "recurrent_kimi_delta_attention")}
    cfg = json.loads((ckpt / "config.json").read_text())
    ids = prompt_ids(cfg["vocab_size"])
    with torch.no_grad():
        result = model(torch.from_numpy(ids)[None], output_hidden_states=True, use_cache=False)
    out = {
        "versions": np.array(versions()),
        "source": np.array(f"transformers {transformers.__version__} KimiLinearForCausalLM, float32, fla not "
                           f"importable; KDA functions from {kda_path}"),
        "ids": ids.astype(np.int64),
        "logits": result.logits[0].numpy(),
        "hidden_states": np.stack([h[0].numpy() for h in result.hidden_states]),
    }
    path = GOLDEN / "kimi_linear_tiny.npz"
    np.savez_compressed(path, **out)
    return path


def make_mlx_goldens(waste: str) -> list[Path]:
    """The K3 checkpoints and their goldens, and the Kimi-Linear one of `make_model_goldens`
    through mlx-lm's kimi_linear."""
    with tempfile.TemporaryDirectory() as tmp:
        config = json.loads((ROOT / "waste" / "presets" / "k3-tiny.json").read_text())
        config["text_config"].update(K3_VARIANT)
        variant = Path(tmp) / "config.json"
        variant.write_text(json.dumps(config, indent=2))
        cases = [synth_checkpoint(waste, "k3-tiny", "k3_tiny"),
                 synth_checkpoint(waste, str(variant), "k3_tiny_variant", "--attn-res-spelling", "dotted")]
    paths = []
    with tempfile.TemporaryDirectory() as tmp:
        for ckpt in [*cases, GOLDEN / "kimi_linear_tiny"]:
            readable = mlx_readable(ckpt, Path(tmp) / ckpt.name)
            vocab = json.loads((ckpt / "config.json").read_text())
            ids = prompt_ids(vocab.get("text_config", vocab)["vocab_size"], MLX_PROMPT_LEN)
            out = mlx_outputs(readable, ids, MLX_DECODED)
            paths.append(GOLDEN / f"{ckpt.name}_mlx.npz")
            np.savez_compressed(paths[-1], **out)
    return paths


def mlx_readable(ckpt: Path, scratch: Path) -> Path:
    """The checkpoint as mlx-lm loads it: K3's as it is; a Kimi-Linear one copied to `scratch`
    with head_dim and rope_theta added to its config, which mlx-lm's kimi_linear asks for and this
    NoPE MLA with its dimensions given uses neither of."""
    config = json.loads((ckpt / "config.json").read_text())
    if "text_config" in config:
        return ckpt
    shutil.copytree(ckpt, scratch)
    config.update(head_dim=config["v_head_dim"], rope_theta=10000.0)
    (scratch / "config.json").write_text(json.dumps(config, indent=2))
    return scratch


def mlx_outputs(ckpt: Path, ids: np.ndarray, new: int) -> dict[str, np.ndarray]:
    """mlx-lm's model on the checkpoint (see the module doc): the prompt's logits in one call,
    then `new` greedy tokens decoded one at a time through its cache, with their logits."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.utils import load_model

    model, _ = load_model(ckpt, strict=True)  # mlx-lm's own sanitize maps every checkpoint name
    model_file = type(model).__module__.rsplit(".", 1)[-1]
    prefill = model(mx.array(ids)[None])  # the whole prompt in one call, no cache
    cache = model.make_cache()
    last = model(mx.array(ids)[None], cache=cache)[0, -1]
    generated, decode_logits = [], []
    for _ in range(new):  # greedy, one token a call through the cache
        token = int(mx.argmax(last).item())
        last = model(mx.array([[token]]), cache=cache)[0, -1]
        generated.append(token)
        decode_logits.append(np.array(last.astype(mx.float32)))
    return {
        "versions": np.array(versions(MLX_PACKAGES)),
        "source": np.array(f"mlx-lm {mlx_lm.__version__} models/{model_file}.py on mlx {mx.__version__}'s CPU, "
                           f"float32; loaded by mlx_lm.utils.load_model(strict=True)"),
        "ids": np.asarray(ids, np.int64),
        "logits": np.array(prefill[0].astype(mx.float32)),
        "generated": np.array(generated, np.int64),
        "decode_logits": np.stack(decode_logits),
    }


GOLDENS = {"kda": lambda waste: [make_kda_goldens()], "model": lambda waste: [make_model_goldens(waste)],
           "mlx": make_mlx_goldens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waste", default=str(ROOT / ".venv" / "bin" / "waste"),
                        help="the waste command that writes the tiny checkpoints")
    parser.add_argument("--goldens", nargs="+", choices=list(GOLDENS), default=list(GOLDENS),
                        help="which to write (kda and model need torch, mlx needs mlx-lm and model's checkpoint)")
    args = parser.parse_args()
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name in args.goldens:
        for path in GOLDENS[name](args.waste):
            print("wrote", path)


if __name__ == "__main__":
    main()
