# The two commands of the README: `make bench` (install, then the benchmark on this machine's default)
# and `make test` (install, then the CPU test suite). Both install into .venv from the pinned files.
VENV ?= .venv
PYTHON ?= python3
export HF_HUB_OFFLINE ?= 1
export WANDB_MODE ?= offline

.PHONY: install bench test clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --disable-pip-version-check -q -r requirements-test.txt
	touch $@

# Streams a generated sample MDS dataset of real JPEGs (built on first use): SD2 base with the published
# settings on a GPU (all GPUs of this machine), the tiny model on a CPU. --use_synth_data: random tensors.
bench: install
	$(VENV)/bin/composer benchmark.py --results_json results/default.json

test: install
	$(VENV)/bin/python -m pytest

clean:
	rm -rf $(VENV) results
