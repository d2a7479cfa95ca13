"""What the host CPU lets waste's kernels use, decided once per process (no Numba kernels here,
so `waste.jit` can key its cache on it).

The integer products' lowering (`waste.kernels.int8_blocks`) is one of INT8_ISAS, the best
the host has: "amx" adds AMX-INT8 tiles to "vbmi" for chunks of many tokens, where the CPU has
AMX and Linux grants this process the tile registers (arch_prctl ARCH_REQ_XCOMP_PERM:
without it the first tile instruction kills the process with SIGILL). WASTE_AMX=0 keeps a
host with AMX on "vbmi"; every lowering gives the same bits (tests/kernels/test_quant.py).
"""

from __future__ import annotations

import ctypes
import functools
import os

import llvmlite.binding as llvm

INT8_ISAS = ("amx", "vbmi", "vnni", "avx2", "generic")
AMX_ENV = "WASTE_AMX"  # "0": do not use AMX tiles even where the CPU has them
AMX_FEATURES = {"amx-tile", "amx-int8", "avx512vbmi", "avx512vnni", "avx512bw"}
# Linux's arch_prctl: ask for permission to use a dynamically enabled XSAVE feature; AMX's tile
# data is feature 18 (arch/x86/include/uapi/asm/prctl.h, asm/fpu/types.h).
_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


@functools.cache
def host_features() -> frozenset[str]:
    """The host's CPU features ("avx2", "avx512vnni", ...) when Numba compiles for this host;
    none when NUMBA_CPU_NAME or NUMBA_CPU_FEATURES makes it compile for another CPU."""
    from numba.core import config

    if config.CPU_NAME or config.CPU_FEATURES:
        return frozenset()
    return frozenset(f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f.startswith("+"))


@functools.cache
def host_vendor() -> str:
    """The CPU's vendor as Linux reports it ("GenuineIntel", "AuthenticAMD"); "" where
    /proc/cpuinfo does not say."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def amx_permitted() -> bool:
    """Ask Linux for this process's use of the AMX tile registers (granted for all its threads);
    False where the kernel refuses or is not Linux on x86_64."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


@functools.cache
def int8_isa() -> str:
    """The best of INT8_ISAS this host runs ("generic" if Numba targets another CPU)."""
    features = host_features()
    if {"avx512vnni", "avx512bw"} <= features:
        if AMX_FEATURES <= features and os.environ.get(AMX_ENV, "1") != "0" and amx_permitted():
            return "amx"
        return "vbmi" if "avx512vbmi" in features else "vnni"
    return "avx2" if "avx2" in features else "generic"
