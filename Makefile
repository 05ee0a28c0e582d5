# `make run`: install everything into .venv, then generate with the embedded default model.
# `make test`: install if needed, then run the default test suite (slow and GPU tests skipped).
VENV := .venv
STAMP := $(VENV)/.sonar-installed
# The first run shows what Sonar is for: a prompt whose answer copies from it, so n-gram lookup
# drafts and the SpecDecoding metrics lines report what was accepted (printf expands the \n).
PROMPT ?= Rename the function add to plus in this code and show the whole result:\n\ndef add(a, b):\n    """Return the sum of a and b."""\n    return a + b\n\nprint(add(2, 3))
SPECULATIVE_CONFIG ?= {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}

.PHONY: install run test test-slow lint

$(STAMP): pyproject.toml constraints.txt scripts/install.sh $(wildcard plugins/*/pyproject.toml)
	bash scripts/install.sh
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/aphrodite generate --chat --max-tokens 96 --speculative-config '$(SPECULATIVE_CONFIG)' --prompt "$$(printf '%b' '$(PROMPT)')"

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check .
