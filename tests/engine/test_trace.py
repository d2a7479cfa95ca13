"""Routing traces: recording (step inference in both prefill orders), the request grouping,
save/load round trip, and refusal of damaged or unknown files."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

from waste.engine import trace as tr
from waste.engine.trace import TRACE_VERSION, Trace, TraceRecorder, expand_hits, load
from waste.errors import WasteError


def _record_run(order: str, rng) -> tuple[TraceRecorder, list[tuple[int, int, list[int]]]]:
    """Prompt of 5 tokens in chunks of 3 then 2 decode tokens over MoE layers 1 and 3;
    `order` is "token" (chunk through all layers) or "layer" (all chunks of a layer)."""
    rec = TraceRecorder(4, [1, 3], 2, num_experts=6, metadata={"run": order})
    chunks = [(0, 3), (3, 5)]
    calls = []
    if order == "token":
        calls += [(a, b, lay, "prefill") for a, b in chunks for lay in (1, 3)]
    else:
        calls += [(a, b, lay, "prefill") for lay in (1, 3) for a, b in chunks]
    calls += [(t, t + 1, lay, "decode") for t in (5, 6) for lay in (1, 3)]
    expected_steps = []
    for a, b, lay, phase in calls:
        t = b - a
        ids = np.stack([rng.choice(6, 2, replace=False) for _ in range(t)])
        w = rng.random((t, 2)).astype(np.float32)
        hits = rng.random((t, 2)) < 0.5
        rec.record(lay, np.arange(a, b), phase, ids, w, hits)
        step = {(0, 3): 0, (3, 5): 1, (5, 6): 2, (6, 7): 3}[(a, b)]
        expected_steps.append((step, lay, sorted(set(ids.ravel().tolist()))))
    return rec, expected_steps


@pytest.mark.parametrize("order", ["token", "layer"])
def test_record_save_load_round_trip(tmp_path, order):
    rng = np.random.default_rng(0)
    rec, expected = _record_run(order, rng)
    path = tmp_path / "sub" / "t.npz"
    rec.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["t.npz"]
    t = load(path)
    ref = rec.trace()
    for name in ("position", "layer", "phase", "step", "ids", "weights", "hit"):
        np.testing.assert_array_equal(getattr(t, name), getattr(ref, name))
    assert (t.num_layers, t.moe_layers, t.top_k, t.num_experts) == (4, (1, 3), 2, 6)
    assert t.metadata == {"run": order}
    assert t.phase.tolist() == [0] * 10 + [1] * 4
    # Steps: the two chunks are steps 0 and 1 whichever order the layers ran in, decode tokens 2 and 3.
    req = t.requests()
    got = [(int(req.step[r]), int(req.layer[r]), req.ids[req.start[r]:req.start[r + 1]].tolist())
           for r in range(len(req))]
    assert got == expected


def test_requests_group_rows_and_take_hits():
    # One prefill chunk of two tokens in layer 2, then one decode token in layer 2.
    t = Trace.from_arrays(
        [[3, 1], [1, 2], [0, 3]],
        layer=2,
        phase=np.array([0, 0, 1]),
        step=np.array([0, 0, 1]),
        hit=np.array([[True, False], [False, True], [False, True]]),
        num_experts=4,
    )
    req = t.requests()
    assert req.start.tolist() == [0, 3, 5]
    assert req.ids.tolist() == [1, 2, 3, 0, 3]
    assert req.hit.tolist() == [False, True, True, False, True]
    assert req.phase.tolist() == [0, 1] and req.layer.tolist() == [2, 2]
    assert req.lookup_layer.tolist() == [2] * 5


def test_from_arrays_defaults_and_selection():
    t = Trace.from_arrays(np.array([0, 1, 2, 0]), layer=np.array([1, 2, 1, 2]))
    assert t.top_k == 1 and t.num_experts == 3 and t.moe_layers == (1, 2) and t.num_layers == 3
    assert t.step.tolist() == [0, 1, 2, 3] and t.phase.tolist() == [1] * 4
    np.testing.assert_allclose(t.weights, 1.0)
    assert t.per_layer(2).ids.ravel().tolist() == [1, 0]
    assert len(t.select_phase("prefill")) == 0
    with pytest.raises(WasteError, match="not a MoE layer"):
        t.per_layer(0)


def test_synthetic_trace_is_well_formed():
    t = Trace.synthetic(prompt=40, decode=5, moe_layers=[1, 2, 4], num_experts=16, top_k=4, chunk=16, seed=3)
    assert len(t) == 45 * 3
    assert (np.sort(t.ids, axis=1)[:, 1:] != np.sort(t.ids, axis=1)[:, :-1]).all()
    np.testing.assert_allclose(t.weights.sum(axis=1), 1.0, rtol=1e-6)
    assert (np.diff(t.weights, axis=1) <= 0).all()
    assert len(t.requests()) == (3 + 5) * 3
    assert t.step.max() == 7


def test_expand_hits():
    ids = np.array([[4, 1], [1, 9]])
    got = expand_hits(ids, np.array([1, 4, 9]), np.array([True, False, True]))
    assert got.tolist() == [[False, True], [True, True]]
    with pytest.raises(WasteError):
        expand_hits(np.array([[2]]), np.array([1, 4]), np.array([True, False]))


def test_recorder_rejects_bad_rows():
    rec = TraceRecorder(3, [1, 2], 2)
    ok = (np.array([0]), "decode", np.array([[0, 1]]), np.array([[0.5, 0.5]]), np.array([[False, True]]))
    with pytest.raises(WasteError, match="not a MoE layer"):
        rec.record(0, *ok)
    with pytest.raises(WasteError, match="phase"):
        rec.record(1, ok[0], "decoding", *ok[2:])
    with pytest.raises(WasteError, match="shape"):
        rec.record(1, ok[0], "decode", np.array([[0, 1, 2]]), *ok[3:])
    rec.record(1, *ok)
    rec.record(1, *ok)  # same position again in the same layer: a new step
    assert rec.trace().step.tolist() == [0, 1]
    rec.record(2, *ok, step=7)
    assert rec.trace().step.tolist() == [0, 1, 7]


def test_contiguity_and_range_checks():
    with pytest.raises(WasteError, match="contiguous"):
        Trace.from_arrays([[0], [1], [2]], layer=np.array([1, 2, 1]), step=np.array([0, 0, 0]))
    with pytest.raises(WasteError, match="expert ids"):
        Trace.from_arrays([[0], [5]], num_experts=4)
    with pytest.raises(WasteError, match="layer"):
        Trace.from_arrays([[0]], layer=3, moe_layers=[1, 2])


def _saved(tmp_path):
    path = tmp_path / "t.npz"
    Trace.synthetic(prompt=8, decode=2, moe_layers=[1], num_experts=4, top_k=2, chunk=4).save(path)
    return path


def _rewrite(path, **changes):
    with np.load(path) as z:
        data = {k: z[k] for k in z.files}
    for k, v in changes.items():
        if v is None:
            del data[k]
        else:
            data[k] = v
    np.savez(path, **data)


def test_load_refuses_damaged_and_unknown_files(tmp_path):
    path = _saved(tmp_path)
    raw = path.read_bytes()

    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(WasteError, match="not a readable"):
        load(path)

    np.save(tmp_path / "one.npy", np.zeros(3))  # a lone array, not an archive
    with pytest.raises(WasteError, match="a single .npy array, not the .npz archive"):
        load(tmp_path / "one.npy")
    with pytest.raises(WasteError, match="is a directory"):
        load(tmp_path)
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(WasteError, match=r"not a readable \.npz archive, as waste run --trace-out writes"):
        load(tmp_path / "text.npz")

    path.write_bytes(raw)
    _rewrite(path, version=np.array(TRACE_VERSION + 1))
    with pytest.raises(WasteError, match="version 2 is not supported"):
        load(path)

    path.write_bytes(raw)
    _rewrite(path, format=np.array("something-else"))
    with pytest.raises(WasteError, match="not a waste routing trace"):
        load(path)

    path.write_bytes(raw)
    _rewrite(path, hit=None)
    with pytest.raises(WasteError, match="missing arrays hit"):
        load(path)

    path.write_bytes(raw)
    _rewrite(path, weights=np.zeros((3, 2), np.float32))
    with pytest.raises(WasteError, match="weights"):
        load(path)

    path.write_bytes(raw)
    _rewrite(path, config=np.array("{not json"))
    with pytest.raises(WasteError, match="damaged header"):
        load(path)

    path.write_bytes(b"not a zip file at all")
    with pytest.raises(WasteError, match="not a readable"):
        load(path)
    with pytest.raises(WasteError, match="no such file"):
        load(tmp_path / "absent.npz")


def test_load_refuses_a_corrupted_member(tmp_path):
    path = _saved(tmp_path)
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("ids.npy")
    raw = bytearray(path.read_bytes())
    # Flip bytes inside the compressed member's data (after its local header, whose name and
    # extra-field lengths sit at bytes 26..30); its CRC no longer matches.
    h = info.header_offset
    start = h + 30 + int.from_bytes(raw[h + 26:h + 28], "little") + int.from_bytes(raw[h + 28:h + 30], "little")
    for i in range(start, start + min(8, info.compress_size)):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(WasteError, match="not a readable"):
        load(path)


def test_save_is_atomic_on_failure(tmp_path, monkeypatch):
    path = _saved(tmp_path)
    before = path.read_bytes()

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tr.np, "savez_compressed", boom)
    with pytest.raises(RuntimeError):
        Trace.from_arrays([[1]]).save(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.npz"]
