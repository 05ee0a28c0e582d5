"""What this machine's CPU offers the kernels: the model name and the instruction-set extensions
that decide which paths are fast (AMX and AVX-512 BF16 multiply bfloat16 natively; an AVX2-only
CPU widens it to float32 in its registers). Torch-free: configuration checks and bench reports read it."""

from __future__ import annotations

import functools
import platform

# The extensions that decide which CPU kernels run fast, in the order reports name them.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")
# Any of these: the CPU multiplies bfloat16 in hardware.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# All of these: the CPU widens bfloat16 to float32 in its vector registers cheaply enough that a
# decode step, which streams every weight, gains more from half the bytes than it loses converting.
WIDENING_BF16_FLAGS = frozenset({"avx2", "fma"})


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return model, flags


def cpu_model() -> str:
    return _cpuinfo()[0]


def kernel_flags() -> list[str]:
    """The :data:`KERNEL_FLAGS` this CPU has (empty where /proc/cpuinfo is not readable)."""
    flags = _cpuinfo()[1]
    return [flag for flag in KERNEL_FLAGS if flag in flags]


def cpu_flags() -> frozenset[str]:
    """Every instruction-set flag /proc/cpuinfo lists (empty where it is not readable)."""
    return _cpuinfo()[1]


def native_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX)."""
    return bool(NATIVE_BF16_FLAGS & _cpuinfo()[1])


def fast_bf16() -> bool:
    """Whether bfloat16 runs faster than float32 here: natively (:func:`native_bf16`), or widened
    in registers on an AVX2 + FMA CPU, where an AMD EPYC decoded the embedded model 1.6-2.2x faster in
    bfloat16 than in float32 (docs/performance.md, "dtype auto by CPU kind")."""
    return native_bf16() or WIDENING_BF16_FLAGS <= _cpuinfo()[1]
