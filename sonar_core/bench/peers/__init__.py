"""Peer engines the benchmark runs side by side with Sonar, each optional.

A peer is a worker script in this folder, run by the Python of the environment the peer is
installed in (``scripts/peers/*.sh`` makes those environments). Workers import only the standard
library, their engine and :mod:`peer_protocol`, so a peer's environment needs nothing of Sonar's.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PEER_DIR = Path(__file__).resolve().parent
# The folder that holds sonar_core (the repository root for an editable install): peers'
# environments are looked for there and in the working directory.
PROJECT_ROOT = PEER_DIR.parents[2]


@dataclass(frozen=True)
class PeerEngine:
    """One peer engine: where its worker is, which Python runs it, and what it accepts.

    ``modes`` maps each speculation mode (None: plain decoding) to the option names it takes.
    """

    name: str
    title: str
    worker: str  # a file in this folder, or an absolute path
    venv: str | None  # None: Sonar's own interpreter
    module: str  # imported to check that the peer is installed
    install: str
    modes: Mapping[str | None, frozenset[str]]
    concurrent_modes: frozenset[str | None]  # modes that take concurrency > 1; the others serve one request at a time
    needs_gguf: bool = False  # reads the target only as a GGUF file

    def python(self) -> Path | None:
        """The interpreter that runs this peer's worker, or None when the peer is not installed.

        ``SONAR_BENCH_<NAME>_PYTHON`` overrides the search (for an environment elsewhere).
        """
        override = os.environ.get(f"SONAR_BENCH_{self.name.upper()}_PYTHON")
        if override:
            return Path(override) if Path(override).is_file() else None
        if self.venv is None:
            return Path(sys.executable) if importlib.util.find_spec(self.module) is not None else None
        for root in (Path.cwd(), PROJECT_ROOT):
            candidate = root / self.venv / "bin" / "python"
            if candidate.is_file() and _has_module(root / self.venv, self.module):
                return candidate
        return None

    def worker_path(self) -> Path:
        return PEER_DIR / self.worker  # an absolute worker path stays as it is


def _has_module(venv: Path, module: str) -> bool:
    """Whether the environment has ``module`` installed, without starting its interpreter."""
    return any(
        (site / module).is_dir() or (site / f"{module}.py").is_file()
        for site in venv.glob("lib/python*/site-packages")
    )


_K = "num_speculative_tokens"
PEERS: dict[str, PeerEngine] = {
    peer.name: peer
    for peer in (
        PeerEngine(
            name="hf",
            title="Hugging Face transformers",
            worker="hf_worker.py",
            venv=None,
            module="transformers",
            install="pip install transformers (installed with sonar-core)",
            modes={
                None: frozenset(),
                "prompt_lookup": frozenset({_K, "max_matching_ngram_size"}),
                "assistant": frozenset({_K, "model"}),
            },
            concurrent_modes=frozenset({None}),  # generate on a padded batch; assisted generation is batch 1 only
        ),
        PeerEngine(
            name="vllm",
            title="vLLM for CPU",
            worker="vllm_worker.py",
            venv=".venv-vllm",
            module="vllm",
            install="bash scripts/peers/vllm_cpu.sh",
            modes={None: frozenset(), "ngram": frozenset({_K, "prompt_lookup_max", "prompt_lookup_min"})},
            concurrent_modes=frozenset({None, "ngram"}),
        ),
        PeerEngine(
            name="llama_cpp",
            title="llama-cpp-python",
            worker="llama_cpp_worker.py",
            venv=".venv-llama",
            module="llama_cpp",
            install="bash scripts/peers/llama_cpp.sh",
            modes={
                None: frozenset({"extra_buffer_types"}),
                "prompt_lookup": frozenset({_K, "max_ngram_size", "extra_buffer_types"}),
            },
            concurrent_modes=frozenset(),
            needs_gguf=True,
        ),
    )
}
