# The two commands of the README: `make bench` (install, then the benchmark on this machine's default)
# and `make test` (install, lint, then every CPU test tier). Both install into .venv from the pinned files.
VENV ?= .venv
PYTHON ?= python3
export HF_HUB_OFFLINE ?= 1
export WANDB_MODE ?= offline

.PHONY: install bench lint format test test-fast test-gpu clean

install: $(VENV)/.installed

# The pinned packages, then this repo itself in editable mode (its modules importable from benchmarks/).
$(VENV)/.installed: requirements.txt requirements-test.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --disable-pip-version-check -q -r requirements-test.txt
	$(VENV)/bin/pip install --disable-pip-version-check -q --no-deps -e .
	touch $@

# Streams a generated sample MDS dataset of real JPEGs (built on first use): SD2 base with the published
# settings on a GPU (all GPUs of this machine), the tiny model on a CPU. --use_synth_data: random tensors.
bench: install
	$(VENV)/bin/composer benchmark.py --results_json results/default.json

# ruff: lint rules and formatting, configured in pyproject.toml. `make format` applies the formatting.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Test tiers (pytest markers, see docs/testing.md): fast (no marker), slow, gpu. CUDA is hidden from every
# tier but gpu, so CPU defaults are what the CPU tiers test.
test: lint
	$(VENV)/bin/python -m pytest -m 'not gpu'

test-fast: install
	$(VENV)/bin/python -m pytest -m 'not slow and not gpu'

test-gpu: install
	$(VENV)/bin/python -m pytest -m gpu

clean:
	rm -rf $(VENV) results
