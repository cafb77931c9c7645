# The two commands of the README: `make bench` (install, then the benchmark on this machine's default)
# and `make test` (install, lint, then every CPU test tier). Both install into .venv from the pinned files.
VENV ?= .venv
PYTHON ?= python3
export HF_HUB_OFFLINE ?= 1
export WANDB_MODE ?= offline

.PHONY: install bench lint format test test-fast test-gpu gpu-check gpu-campaign test-current test-gpu-image wheelhouse test-wheelhouse clean

install: $(VENV)/.installed

# The pinned packages, then this repo itself in editable mode (its modules importable from benchmarks/).
$(VENV)/.installed: requirements.txt requirements-test.txt requirements-data.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --disable-pip-version-check -q -r requirements.txt -r requirements-test.txt -r requirements-data.txt
	$(VENV)/bin/pip install --disable-pip-version-check -q --no-deps -e .
	touch $@

# benchmark.py with flags $(2) from venv $(1). On a machine with several GPUs, Composer's launcher (one process per
# GPU; run by runs/launcher.py, which ends on Ctrl-C without a traceback of its own), whose own lines follow the run's (a crashed rank's status, a 30 s wait): the run's verdict, its throughput
# line or its one-line error, is printed again once the launcher is done (arguments.VERDICT_FILE). Else one
# process, which needs no launcher. USE_LAUNCHER=1 or 0 overrides the choice.
USE_LAUNCHER ?= $$($(1)/bin/python -c 'import torch; print(int(torch.cuda.device_count() > 1))')
RUN_BENCHMARK = if [ "$(call USE_LAUNCHER,$(1))" = 1 ]; then \
	verdict=$$(mktemp); BENCHMARK_VERDICT_FILE=$$verdict $(1)/bin/python -m runs.launcher benchmark.py $(2); status=$$?; \
	if [ -s $$verdict ] && [ $$status = 0 ]; then echo; cat $$verdict; elif [ -s $$verdict ]; then cat $$verdict >&2; fi; \
	rm -f $$verdict; (exit $$status); \
	else $(1)/bin/python benchmark.py $(2); fi

# Streams a generated sample MDS dataset of real JPEGs (built on first use): SD2 base with the published
# settings on a GPU (all GPUs of this machine), the tiny model on a CPU. --use_synth_data: random tensors.
bench: install
	$(call RUN_BENCHMARK,$(VENV),--results_json results/default.json)

# A T5 tokenizer folder for smoke runs of the T5 models on captions (--tokenizer data/t5-smoke-tokenizer), written
# offline with the `tokenizers` library: T5's ids for padding and end of text, a vocabulary of under 200 pieces
# rather than T5's (docs/models.md). Written once; the line printed is its folder.
.PHONY: t5-smoke-tokenizer
t5-smoke-tokenizer: install
	@$(VENV)/bin/python -c 'from settings.tokenizer import t5_smoke_tokenizer_folder; print(t5_smoke_tokenizer_folder())'

# ruff: lint rules and formatting, configured in pyproject.toml. `make format` applies the formatting.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Test tiers (pytest markers, see docs/testing.md): fast (no marker), slow, gpu. CUDA is hidden from a session
# that leaves out the gpu tests, so CPU defaults are what the CPU tiers test. The CPU tiers run in TEST_WORKERS pytest-xdist
# processes, each test's torch on one thread (OMP_NUM_THREADS=1) so that they do not share cores; the 25 slowest
# tests are listed at the end.
TEST_WORKERS ?= 2
CPU_TESTS = OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --durations=25
# In CI (CI=true) the tests whose subject is a process (marked `process`) run in their own lane instead, as plain
# processes (test-processes, below), side by side with the other lanes.
test: lint
	$(CPU_TESTS) -m 'not gpu$(if $(filter true,$(CI)), and not process)'

test-fast: install
	$(CPU_TESTS) -m 'not slow and not gpu'

# The gpu tier's skips expected on a GPU machine (tests/conftest.py fails any other): no xFormers build for this
# torch, and float8 before compute capability 8.9.
GPU_EXPECTED_SKIPS = SD2_EXPECTED_SKIPS='xFormers is not installed; float8 matmuls need compute capability 8.9'
test-gpu: install
	$(GPU_EXPECTED_SKIPS) $(VENV)/bin/python -m pytest -m gpu

# A GPU machine's verdict in one command (docs/testing.md), on a machine that can install .venv from PyPI (a GPU
# machine without network runs `bash benchmarks/gpu_slice.sh` instead): the gpu tier, then SD2 base at 512px with
# the published microbatch of 4, 4 microbatches per GPU for 12 batches, with the encoders online and from
# precomputed latents (random tensors: the GPUs are measured, not the data); each run prints img/s, MFU and peak
# memory. A failing test does not stop the runs; the status is the tier's, or the runs'.
GPU_CHECK_RUN = --model_name sd2-base --use_synth_data --image_size 512 --device_train_microbatch_size 4 --max_duration 12ba
gpu-check: install
	@$(VENV)/bin/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device')"
	status=0; $(GPU_EXPECTED_SKIPS) $(VENV)/bin/python -m pytest -m gpu || status=$$?; \
	gpus=$$($(VENV)/bin/python -c 'import torch; print(torch.cuda.device_count())'); \
	{ $(call RUN_BENCHMARK,$(VENV),$(GPU_CHECK_RUN) --batch_size $$((16 * gpus)) --results_json results/gpu-check-online.json) && \
	$(call RUN_BENCHMARK,$(VENV),$(GPU_CHECK_RUN) --batch_size $$((16 * gpus)) --precomputed_latents --results_json results/gpu-check-precomputed.json); } || status=1; \
	exit $$status

# The GPU campaign (benchmarks/gpu_campaign.py, docs/speed.md) on a machine with .venv: each call measures for at
# most 9 minutes, then stops; the next call goes on where it stopped. Its folder, results/gpu-campaign, holds the
# table and every row. A GPU machine without network runs `bash benchmarks/gpu_slice.sh` with the wheels of
# `make gpu-wheels`: `make gpu-loan LOAN=kernels` prints a loan's plan at the recorded figures and the command for
# each of its calls, this checkout's commit in it; `make gpu-land` commits what came back (results/gpu-campaign)
# into benchmarks/measured/DATE-GPU/ and writes the README's GPU table and results.md's entries from that folder.
gpu-campaign: install
	$(VENV)/bin/python benchmarks/gpu_campaign.py --resume

LOAN ?= kernels
.PHONY: gpu-loan gpu-land
gpu-loan:
	$(VENV)/bin/python benchmarks/gpu_campaign.py --plan --loan $(LOAN)
	@echo "each call: BENCHMARK_GIT_COMMIT=$$(git rev-parse HEAD) GPU_LOAN=$(LOAN) bash benchmarks/gpu_slice.sh"

gpu-land:
	$(VENV)/bin/python benchmarks/gpu_campaign.py --land results/gpu-campaign
	$(VENV)/bin/python benchmarks/measured_tables.py --write

# For a GPU machine without network that has a torch 2.11 image's packages (docs/install.md): the wheels that image
# lacks (requirements-gpu-image.txt) for its Python 3.12 on manylinux x86_64, into the ignored .whl/, copied there with
# the repo and installed by benchmarks/gpu_slice.sh. Kept under 64 MiB, small enough to copy with the repo's files.
GPU_WHEELS ?= .whl
GPU_WHEEL_PLATFORMS = manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
	manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64
.PHONY: gpu-wheels
gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(addprefix --platform ,$(GPU_WHEEL_PLATFORMS)) -d $(GPU_WHEELS) -r requirements-gpu-image.txt
	@bytes=$$(du -sb $(GPU_WHEELS) | cut -f1); \
	echo "$(GPU_WHEELS): $$(ls $(GPU_WHEELS) | wc -l) wheels, $$((bytes / 1048576)) MiB (at most 64 MiB)"; \
	[ $$bytes -lt 67108864 ] || { echo "gpu-wheels: $(GPU_WHEELS) is over 64 MiB, more than it is meant to take" >&2; exit 1; }

# The Spark route's lane (datapath/spark_convert.py, docs/data.md): pyspark and what it writes with
# (requirements-spark.txt) added to $(VENV), then its tests in Spark's local mode, which need a Java runtime on the
# machine (.ci/run installs Debian's default-jre-headless). Their file is not one `make test` collects.
.PHONY: test-spark
test-spark: $(VENV)/.spark-installed
	$(VENV)/bin/python -m pytest -n 0 tests/spark_lane.py

# Installed before the lanes start in CI (.ci/run): test-processes runs tests from $(VENV) beside this lane.
$(VENV)/.spark-installed: $(VENV)/.installed requirements-spark.txt
	$(VENV)/bin/pip install --disable-pip-version-check -q -r requirements-spark.txt
	touch $@

# CI's lane of the tests whose subject is a process (marked `process`: signals, ranks and their launchers, two
# writers, loader workers): in `make test` most of their commands are forked from tests/forkserver.py, which skips an
# interpreter's start and end; here each is a new interpreter, as a user's is (tests/conftest.py's PLAIN_PROCESSES).
# Tests of what two ranks compute (their batches, a resumed run's weights, FSDP's shards) check outputs: they stay
# in `make test`, forked.
.PHONY: test-processes
test-processes: install
	SD2_PLAIN_PROCESSES=1 $(CPU_TESTS) -m 'process and not gpu'

# The second CPU lane, on today's stack rather than the pins (docs/install.md): a separate venv with the newest torch
# from PyPI (a CUDA build, which loads its nvidia-* libraries even on a CPU, so pip installs them as usual) and
# numpy, then requirements-current.txt with --no-deps, as on a machine with its own PyTorch, and the newest wandb.
# Runs the whole fast tier (a stack change breaks more than the `stack` tests see: the CLIP score did), in
# TEST_WORKERS processes as `make test` does, and the benchmark of `make bench`.
CURRENT_VENV ?= .venv-current
CURRENT_TORCH ?= torch==2.15.0 torchvision==0.29.2 numpy==2.4.6
CURRENT_WANDB ?= wandb==0.31.0

$(CURRENT_VENV)/.installed: requirements-current.txt requirements-test.txt requirements-data.txt pyproject.toml
	$(PYTHON) -m venv $(CURRENT_VENV)
	$(CURRENT_VENV)/bin/pip install --disable-pip-version-check -q $(CURRENT_TORCH)
	$(CURRENT_VENV)/bin/pip install --disable-pip-version-check -q --no-deps -r requirements-current.txt
	$(CURRENT_VENV)/bin/pip install --disable-pip-version-check -q -r requirements-test.txt -r requirements-data.txt $(CURRENT_WANDB)
	$(CURRENT_VENV)/bin/pip install --disable-pip-version-check -q --no-deps -e .
	touch $@

test-current: $(CURRENT_VENV)/.installed
	OMP_NUM_THREADS=1 $(CURRENT_VENV)/bin/python -m pytest -n $(TEST_WORKERS) -m 'not slow and not gpu'
	$(call RUN_BENCHMARK,$(CURRENT_VENV),--results_json results/current.json)

# The third CPU lane: a GPU machine's own packages (the image of docs/install.md: torch 2.11, transformers 5.17,
# huggingface_hub 1.33, tokenizers 0.23.2, with what pip resolves for them), then only what that image lacks,
# requirements-gpu-image.txt, with --no-deps. numpy is 2.4.6 here: the image's 2.5.2 needs Python 3.12.
IMAGE_VENV ?= .venv-image
IMAGE_PACKAGES ?= torch==2.11.0 torchvision==0.26.0 numpy==2.4.6 transformers==5.17.0 huggingface-hub==1.33.0 \
	tokenizers==0.23.2 safetensors==0.8.0 hf-xet==1.8.0 torchmetrics==1.9.0 lightning-utilities pyyaml pillow \
	matplotlib requests tqdm psutil py-cpuinfo regex xxhash python-dateutil rich typer

$(IMAGE_VENV)/.installed: requirements-gpu-image.txt requirements-test.txt pyproject.toml
	$(PYTHON) -m venv $(IMAGE_VENV)
	$(IMAGE_VENV)/bin/pip install --disable-pip-version-check -q $(IMAGE_PACKAGES)
	$(IMAGE_VENV)/bin/pip install --disable-pip-version-check -q --no-deps -r requirements-gpu-image.txt
	$(IMAGE_VENV)/bin/pip install --disable-pip-version-check -q -r requirements-test.txt
	$(IMAGE_VENV)/bin/pip install --disable-pip-version-check -q --no-deps -e .
	touch $@

test-gpu-image: $(IMAGE_VENV)/.installed
	SD2_EXPECTED_SKIPS='wandb is not installed' $(IMAGE_VENV)/bin/python -m pytest -m 'stack and not slow and not gpu'
	$(call RUN_BENCHMARK,$(IMAGE_VENV),--results_json results/gpu-image.json)

# An offline install (docs/install.md): the wheels of requirements-current.txt and requirements-data.txt (Parquet
# input) for one Python version and Linux x86_64, downloaded into one folder to copy to a machine without internet
# and install there with --no-index.
WHEELHOUSE ?= wheelhouse
WHEEL_PYTHON ?= 3.12
WHEEL_PLATFORMS ?= manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64

# With setuptools, which installing this repo itself (`pip install --no-build-isolation -e .`) needs offline.
WHEEL_SETUPTOOLS ?= setuptools==80.9.0
wheelhouse:
	$(PYTHON) -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
		--python-version $(WHEEL_PYTHON) --implementation cp $(addprefix --platform ,$(WHEEL_PLATFORMS) any) \
		-d $(WHEELHOUSE) -r requirements-current.txt -r requirements-data.txt $(WHEEL_SETUPTOOLS)
	@echo "$(WHEELHOUSE): $$(ls $(WHEELHOUSE) | wc -l) wheels, $$(du -sh $(WHEELHOUSE) | cut -f1), for Python $(WHEEL_PYTHON)"

# The wheelhouse for this machine's Python, installed into a fresh venv with --no-index: every wheel installs from
# the folder alone, and packages that need nothing of torch's import (the rest need torch and its own imports).
test-wheelhouse:
	rm -rf results/wheelhouse results/wheelhouse-venv
	$(MAKE) wheelhouse WHEELHOUSE=results/wheelhouse \
		WHEEL_PYTHON=$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
	$(PYTHON) -m venv results/wheelhouse-venv
	results/wheelhouse-venv/bin/pip install --disable-pip-version-check -q --no-index --no-deps results/wheelhouse/*.whl
	results/wheelhouse-venv/bin/pip install --disable-pip-version-check -q --no-index --no-deps --no-build-isolation -e .
	results/wheelhouse-venv/bin/python -c "import boto3, ftfy, regex, tokenizers, yaml, PIL, zstd, brotli, snappy, pyarrow"
	cd results && wheelhouse-venv/bin/python -c "import guards.arguments"  # this repo, from any folder
	test $$(ls results/wheelhouse | wc -l) -eq $$(($$(cat requirements-current.txt requirements-data.txt | grep -c '^[a-z]') + 1))
	@echo "test-wheelhouse: $$(ls results/wheelhouse | wc -l) wheels installed with --no-index"

clean:
	rm -rf $(VENV) $(CURRENT_VENV) $(IMAGE_VENV) results
