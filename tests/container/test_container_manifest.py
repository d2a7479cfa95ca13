"""Property tests: no input makes the manifest parser fail with anything but ContainerError."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from waste.container.format import ContainerError
from waste.container.manifest import Manifest, parse_manifest
from waste.testing import tiny_container

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
SETTINGS = settings(max_examples=int(os.environ.get("WASTE_HYPOTHESIS_EXAMPLES", 150)), deadline=None,
                    derandomize="WASTE_HYPOTHESIS_EXAMPLES" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A valid manifest (f32 tiny with a factorised MLA query and expert groups) as a JSON document."""
    out = tiny_container(tmp_path_factory, overrides={"q_lora_rank": 16, "num_expert_group": 2, "topk_group": 1})
    return json.loads((out / "manifest.json").read_text())


def paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Paths (tuples of keys / indices) to the nodes of a JSON document; long lists by their ends."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i in sorted({0, 1, 2, len(doc) - 2, len(doc) - 1} & set(range(len(doc)))):
            out += paths(doc[i], (*prefix, i))
    return out


def parse_or_container_error(data: bytes) -> Manifest | None:
    try:
        return parse_manifest(data)
    except ContainerError as e:
        assert str(e) and "\n" not in str(e)
        return None


def test_the_valid_manifest_parses(valid: dict[str, Any]) -> None:
    m = parse_manifest(json.dumps(valid).encode())
    assert m.scheme == "f32" and m.config.q_lora_rank == 16


@SETTINGS
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes(data: bytes) -> None:
    parse_or_container_error(data)


@SETTINGS
@given(doc=JSON)
def test_arbitrary_json(doc: Any) -> None:
    parse_or_container_error(json.dumps(doc).encode())


def mutate(doc: Any, path: tuple, data: st.DataObject) -> None:
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    action = data.draw(st.sampled_from(["replace", "delete", "int"]))
    if action == "delete":
        del parent[path[-1]]
    elif action == "int":
        parent[path[-1]] = data.draw(st.integers(min_value=-(2**70), max_value=2**70))
    else:
        parent[path[-1]] = data.draw(JSON)


@SETTINGS
@given(data=st.data())
def test_one_node_of_a_valid_manifest_replaced(valid: dict[str, Any], data: st.DataObject) -> None:
    doc = copy.deepcopy(valid)
    mutate(doc, data.draw(st.sampled_from(paths(doc)[1:])), data)
    parse_or_container_error(json.dumps(doc).encode())


@SETTINGS
@given(data=st.data())
def test_one_config_value_replaced(valid: dict[str, Any], data: st.DataObject) -> None:
    doc = copy.deepcopy(valid)
    mutate(doc, data.draw(st.sampled_from(paths(doc["config"], ("config",))[1:])), data)
    parse_or_container_error(json.dumps(doc).encode())


@pytest.mark.parametrize(("key", "value"), [("rms_norm_eps", 10**400), ("num_hidden_layers", 10**9),
                                            ("num_hidden_layers", 2**70), ("vocab_size", 2**62 - 1),
                                            ("num_experts", 10**12), ("hidden_size", 10**15)])
def test_absurd_config_numbers(valid: dict[str, Any], key: str, value: int) -> None:
    doc = copy.deepcopy(valid)
    doc["config"][key] = value
    with pytest.raises(ContainerError):
        parse_manifest(json.dumps(doc).encode())


@SETTINGS
@given(data=st.data())
def test_valid_manifest_cut_or_corrupted(valid: dict[str, Any], data: st.DataObject) -> None:
    raw = bytearray(json.dumps(valid).encode())
    cut = data.draw(st.integers(0, len(raw)))
    pos = data.draw(st.integers(0, len(raw) - 1))
    raw[pos] = data.draw(st.integers(0, 255))
    parse_or_container_error(bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw))


@pytest.mark.parametrize("text", ["[" * 100_000, '{"magic": "WASTE-CONTAINER", "format_version": 1e999}', "\xff"])
def test_pathological_inputs(text: str) -> None:
    with pytest.raises(ContainerError):
        parse_manifest(text.encode("latin-1"))
