"""What the host lets the kernels use (waste/cpu.py): the integer products' lowering, AMX's
permission and its off switch."""

from __future__ import annotations

import os
import subprocess
import sys

from waste import cpu

SHOW = ("from waste import cpu, jit; from waste.kernels import int8_blocks; "
        "print(cpu.int8_isa(), int8_blocks.ISA, jit.CACHE_DIR.name)")


def _show(**env: str) -> list[str]:
    run = subprocess.run([sys.executable, "-c", SHOW], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def test_the_lowering_follows_the_host_features() -> None:
    isa = cpu.int8_isa()
    assert isa in cpu.INT8_ISAS
    features = cpu.host_features()
    if isa == "amx":
        assert cpu.AMX_FEATURES <= features and cpu.amx_permitted()
    elif isa in ("vbmi", "vnni"):
        assert {"avx512vnni", "avx512bw"} <= features
        assert not (cpu.AMX_FEATURES <= features and cpu.amx_permitted()) or os.environ.get(cpu.AMX_ENV) == "0"
    elif isa == "avx2":
        assert "avx2" in features and "avx512vnni" not in features


def test_waste_amx_0_keeps_amx_off_with_a_cache_of_its_own() -> None:
    """WASTE_AMX=0 takes the vector lowering the host has without AMX, and compiled kernels go to
    another cache directory (Numba alone would load the AMX kernels: same CPU features)."""
    isa, blocks_isa, cache = _show()
    off_isa, off_blocks_isa, off_cache = _show(**{cpu.AMX_ENV: "0"})
    assert blocks_isa == isa and off_blocks_isa == off_isa and off_isa != "amx"
    assert cache.endswith("-" + isa) and off_cache.endswith("-" + off_isa)
    if isa == "amx":
        assert off_isa == "vbmi" and off_cache != cache
    else:
        assert (off_isa, off_cache) == (isa, cache)


def test_numba_targeting_another_cpu_gets_the_generic_lowering() -> None:
    assert _show(NUMBA_CPU_NAME="generic")[0] == "generic"
