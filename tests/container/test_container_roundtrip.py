"""Synthesise -> convert -> read back: exact for f32, within the formats' error for q8 / q4."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from waste.config import parse_config
from waste.container import open_container
from waste.container.convert import convert
from waste.container.format import (
    BLOB_ALIGN,
    EXPERT_PARTS,
    TRUNK_ALIGN,
    ContainerError,
    expected_tensors,
    expert_name,
    is_matrix,
)
from waste.synth import synthesize
from waste.testing import load_checkpoint, tiny_checkpoint, tiny_config, tiny_container

VARIANTS = {
    "plain": {},
    "lower_bound_gate": {"linear_attn_config": {"gate_lower_bound": -5.0}},
    "full_rank_gate": {"linear_attn_config": {"use_full_rank_gate": True}},
    "q_lora": {"q_lora_rank": 16},
    "mla_output_gate": {"mla_use_output_gate": True},
    "expert_groups": {"num_expert_group": 4, "topk_group": 2},
    "tied_no_shared": {"tie_word_embeddings": True, "num_shared_experts": 0},
    "all_dense": {"first_k_dense_replace": 5},
}


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def assert_exact(container: Path, source: dict[str, np.ndarray]) -> None:
    with open_container(container) as c:
        cfg = c.config
        assert c.scheme == "f32"
        assert set(c.names()) == set(expected_tensors(cfg))
        for name in c.names():
            ref = source[name]
            got = c.matrix(name).dequantize() if is_matrix(name, ref.shape) else c.tensor(name)
            assert got.shape == ref.shape, name
            assert np.array_equal(bits(got), bits(ref)), name
        for layer in cfg.moe_layers:
            for e in range(cfg.num_experts):
                for part, m in zip(EXPERT_PARTS, c.expert(layer, e), strict=True):
                    assert np.array_equal(bits(m.dequantize()), bits(source[expert_name(layer, e, part)]))
        n_experts = sum(1 for n in source if ".experts." in n)
        assert len(c.names()) + n_experts == len(source)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_f32_round_trip_is_bit_exact(tmp_path: Path, dtype: str) -> None:
    hf = synthesize("tiny", tmp_path / "hf", seed=3, dtype=dtype, shard_bytes=300_000)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "sharding must be exercised"
    out = convert(hf, tmp_path / "tiny.waste", quant="f32", progress=False)
    assert_exact(out, load_checkpoint(hf))
    with open_container(out) as c:
        c.verify()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_round_trip(tmp_path_factory: pytest.TempPathFactory, variant: str) -> None:
    out = tiny_container(tmp_path_factory, quant="f32", dtype="bf16", overrides=VARIANTS[variant])
    assert_exact(out, load_checkpoint(tiny_checkpoint(out)))
    with open_container(out) as c:
        assert c.config == parse_config(tiny_config(**VARIANTS[variant]))


def test_layout_alignment_and_zero_copy(tmp_path_factory: pytest.TempPathFactory) -> None:
    out = tiny_container(tmp_path_factory)
    with open_container(out) as c:
        for name in c.names():
            e = c.entry(name)
            assert e.offset % TRUNK_ALIGN == 0
            for b in e.buffers:
                assert (e.offset + b.offset) % TRUNK_ALIGN == 0
        t = c.tensor("model.norm.weight")
        assert not t.flags.writeable and t.dtype == np.float32
        layer = c.config.moe_layers[-1]
        offset, nbytes = c.expert_span(layer, 5)
        assert offset % BLOB_ALIGN == 0 and nbytes % BLOB_ALIGN == 0
        assert nbytes == c.byte_counts()["expert_blob_bytes"]
        fd = os.open(c.experts_path, os.O_RDONLY)
        try:
            buf = np.frombuffer(os.pread(fd, nbytes, offset), np.uint8)
        finally:
            os.close(fd)
        for a, b in zip(c.decode_expert(layer, buf), c.expert(layer, 5), strict=True):
            assert a.shape == b.shape and np.array_equal(a.dequantize(), b.dequantize())
        w1 = c.expert(layer, 5)[0].buffers["w"]
        assert not w1.flags.writeable and w1.base is not None  # a view over the map, not a copy


def test_trunk_held_in_memory_serves_the_same_bytes_from_a_copy(tmp_path_factory: pytest.TempPathFactory) -> None:
    """hold_trunk_in_memory: the views taken afterwards read a read-only copy in anonymous
    memory (2 MiB aligned, for huge pages) with the file's bytes; those taken before keep the
    map; the trunk's mapped pages are dropped from the process (its RSS holds the trunk once);
    a second call changes nothing."""
    from waste.engine.memory import mapped_rss

    out = tiny_container(tmp_path_factory)
    with open_container(out) as c:
        before = {n: c.tensor(n) for n in c.names() if c.entry(n).storage == "f32"}
        mapped_before = {n: np.array(t) for n, t in before.items()}
        assert c.trunk_in_memory == 0
        c.hold_trunk_in_memory()
        size = (out / "trunk.bin").stat().st_size
        assert c.trunk_in_memory == size
        trunk = c._trunk
        assert trunk.ctypes.data % (2 << 20) == 0 and not trunk.flags.writeable
        assert np.array_equal(trunk, np.fromfile(out / "trunk.bin", np.uint8))
        trunk_fd = c.data_fds()[0]
        assert mapped_rss([trunk_fd]) == 0
        for n, t in before.items():
            after = c.tensor(n)
            assert np.array_equal(after, mapped_before[n]) and np.array_equal(t, after)
            assert not after.flags.writeable and np.shares_memory(after, trunk) and not np.shares_memory(t, trunk)
        c.hold_trunk_in_memory()
        assert c._trunk is trunk


def test_experts_held_in_memory_serve_the_same_bytes_from_a_copy(tmp_path_factory: pytest.TempPathFactory) -> None:
    """hold_experts_in_memory: each expert asked for afterwards is read, on that first request,
    into read-only anonymous memory (2 MiB aligned, for huge pages) at its offset in experts.bin,
    and its views read the copy with the file's values; no page of the map is touched by it;
    experts not asked for are not copied; views taken before keep the map; a second call
    changes nothing."""
    from waste.engine.memory import mapped_rss

    out = tiny_container(tmp_path_factory)
    with open_container(out) as c:
        layer = c.config.moe_layers[0]
        before = c.expert(layer, 3)
        values = [m.dequantize() for m in before]
        assert not c.experts_in_memory
        c.hold_experts_in_memory()
        copy = c._expert_copy
        assert c.experts_in_memory and copy.ctypes.data % (2 << 20) == 0
        assert copy.nbytes == (out / "experts.bin").stat().st_size
        after = c.expert(layer, 3)
        offset, nbytes = c.expert_span(layer, 3)
        experts_bin = np.fromfile(out / "experts.bin", np.uint8)
        assert np.array_equal(copy[offset:offset + nbytes], experts_bin[offset:offset + nbytes])
        for m_before, m_after, v in zip(before, after, values, strict=True):
            assert np.array_equal(m_after.dequantize(), v)
            w = m_after.buffers["w"]
            assert not w.flags.writeable and np.shares_memory(w, copy)
            assert not np.shares_memory(m_before.buffers["w"], copy)
        other, other_bytes = c.expert_span(layer, 4)
        assert not copy[other:other + other_bytes].any()  # never asked for: never copied
        mapped = mapped_rss([c.data_fds()[1]])  # expert 3's pages, read through the map before
        for moe_layer in c.config.moe_layers:
            for e in range(c.config.num_experts):
                c.expert(moe_layer, e)
        assert mapped_rss([c.data_fds()[1]]) == mapped  # the copies were read, not mapped
        assert np.array_equal(copy, experts_bin)
        c.hold_experts_in_memory()
        assert c._expert_copy is copy
    assert c._expert_copy is None and c._expert_copy_read is None  # closed: the copy is let go


def test_mxfp4_experts_are_not_held_twice(tmp_path_factory: pytest.TempPathFactory) -> None:
    """MXFP4 experts are repacked into process memory when first used (QMatrix): holding them in
    memory as well would hold them twice, so hold_experts_in_memory leaves them on the map, and
    the map's pages of a repacked expert leave the process."""
    out = tiny_container(tmp_path_factory, preset="k3-tiny", overrides={"text_config": {"num_experts": 64}})
    with open_container(out) as c:
        assert c.expert_storage == "mxfp4"
        c.hold_experts_in_memory()
        assert not c.experts_in_memory and c._expert_copy is None
        w1 = c.expert(c.config.moe_layers[0], 0)[0]
        assert w1.fmt == "mxfp4" and np.shares_memory(w1.buffers["packed"], c._experts)  # the map's
        assert "_qargs" in vars(w1)  # repacked where the store decodes it, before its pages go
        from waste.engine.memory import mapped_rss

        for layer in c.config.moe_layers:
            for e in range(c.config.num_experts):
                c.expert(layer, e)
        # Each repacked expert's pages left the process; what may stay is the kernel's
        # fault-around (16 pages) of the last one's neighbours.
        assert (out / "experts.bin").stat().st_size > 8 * (64 << 10)
        assert mapped_rss([c.data_fds()[1]]) <= 64 << 10


def test_byte_counts_cover_the_trunk(tmp_path_factory: pytest.TempPathFactory) -> None:
    out = tiny_container(tmp_path_factory)
    with open_container(out) as c:
        counts = c.byte_counts()
        cfg = c.config
        assert counts["trunk_bytes"] == (out / "trunk.bin").stat().st_size
        assert counts["expert_bytes"] == (out / "experts.bin").stat().st_size
        assert counts["expert_bytes"] == len(cfg.moe_layers) * cfg.num_experts * counts["expert_blob_bytes"]
        assert sum(counts["per_class"].values()) == sum(c.entry(n).data_bytes for n in c.names())
        assert set(counts["per_class"]) == {"embedding", "lm_head", "kda", "mla", "dense_ffn", "shared_experts",
                                            "router", "norms"}
        assert counts["per_class"]["router"] == sum(
            4 * (cfg.num_experts * cfg.hidden_size + cfg.num_experts) for _ in cfg.moe_layers)


def test_conversion_is_deterministic_and_independent_of_sharding(tmp_path: Path) -> None:
    a = convert(synthesize("tiny", tmp_path / "a", seed=1, dtype="bf16"), tmp_path / "a.waste", quant="f32",
                progress=False)
    b = convert(synthesize("tiny", tmp_path / "b", seed=1, dtype="bf16", shard_bytes=100_000),
                tmp_path / "b.waste", quant="f32", progress=False)
    for f in ("trunk.bin", "experts.bin"):
        assert (a / f).read_bytes() == (b / f).read_bytes()
    with open_container(a) as ca, open_container(b) as cb:
        assert ca.manifest["tensors"] == cb.manifest["tensors"]


def test_dense_ffn_spelling_and_a_log_padding_are_accepted(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    hf = synthesize("tiny", tmp_path / "hf", dtype="f32")
    source = load_checkpoint(hf)
    renamed = {}
    for name, value in source.items():
        if name.startswith("model.layers.0.mlp."):
            name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith(".self_attn.A_log"):
            value = np.concatenate([value.reshape(-1), np.zeros(12, np.float32)])  # [K] zero-padded past H=4
        renamed[name] = value
    (hf / "model.safetensors.index.json").unlink()
    for f in hf.glob("*.safetensors"):
        f.unlink()
    save_file(renamed, str(hf / "model.safetensors"))
    out = convert(hf, tmp_path / "x.waste", quant="f32", progress=False)
    with open_container(out) as c:
        assert np.array_equal(c.matrix("model.layers.0.mlp.up_proj.weight").dequantize(),
                              source["model.layers.0.mlp.up_proj.weight"])
        a_log = c.tensor("model.layers.0.self_attn.A_log")
        assert a_log.shape == (16,) and np.array_equal(a_log[:4], source["model.layers.0.self_attn.A_log"].ravel())


def test_mxfp4_blob_interleaved_for_the_streaming_store(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A blob as read, repacked into a buffer of its size (`interleave_expert`), decodes to
    matrices that multiply as the map's do and hold no other copy; a store handing out blobs as
    stored is refused, as is a blob buffer of the wrong size."""
    out = tiny_container(tmp_path_factory, preset="k3-tiny")
    with open_container(out) as c:
        assert c.experts_interleaved_when_read
        layer = c.config.moe_layers[-1]
        offset, nbytes = c.expert_span(layer, 3)
        blob = np.array(c.experts_view(offset, nbytes))
        interleaved = np.zeros_like(blob)
        c.interleave_expert(blob, interleaved)
        rng = np.random.default_rng(4)
        for held, mapped in zip(c.decode_expert(layer, interleaved), c.expert(layer, 3), strict=True):
            assert set(held.buffers) == {"qs", "scales"} and np.shares_memory(held._qargs[0], interleaved)
            x = rng.standard_normal((3, mapped.shape[1])).astype(np.float32)
            np.testing.assert_array_equal(held.matmul(x), mapped.matmul(x))
            np.testing.assert_array_equal(held.dequantize(), mapped.dequantize())
        with pytest.raises(ContainerError, match="expert blob buffer must be uint8"):
            c.interleave_expert(blob, interleaved[:-1])
    f32 = tiny_container(tmp_path_factory)
    with open_container(f32) as c:
        assert not c.experts_interleaved_when_read
        buf = np.zeros(c.byte_counts()["expert_blob_bytes"], np.uint8)
        with pytest.raises(ContainerError, match="handed out as stored"):
            c.interleave_expert(buf, buf.copy())
