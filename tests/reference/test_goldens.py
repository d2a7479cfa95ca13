"""The kernels, the float64 oracle and `waste run` against numbers from independent code.

tests/golden/ holds outputs of fla-core's naive KDA, of transformers' KimiLinearForCausalLM and
of mlx-lm's kimi_linear and kimi_k3 models (versions inside each file; `tools/make_goldens.py`
regenerates them where torch, fla-core and transformers, or mlx and mlx-lm, are installed). Agreement with the
oracle alone would not catch a misreading of the specification that the oracle and the kernels
share; these would. K3's is the only check of AttnRes, the latent MoE, SiTU, grouped routing and
MXFP4 decoding against code written by others.

Tolerances (u = 2**-24, float32's unit roundoff; relative to the golden's largest element):
- KDA: fla's naive recurrence runs in float32, so it is itself about as far from the exact
  result as our kernels: each within the random-walk bound of tests/kernels/test_kda_decays.py,
  4 u sqrt(T) (3.8e-6 at T = 256), hence 8 u sqrt(T) between a kernel and fla, and 4 u sqrt(T)
  between the float64 oracle and fla.
- Model: transformers or mlx-lm runs the tiny model in float32 through 5 layers; the float64
  oracle is held to ORACLE_GOLDEN_RTOL relative L2 from it (twice the golden's own rounding,
  which the oracle measures), the f32 engine, which rounds too, to ENGINE_GOLDEN_RTOL, as are
  two float32 implementations to each other (waste/analysis/goldens.py says how they were set).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import max_abs_diff

from waste.analysis.goldens import ENGINE_GOLDEN_RTOL, ORACLE_GOLDEN_RTOL
from waste.cli import main
from waste.container import open_container
from waste.kernels.kda import recurrent_kda
from waste.kernels.kda_chunk import chunk_kda
from waste.kernels.kda_decode import kda_decode_step
from waste.reference.kda import naive_recurrent_kda
from waste.reference.model import ReferenceModel

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
# k3-tiny as the preset has it, and with the forms it leaves out (tools/make_goldens.K3_VARIANT:
# the latent MoE's norm, SiTU's null beta and linear beta, blocks of 3, a plain MLA query without
# output gate, AttnRes tensors in the dotted spelling).
K3_CASES = ("k3_tiny", "k3_tiny_variant")
UNIT_ROUNDOFF = 2.0**-24


def _golden(name: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN / name) as f:
        return {k: f[k] for k in f.files}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def test_goldens_record_their_versions() -> None:
    torch_side = {"torch", "transformers", "fla-core", "python"}
    for name, packages in (("kda_fla_naive.npz", torch_side), ("kimi_linear_tiny.npz", torch_side),
                           *((f"{case}_mlx.npz", {"mlx", "mlx-lm", "python"})
                             for case in (*K3_CASES, "kimi_linear_tiny"))):
        versions = json.loads(str(_golden(name)["versions"]))
        assert packages <= set(versions), name
        assert all(versions.values()), name


@pytest.mark.parametrize("decays", ["fla_default", "weak", "floor"])
def test_kda_kernels_and_oracle_match_fla_naive(decays: str) -> None:
    g = _golden("kda_fla_naive.npz")
    x = {n: g[f"{decays}/{n}"] for n in ("q", "k", "v", "g", "beta")}
    s0 = g[f"{decays}/initial_state"]
    o_fla, s_fla = g[f"{decays}/o_recurrent"], g[f"{decays}/state_recurrent"]
    T = x["q"].shape[0]
    o_scale, s_scale = np.max(np.abs(o_fla)), np.max(np.abs(s_fla))
    # fla's own two forms agree (the golden file is what it claims to be)
    assert max_abs_diff(g[f"{decays}/o_chunk"], o_fla) <= 8 * UNIT_ROUNDOFF * np.sqrt(T) * o_scale

    results = {"oracle": naive_recurrent_kda(**x, initial_state=s0),
               "recurrent_kda": recurrent_kda(**x, initial_state=s0),
               "chunk_kda": chunk_kda(**x, initial_state=s0)}
    state = s0.copy()
    o = np.full(x["v"].shape, np.nan, np.float32)
    for t in range(T):
        o[t] = kda_decode_step(*(x[n][t] for n in ("q", "k", "v", "g", "beta")), state)
    results["kda_decode_step"] = (o, state)
    for name, (o, s) in results.items():
        rtol = (4 if name == "oracle" else 8) * UNIT_ROUNDOFF * np.sqrt(T)
        o_err, s_err = max_abs_diff(o, o_fla) / o_scale, max_abs_diff(s, s_fla) / s_scale
        assert o_err <= rtol and s_err <= rtol, f"{name}, {decays}: output {o_err:.2e}, state {s_err:.2e}"


@pytest.fixture(scope="module")
def golden_container(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("golden") / "kimi_linear_tiny.waste"
    assert main(["convert", str(GOLDEN / "kimi_linear_tiny"), str(out), "--quant", "f32", "--quiet"]) == 0
    return out


def test_oracle_matches_transformers_kimi_linear(golden_container: Path) -> None:
    g = _golden("kimi_linear_tiny.npz")
    with open_container(golden_container) as c:
        ref = ReferenceModel(c).forward(g["ids"])
        layers = c.config.num_layers
    assert _rel(ref.logits, g["logits"]) <= ORACLE_GOLDEN_RTOL
    # transformers' hidden_states: the embedding, then each layer's output; its last entry has
    # the final norm applied, so that one is left to the logits.
    for i in range(layers):
        assert _rel(ref.hidden_states[i], g["hidden_states"][i]) <= ORACLE_GOLDEN_RTOL, f"hidden state {i}"


def test_waste_run_matches_transformers_kimi_linear(golden_container: Path, tmp_path: Path) -> None:
    g = _golden("kimi_linear_tiny.npz")
    ids = ",".join(str(int(t)) for t in g["ids"])
    logits = tmp_path / "logits.npy"
    assert main(["run", str(golden_container), "--prompt-ids", ids, "--max-new", "1",
                 "--logits-out", str(logits)]) == 0
    engine = np.load(logits)[: len(g["ids"])]
    assert _rel(engine, g["logits"]) <= ENGINE_GOLDEN_RTOL


def _run_against_mlx(container: Path, g: dict[str, np.ndarray], tmp_path: Path) -> None:
    """`waste run` greedy on the golden's prompt: its logits, then the same tokens as mlx-lm's
    decode through its cache, with the same logits at each step."""
    ids, generated = g["ids"], g["generated"]
    logits = tmp_path / "logits.npy"
    assert main(["run", str(container), "--prompt-ids", ",".join(str(int(t)) for t in ids),
                 "--max-new", str(len(generated)), "--temperature", "0", "--logits-out", str(logits)]) == 0
    engine = np.load(logits)
    assert engine.shape == (len(ids) + len(generated), g["logits"].shape[1])
    assert _rel(engine[: len(ids)], g["logits"]) <= ENGINE_GOLDEN_RTOL
    # Row len(ids) - 1 + i chose generated token i; row len(ids) + i is the step that read it.
    np.testing.assert_array_equal(engine[len(ids) - 1: -1].argmax(axis=1), generated)
    assert _rel(engine[len(ids):], g["decode_logits"]) <= ENGINE_GOLDEN_RTOL


def test_mlx_lm_and_transformers_agree_on_kimi_linear() -> None:
    """The two independent Kimi-Linear goldens agree where their prompts do (mlx-lm's is longer and
    begins with transformers'; each position reads only those before it)."""
    mlx, hf = _golden("kimi_linear_tiny_mlx.npz"), _golden("kimi_linear_tiny.npz")
    n = len(hf["ids"])
    np.testing.assert_array_equal(mlx["ids"][:n], hf["ids"])
    assert len(mlx["ids"]) > 64 > n  # past MLA prefill's first key block
    assert _rel(mlx["logits"][:n], hf["logits"]) <= ENGINE_GOLDEN_RTOL


def test_waste_run_decodes_as_mlx_lm_kimi_linear(golden_container: Path, tmp_path: Path) -> None:
    """Kimi-Linear's decode (KDA's recurrent step, MLA's absorbed form) against mlx-lm's, which
    transformers' golden (a prompt in one call) does not reach."""
    _run_against_mlx(golden_container, _golden("kimi_linear_tiny_mlx.npz"), tmp_path)


@pytest.fixture(scope="module", params=K3_CASES)
def k3_case(request, tmp_path_factory) -> tuple[str, dict[str, Path]]:
    """A K3 golden checkpoint converted with an f32 trunk: "mxfp4" keeps its MXFP4 experts (the
    default; the oracle reads them exactly, the engine's products round their inputs to int8),
    "f32" stores the experts' exact values as float32, for the engine to be held to float32."""
    case = request.param
    out = {}
    for experts in ("mxfp4", "f32"):
        out[experts] = tmp_path_factory.mktemp("k3golden") / f"{case}_{experts}.waste"
        assert main(["convert", str(GOLDEN / case), str(out[experts]), "--quant", "f32", "--experts", experts,
                     "--quiet"]) == 0
    return case, out


def test_oracle_matches_mlx_lm_kimi_k3(k3_case: tuple[str, dict[str, Path]]) -> None:
    """The float64 oracle's K3 (reading the MXFP4 experts or their f32 copy) gives mlx-lm's logits."""
    case, k3_containers = k3_case
    g = _golden(f"{case}_mlx.npz")
    for experts, path in k3_containers.items():
        with open_container(path) as c:
            assert c.expert_storage == experts
            ref = ReferenceModel(c).forward(g["ids"])
        assert _rel(ref.logits, g["logits"]) <= ORACLE_GOLDEN_RTOL, experts


def test_waste_run_matches_mlx_lm_kimi_k3(k3_case: tuple[str, dict[str, Path]], tmp_path: Path) -> None:
    """`waste run` on K3 (f32 trunk and experts) against mlx-lm's prompt and decode."""
    case, k3_containers = k3_case
    _run_against_mlx(k3_containers["f32"], _golden(f"{case}_mlx.npz"), tmp_path)
