"""bf16 products (waste/kernels/bf16.py) against the float64 oracle, and their two code paths.

Tolerance: the kernels accumulate the exact bf16 products in float32 over K <= 200 inputs, so
they sit within 1e-6 of the float64 product of the same rounded operands (measured ~1e-7).
"""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import waste.reference.quant as ref
from waste.errors import WasteError
from waste.kernels import bf16, dense_batch
from waste.kernels.quant import quantize

SHAPES = [(37, 70, 9), (16, 32, 1), (4, 3, 5), (1, 33, 4), (9, 200, 1), (21, 64, 8), (19, 96, 6), (13, 64, 7)]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b)) / max(np.max(np.abs(b)), 1e-30))


def test_rounding_follows_vcvtneps2bf16() -> None:
    rng = np.random.default_rng(0)
    halfway = (rng.integers(0x00800000, 0x7F000000, 64, dtype=np.uint32) & ~np.uint32(0xFFFF)) | np.uint32(0x8000)
    special = np.array([0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001,
                        0x80000000, 0x3F808000, 0x3F818000], np.uint32)
    X = np.concatenate([halfway, special, rng.standard_normal(100).astype(np.float32).view(np.uint32)])
    X = X.view(np.float32).reshape(2, -1)
    got = bf16.round_to_bf16(X)  # [2, Kp]
    assert got.shape == (2, bf16.padded_inputs(X.shape[1])) and np.all(got[:, X.shape[1]:] == 0)
    got_values = (got[:, : X.shape[1]].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    want = ref.reference_round_to_bf16(X)
    np.testing.assert_array_equal(np.isnan(got_values), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got_values[finite], want[finite])
    np.testing.assert_array_equal(np.signbit(got_values[finite]), np.signbit(want[finite]))


@pytest.mark.parametrize("native", [True, False])
def test_chunk_operands_round_on_all_cores_as_on_one(native: bool) -> None:
    """From PARALLEL_ROUNDING_ROWS rows an operand is rounded row by row on all cores: the bits
    of the serial kernels, specials and subnormals included."""
    rng = np.random.default_rng(6)
    T = bf16.PARALLEL_ROUNDING_ROWS + 5
    X = (rng.standard_normal((T, 77)) * 2.0 ** rng.integers(-140, 100, (T, 77))).astype(np.float32)
    X[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    got = bf16.bf16_operand(X, native=native)
    want = np.empty_like(got)
    (bf16._round_rows if native else bf16._round_split)(X, want)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize(("N", "K", "T"), SHAPES)
def test_product_matches_reference(N: int, K: int, T: int) -> None:
    rng = np.random.default_rng(N * 1000 + K + T)
    w = (rng.standard_normal((N, K)) * rng.uniform(0.01, 3.0, (N, 1))).astype(np.float32)
    X = (rng.standard_normal((T, K)) * rng.uniform(0.1, 10.0, (T, 1))).astype(np.float32)
    m = quantize(w, "bf16")
    Y = m.matmul(X)
    assert Y.shape == (T, N) and Y.dtype == np.float32
    assert _rel(Y, ref.reference_matmul(m, X)) <= 1e-6
    for t in range(T):
        # One token and a chunk run the same sequence of float32 operations: bit-identical.
        np.testing.assert_array_equal(m.matvec(X[t]), Y[t])


def _vdpbf16ps_sequence(w_bits: np.ndarray, x_bits: np.ndarray) -> np.ndarray:
    """The documented operation order in NumPy float32, from the Intel SDM's pseudocode of
    vdpbf16ps: per lane i of 16, per block of 32 inputs, lane += odd product, then += even
    product; then lanes summed i + 8, + 4, + 2, + 1. w_bits [N, K], x_bits [T, K] uint16."""
    n, k = w_bits.shape
    kp = -(-k // 32) * 32
    w = np.zeros((n, kp), np.float32)
    x = np.zeros((x_bits.shape[0], kp), np.float32)
    w[:, :k] = (w_bits.astype(np.uint32) << 16).view(np.float32)
    x[:, :k] = (x_bits.astype(np.uint32) << 16).view(np.float32)
    acc = np.zeros((x.shape[0], n, 16), np.float32)  # [T, N, lanes]
    for j in range(0, kp, 32):
        for parity in (1, 0):
            acc = acc + x[:, None, j + parity:j + 32:2] * w[None, :, j + parity:j + 32:2]
    for half in (8, 4, 2, 1):
        acc = acc[..., :half] + acc[..., half:2 * half]
    return acc[..., 0]


@pytest.mark.parametrize(("N", "K", "T"), [(13, 100, 6), (8, 64, 1), (5, 7, 3)])
def test_portable_path_is_the_vdpbf16ps_sequence(N: int, K: int, T: int) -> None:
    # Bit for bit: this is what makes it agree with the instruction on hosts that have it.
    rng = np.random.default_rng(K + T)
    w = (rng.standard_normal((N, K)) * 10.0 ** rng.uniform(-3, 3, (N, 1))).astype(ml_dtypes.bfloat16).view(np.uint16)
    X = (rng.standard_normal((T, K)) * 10.0 ** rng.uniform(-3, 3, (T, 1))).astype(np.float32)
    got = bf16.bf16_matmul(w, X, native=False)
    want = _vdpbf16ps_sequence(w, bf16.round_to_bf16(X)[:, :K])
    np.testing.assert_array_equal(got, want)


def _flushing_sequence(w_bits: np.ndarray, x_bits: np.ndarray) -> np.ndarray:
    """_vdpbf16ps_sequence with the instruction's flushes: operands below 2^-126 read as zeros of
    their sign, each lane's sum after a product flushed to a signed zero when below 2^-126 (the
    product is exact, the sum rounded once: long double holds both here); the tree as before."""
    tiny = np.float32(2.0 ** -126)

    def flushed(v: np.ndarray) -> np.ndarray:
        return np.where(np.abs(v) < tiny, np.copysign(np.float32(0), v), v).astype(np.float32)

    n, k = w_bits.shape
    kp = -(-k // 32) * 32
    w = np.zeros((n, kp), np.float32)
    x = np.zeros((x_bits.shape[0], kp), np.float32)
    w[:, :k] = flushed((w_bits.astype(np.uint32) << 16).view(np.float32))
    x[:, :k] = flushed((x_bits.astype(np.uint32) << 16).view(np.float32))
    acc = np.zeros((x.shape[0], n, 16), np.float32)
    for j in range(0, kp, 32):
        for parity in (1, 0):
            exact = (acc.astype(np.longdouble) + x[:, None, j + parity:j + 32:2].astype(np.longdouble)
                     * w[None, :, j + parity:j + 32:2].astype(np.longdouble))
            acc = flushed(exact.astype(np.float32))
    for half in (8, 4, 2, 1):
        acc = acc[..., :half] + acc[..., half:2 * half]
    return acc[..., 0]


def test_portable_path_flushes_subnormals_as_vdpbf16ps_does() -> None:
    """Operands and sums around float32's smallest normal: vdpbf16ps reads bf16 subnormals as
    zeros and flushes sums that fall below 2^-126; the portable path's FMAs run with MXCSR's
    FTZ and DAZ for that, so both paths (the instruction where the host has it) give the same
    bits, which the plain float32 sequence does not."""
    assert np.finfo(np.longdouble).nmant >= 63  # the emulation's exact sums (x86's long double)
    rng = np.random.default_rng(4)
    N, K, T = 24, 200, 7
    w = ((rng.integers(0, 2, (N, K)) << 15) | (rng.integers(60, 76, (N, K)) << 7)
         | rng.integers(0, 128, (N, K))).astype(np.uint16)  # 2^-67 .. 2^-52
    w[rng.random((N, K)) < 0.1] &= 0x807F  # bf16 subnormals
    X = (rng.standard_normal((T, K)) * 2.0 ** rng.integers(-70, -59, (T, K))).astype(np.float32)
    got = bf16.bf16_matmul(w, X, native=False)
    x_bits = bf16.round_to_bf16(X)[:, :K]
    np.testing.assert_array_equal(got, _flushing_sequence(w, x_bits))
    assert not np.array_equal(got, _vdpbf16ps_sequence(w, x_bits))  # the data does underflow
    for t in range(T):  # one token (the rows tiles) as the chunk
        np.testing.assert_array_equal(bf16.bf16_matmul(w, X[t:t + 1], native=False)[0], got[t])
    if bf16.NATIVE:
        np.testing.assert_array_equal(bf16.bf16_matmul(w, X, native=True), got)


def test_nan_and_inf_reach_their_outputs() -> None:
    rng = np.random.default_rng(5)
    m = quantize(rng.standard_normal((8, 64)).astype(np.float32), "bf16")
    X = rng.standard_normal((5, 64)).astype(np.float32)
    X[1, 3], X[3, 40] = np.nan, np.inf
    Y = m.matmul(X)
    assert np.all(np.isnan(Y[1])) and not np.any(np.isfinite(Y[3]))
    assert np.all(np.isfinite(Y[[0, 2, 4]]))


def test_bf16_checkpoint_values_are_stored_exactly() -> None:
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 1 << 16, (33, 70), dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] = 0  # no NaN or inf in a checkpoint
    values = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(quantize(values, "bf16").buffers["w"], bits)


def test_native_path_compiles_to_vdpbf16ps_and_agrees_with_the_portable_one(tmp_path) -> None:  # noqa: ANN001
    # Where the host has AVX512_BF16, both paths run on the same inputs and must agree bit for
    # bit. Everywhere, the vdpbf16ps path is compiled for a CPU that has it (Sapphire Rapids) in
    # a subprocess and its machine code must contain the instruction.
    rng = np.random.default_rng(9)
    w = rng.standard_normal((37, 100)).astype(ml_dtypes.bfloat16).view(np.uint16)
    X = rng.standard_normal((9, 100)).astype(np.float32)
    portable = bf16.bf16_matmul(w, X, native=False)
    if bf16.NATIVE:
        np.testing.assert_array_equal(bf16.bf16_matmul(w, X, native=True), portable)
    code = (
        "import numpy as np; from waste.kernels import bf16; "
        "bf16._row_block.compile('(uint16[:, ::1], uint16[:, ::1], float32[:, ::1], intp, intp, "
        "uint16[:, ::1], intp, intp)'); "
        "sig = bf16._row_block.signatures[0]; "
        "print('vdpbf16ps' in bf16._row_block.inspect_asm(sig))"
    )
    # (a fresh cache directory: code loaded from a cache cannot be inspected)
    features = "+avx2,+fma,+f16c,+bmi2,+avx512f,+avx512bw,+avx512vl,+avx512dq,+avx512bf16"
    env = {**os.environ, "NUMBA_CPU_NAME": "sapphirerapids", "NUMBA_CPU_FEATURES": features,
           "NUMBA_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"


@pytest.mark.skipif(not bf16.NATIVE, reason="the vdpbf16ps tiles compile only where the host has AVX512_BF16")
def test_a_new_caller_links_cached_vdpbf16ps_tiles(tmp_path) -> None:  # noqa: ANN001
    """A kernel compiled in a process whose bf16 tiles come from Numba's cache links their IR,
    inline assembly included, again: that needs the asm parser, which the tiles' own codegen no
    longer initialises there (LLVM aborted the process: "Inline asm not supported by this
    streamer"). The first process fills a cache; the second compiles a new caller of the tiles."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    fill = ("import numpy as np; from waste.kernels import bf16; "
            "bf16.bf16_matmul(np.ones((8, 64), np.uint16), np.ones((1, 64), np.float32))")
    caller = (
        "import numpy as np, numba; from waste.kernels import bf16\n"
        "@numba.njit\n"
        "def new_caller(w, xs, Y, n0, n1):\n"
        "    bf16._row_block(w, xs, Y, n0, n1, w, 0, 0)\n"
        "w = np.zeros((8, 64), np.uint16); Y = np.ones((1, 8), np.float32)\n"
        "new_caller(w, bf16.bf16_operand(np.ones((1, 64), np.float32)), Y, 0, 4)\n"
        "print(float(Y[0, :4].sum()))\n"
    )
    for code in (fill, caller):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "0.0"


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize(("M", "N", "K"), [(1, 4, 32), (5, 37, 50), (9, 256, 96)])
def test_dense_products_equal_one_product_each(fmt: str, M: int, N: int, K: int) -> None:
    """f32 and bf16 matrices of one call, each against its own matvec bit for bit, row counts of
    their own (tails of the 4-row tiles included), inputs shared or one each; mixed formats or
    widths are refused."""
    rng = np.random.default_rng(M * 10 + N + K)
    ms = [quantize((rng.standard_normal((N + 3 * m, K)) * rng.uniform(0.01, 2)).astype(np.float32), fmt)
          for m in range(M)]
    X = (rng.standard_normal((3, K)) * [[0.1], [1.0], [30.0]]).astype(np.float32)
    rows = rng.integers(0, 3, M).astype(np.int64)
    Y = dense_batch.dense_products(X, ms, rows)
    assert Y.shape == (M, N + 3 * (M - 1)) and Y.dtype == np.float32
    for m, w in enumerate(ms):
        np.testing.assert_array_equal(Y[m, :w.shape[0]], w.matvec(X[rows[m]]))
    other = quantize(np.ones((4, K), np.float32), "bf16" if fmt == "f32" else "f32")
    with pytest.raises(WasteError, match="dense products"):
        dense_batch.dense_products(X, [*ms, other], np.zeros(M + 1, np.int64))
    with pytest.raises(WasteError, match="dense products"):
        dense_batch.dense_products(X, [*ms, quantize(np.ones((4, K + 32), np.float32), fmt)], np.zeros(M + 1, np.int64))


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_dense_spans_equal_each_matrix_on_its_rows(fmt: str, threads: int) -> None:
    """DenseBatch.spans (a prefill's f32 or bf16 experts on their tokens: empty runs, single
    rows, runs longer than a tile, runs that overlap or share rows; rows not a multiple of the
    row tile, K not of 32), written to rows of their own in a NaN-filled output: each run
    equals the matrix's own matmul bit for bit, and nothing else is written."""
    import numba

    rng = np.random.default_rng(threads + (fmt == "bf16") * 10)
    K, R = 72, 70
    counts = [0, 1, 3, 17, 33, 5, 0, 16, 40, 2, 9]
    ms = [quantize((rng.standard_normal((int(rng.integers(1, 80)), K)) * rng.uniform(0.01, 2)).astype(np.float32), fmt)
          for _ in counts]
    X = (rng.standard_normal((R, K)) * rng.uniform(0.05, 30, (R, 1))).astype(np.float32)
    x_start = np.array([int(rng.integers(0, R - n + 1)) for n in counts], np.int64)
    y_start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) + 2  # rows 0-1, last 2: no span's
    out_rows = sum(counts) + 4
    batch = dense_batch.DenseBatch(ms)
    Y = np.full((out_rows, batch.width), np.nan, np.float32)
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        dense_batch._dense_spans(bf16.dense_operand(X, fmt), x_start, np.array(counts, np.int64), y_start, batch.table,
                          batch.like, Y)
    finally:
        numba.set_num_threads(before)
    written = np.zeros(Y.shape, bool)
    for m, w in enumerate(ms):
        a, n, b = x_start[m], counts[m], y_start[m]
        if n:
            np.testing.assert_array_equal(Y[b:b + n, :w.shape[0]], w.matmul(X[a:a + n]))
        written[b:b + n, :w.shape[0]] = True
    assert np.isfinite(Y[written]).all() and np.isnan(Y[~written]).all()
    Z = batch.spans(X, x_start, np.array(counts, np.int64), y_start, out_rows)
    np.testing.assert_array_equal(Z[written], Y[written])
    with pytest.raises(WasteError, match="one format and width"):
        dense_batch.DenseBatch([*ms, quantize(np.ones((4, K), np.float32), "bf16" if fmt == "f32" else "f32")])
