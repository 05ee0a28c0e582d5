"""Sonar's own CPU kernels (``csrc/``): matmuls for the few rows of decode and verification steps
(``skinny_linear.cpp``), attention that reads the paged KV cache in place, and the fused
element-wise steps of a decoder layer (norms with the residual add, RoPE in place, the MLP's
activation, cache writes) (``cpu_ops.cpp``).

Why: at decode batch sizes a step of a small model on the CPU reads every weight for a few rows,
and is otherwise a chain of about 40 PyTorch operators per layer whose fixed costs (dispatch,
thread wake-ups, dtype round trips) and per-layer copies of every request's context dominate.
These kernels stream the weights at close to the memory's speed, do the rest in about ten calls
per layer, and read each key and value once, where it lies.

They are compiled on first use with the machine's C++ compiler (about 20 s, the sources side by
side) for this CPU (``-march=native``, or :data:`ARCH_ENV`), and cached under
``$SONAR_CACHE_DIR/cpu-kernels`` keyed by the sources, the compiler flags, the torch version and
the CPU's instruction sets; a later start loads the cached library in milliseconds. Where no
compiler is, or the build fails, Sonar logs one line and keeps the PyTorch operators (same
results up to float rounding). ``SONAR_CPU_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from sonar_core.cpu_features import cpu_flags
from sonar_core.model_files import cache_root

logger = logging.getLogger(__name__)

ENV_SWITCH = "SONAR_CPU_KERNELS"
SOURCE_DIR = Path(__file__).with_name("csrc")
# Picks the instruction set the kernels are compiled for: this CPU's by default; an older one
# (for example ``haswell`` for AVX2 only) builds the paths that CPUs without AVX-512 take, so that
# tests can run them on a newer machine.
ARCH_ENV = "SONAR_CPU_KERNELS_ARCH"
# The dtypes the kernels are compiled for.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The dtypes the skinny matmul (``csrc/skinny_linear.cpp``) packs.
SKINNY_DTYPES = (torch.float32, torch.bfloat16)
# -mprefer-vector-width=512: GCC otherwise keeps to 256-bit vectors on AVX-512 CPUs (harmless
# where the CPU has no AVX-512). -fno-trapping-math: without it GCC keeps every floating-point
# comparison behind a branch (a comparison may raise an exception flag, which nothing here reads),
# so loops with a max, a min or a select, such as the softmax's and SiLU's exponentials, stay
# scalar; the values computed are the same.
COMPILE_FLAGS = (
    "-O3",
    "-mprefer-vector-width=512",
    "-fno-trapping-math",
    "-fopenmp",
    "-std=c++17",
    "-fPIC",
    "-shared",
    "-DNDEBUG",
)


class _State:
    """Whether the kernels are loaded; filled once per process by :func:`load`."""

    lock = threading.Lock()
    tried = False
    ops: Any = None
    problem: str | None = None
    # Tests and benchmarks switch the kernels off for a block (:func:`disabled`).
    forced_off = 0


def enabled_by_environment() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def load() -> Any:
    """The ``torch.ops.sonar`` namespace once the kernels are loaded (building them if needed), or
    None where they cannot be (switched off, no compiler, a failed build: logged once)."""
    if _State.tried:
        return _State.ops
    with _State.lock:
        if not _State.tried:
            _State.ops, _State.problem = _load_or_build()
            _State.tried = True
    return _State.ops


@functools.cache
def attention_verifies_in_place() -> bool:
    """Whether the loaded kernels' attention is the faster path for verification steps too (AVX-512
    builds share each key among a sequence's queries; AVX2 builds attend query by query, still
    faster than gathering the context for PyTorch's SDPA there)."""
    ops = load()
    return ops is not None and bool(ops.attention_verifies_in_place())


@functools.cache
def attention_shares_keys() -> bool:
    """Whether the loaded kernels' attention scores each key once for all of a sequence's queries
    (AVX-512 builds) rather than query by query (AVX2 builds): what makes long rows cheap in place."""
    ops = load()
    return ops is not None and bool(ops.attention_shares_keys())


@functools.cache
def attention_tile_keys() -> int:
    """Keys per AMX tile by which the loaded kernels score and sum bfloat16 rows of several queries,
    in steps whose cache blocks hold whole tiles of keys (0: no tiles in this build or process)."""
    ops = load()
    return int(ops.attention_tile_keys()) if ops is not None else 0


def problem() -> str | None:
    """Why the kernels are not in use (None when they are, or were never asked for)."""
    return _State.problem


def for_tensor(x: torch.Tensor, *others: torch.Tensor) -> Any:
    """The kernels, when they can stand in for PyTorch's operators on ``x``: a CPU tensor of a
    compiled dtype, with nothing autograd would have to record (the kernels have no backward, so
    training keeps the PyTorch path; ``others`` are the op's other tensor inputs, such as a
    trainable weight). None otherwise."""
    if _State.forced_off or x.device.type != "cpu" or x.dtype not in DTYPES:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in others)):
        return None
    return _State.ops if _State.tried else load()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the block on PyTorch's operators (parity tests compare both paths)."""
    _State.forced_off += 1
    try:
        yield
    finally:
        _State.forced_off -= 1


def sources() -> list[Path]:
    """The C++ files compiled into the library (headers beside them are included)."""
    return sorted(SOURCE_DIR.glob("*.cpp"))


def compile_flags() -> tuple[str, ...]:
    """:data:`COMPILE_FLAGS` plus the target instruction set (:data:`ARCH_ENV`, default native)."""
    arch = os.environ.get(ARCH_ENV, "").strip() or "native"
    return (f"-march={arch}", *COMPILE_FLAGS)


def library_path() -> Path:
    """Where the compiled library for these sources, compiler flags, torch and CPU lives."""
    key = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):
        key.update(path.name.encode())
        key.update(path.read_bytes())
    key.update(" ".join(compile_flags()).encode())
    key.update(torch.__version__.encode())
    key.update(sys.version.encode())
    key.update(" ".join(sorted(cpu_flags())).encode())
    return cache_root() / "cpu-kernels" / key.hexdigest()[:16] / "sonar_cpu_ops.so"


def _load_or_build() -> tuple[Any, str | None]:
    if not enabled_by_environment():
        return None, f"{ENV_SWITCH}=0"
    if sys.platform != "linux":
        return None, "the CPU kernels are built for Linux only"
    try:
        path = library_path()
        if not path.exists():
            _build(path)
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        # torch's "Could not load this library" keeps the loader's reason in the cause.
        text = "; ".join(str(e).strip() for e in (error, error.__cause__) if e is not None and str(e).strip())
        reason = text.splitlines()[-1] if text else type(error).__name__
        logger.warning("Sonar's CPU kernels are not available (%s); using PyTorch's operators", reason)
        return None, reason
    return torch.ops.sonar, None


def _compiler() -> str:
    compiler = os.environ.get("CXX", "c++")
    found = shutil.which(compiler)
    if found is None:
        raise OSError(f"no C++ compiler ({compiler!r} not found; set CXX or install g++)")
    return found


def compile_commands(compiler: str, scratch: Path, output: Path) -> tuple[list[list[str]], list[str]]:
    """The compiler calls that build the library against this torch: one per source (run side by
    side, since each spends most of its time parsing ATen's headers), then the link."""
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{path}" for path in include_paths()]
    libraries = [arg for path in library_paths() for arg in (f"-L{path}", f"-Wl,-rpath,{path}")]
    objects = [scratch / f"{source.stem}.o" for source in sources()]
    compiles = [
        [compiler, *compile_flags(), f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, "-c", str(source), "-o", str(obj)]
        for source, obj in zip(sources(), objects, strict=True)
    ]
    link = [compiler, *compile_flags(), *(str(obj) for obj in objects), "-o", str(output), *libraries, "-lc10", "-ltorch_cpu"]
    return compiles, link


def _run_all(commands: list[list[str]]) -> None:
    """Run the compiler calls at once; the first failure's messages become the error."""
    running = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in commands]
    failures = []
    for process in running:
        _, errors = process.communicate()
        if process.returncode != 0:
            failures.append(errors.strip())
    if failures:
        raise RuntimeError(f"compiling {SOURCE_DIR} failed: {failures[0][-2000:]}")


def _build(path: Path) -> None:
    """Compile the library into ``path``; one process builds while the others wait for it."""
    compiler = _compiler()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():  # another process built it while this one waited
            return
        logger.info("building Sonar's CPU kernels for this CPU (once; cached in %s)", path.parent)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
            partial = Path(scratch) / path.name
            compiles, link = compile_commands(compiler, Path(scratch), partial)
            _run_all(compiles)
            _run_all([link])
            os.replace(partial, path)
        logger.info("Sonar's CPU kernels built in %.0f s", time.perf_counter() - start)
