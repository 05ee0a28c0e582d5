# `make run`: install everything into .venv, then generate with the embedded default model.
# `make test`: install if needed, then run the default test suite (slow and GPU tests skipped).
VENV := .venv
STAMP := $(VENV)/.sonar-installed
PROMPT ?= Explain speculative decoding in two sentences.

.PHONY: install run test test-slow lint

$(STAMP): pyproject.toml constraints.txt scripts/install.sh $(wildcard plugins/*/pyproject.toml)
	bash scripts/install.sh
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/aphrodite generate --chat --max-tokens 64 --prompt "$(PROMPT)"

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check .
