# The two commands of the README: `make bench` (install, then the benchmark on this machine's default)
# and `make test` (install, lint, then every CPU test tier). Both install into .venv from the pinned files.
VENV ?= .venv
PYTHON ?= python3
export HF_HUB_OFFLINE ?= 1
export WANDB_MODE ?= offline

.PHONY: install bench lint format test test-fast test-gpu gpu-check test-current clean

install: $(VENV)/.installed

# The pinned packages, then this repo itself in editable mode (its modules importable from benchmarks/).
$(VENV)/.installed: requirements.txt requirements-test.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --disable-pip-version-check -q -r requirements.txt -r requirements-test.txt
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

# A GPU machine's verdict in one command (docs/testing.md): the gpu tier, then SD2 base at 512px with the published
# microbatch of 4, 4 microbatches per GPU for 12 batches, with the encoders online and from precomputed latents
# (random tensors: the GPUs are measured, not the data); each run prints img/s, MFU and peak memory.
GPU_CHECK_RUN = --model_name sd2-base --use_synth_data --image_size 512 --device_train_microbatch_size 4 --max_duration 12ba
gpu-check: install
	@$(VENV)/bin/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device')"
	$(VENV)/bin/python -m pytest -m gpu
	gpus=$$($(VENV)/bin/python -c 'import torch; print(torch.cuda.device_count())'); \
	$(VENV)/bin/composer benchmark.py $(GPU_CHECK_RUN) --batch_size $$((16 * gpus)) --results_json results/gpu-check-online.json && \
	$(VENV)/bin/composer benchmark.py $(GPU_CHECK_RUN) --batch_size $$((16 * gpus)) --precomputed_latents --results_json results/gpu-check-precomputed.json

# The second CPU lane, on today's stack rather than the pins (docs/install.md): a separate venv with torch from
# PyPI (a CUDA build, which loads its nvidia-* libraries even on a CPU, so pip installs them as usual), the
# newest numpy, then requirements-current.txt with --no-deps, as on a machine with its own PyTorch. Runs the
# fast tier and the benchmark of `make bench`.
CURRENT_VENV ?= .venv-current
CURRENT_TORCH ?= torch==2.11.0 torchvision==0.26.0 numpy==2.4.6

$(CURRENT_VENV)/.installed: requirements-current.txt requirements-test.txt pyproject.toml
	$(PYTHON) -m venv $(CURRENT_VENV)
	$(CURRENT_VENV)/bin/pip install --disable-pip-version-check -q $(CURRENT_TORCH)
	$(CURRENT_VENV)/bin/pip install --disable-pip-version-check -q --no-deps -r requirements-current.txt
	$(CURRENT_VENV)/bin/pip install --disable-pip-version-check -q -r requirements-test.txt
	$(CURRENT_VENV)/bin/pip install --disable-pip-version-check -q --no-deps -e .
	touch $@

test-current: $(CURRENT_VENV)/.installed
	$(CURRENT_VENV)/bin/python -m pytest -m 'not slow and not gpu'
	$(CURRENT_VENV)/bin/composer benchmark.py --results_json results/current.json

clean:
	rm -rf $(VENV) $(CURRENT_VENV) results
