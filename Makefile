# symmsync: the two commands a fresh machine needs are `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs there.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Where there is no NVIDIA GPU, install TORCH_CPU first: pip arguments that pick torch's CPU build.
# The default names a version whose CPU build lies on disk on this project's CI machines; on PyPI
# proper that name is a CUDA build, so elsewhere pass PyTorch's CPU index, e.g.
#   make demo TORCH_CPU="torch --index-url https://download.pytorch.org/whl/cpu"
# With a GPU, pip's default torch (a CUDA build) is what the range in pyproject.toml takes.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH_CPU ?= torch==2.13.0
PYTEST_ARGS ?=
# The cuda extra (cuda-python) where there is a GPU; a CPU machine needs none of it.
comma := ,
CUDA_EXTRA := $(if $(HAS_GPU),$(comma)cuda)
# Where wheel-check builds the wheel and the fresh environment it installs it into.
WHEEL_DIR ?= build/wheel
WHEEL_VENV ?= build/wheel-venv

.PHONY: demo test test-soak test-gpu test-gpu-shared test-gpu-quick bench-fence bench-pcp doctor lint clean wheel-check

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.torch: | $(PY)
	$(if $(HAS_GPU),,$(PIP) install --quiet $(TORCH_CPU))
	touch $@

$(VENV)/.base: pyproject.toml $(VENV)/.torch
	$(PIP) install --quiet -e ".[demo$(CUDA_EXTRA)]"
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.base
	$(PIP) install --quiet -e ".[test,models,demo$(CUDA_EXTRA)]"
	touch $@

$(VENV)/.bench: pyproject.toml $(VENV)/.base
	$(PIP) install --quiet -e ".[bench,demo$(CUDA_EXTRA)]"
	touch $@

$(VENV)/.docs: pyproject.toml $(VENV)/.base
	$(PIP) install --quiet -e ".[docs,demo$(CUDA_EXTRA)]"
	touch $@

## demo: the main demo (PCP direct-KV publication, host backend unless GPUs are present)
demo: $(VENV)/.base
	$(PY) examples/pcp_kv.py

## test: the whole test suite but the soaks; GPU tests skip with the reason where there are no GPUs
test: $(VENV)/.test install-spin
	$(PY) -m pytest $(PYTEST_ARGS)

## test-soak: only the soaks (long runs of what `make test` checks at a smaller scale; skipped there)
test-soak: $(VENV)/.test
	$(PY) -m pytest -m soak $(PYTEST_ARGS)

## test-gpu: only the GPU suite (needs 2 NVIDIA GPUs)
test-gpu: $(VENV)/.test
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

## test-gpu-shared: the GPU suite with each test's ranks sharing the GPUs there are, under an MPS daemon
## (started for the run and always stopped), the tests that scale with the world at GPU_WORLDS, the GPU
## soaks at the largest; then, with the daemon stopped, the tests whose kernels trap by design (docs/gpu.md).
## On a GPU image without the venv: make test-gpu-shared SYSTEM_PY=python3
GPU_WORLDS ?= 2,4,8
SYSTEM_PY ?=
GPU_PY := $(or $(SYSTEM_PY),$(PY))
test-gpu-shared: $(if $(SYSTEM_PY),,$(VENV)/.test)
	@status=0; \
	export PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} SYMMSYNC_SHARE_GPUS=1 SYMMSYNC_GPU_WORLDS=$(GPU_WORLDS); \
	SYMMSYNC_SOAK=1 $(GPU_PY) -m symmsync mps run -- $(GPU_PY) -m pytest -m "gpu and not traps" $(PYTEST_ARGS) || status=1; \
	$(GPU_PY) -m pytest -m "gpu and traps" $(PYTEST_ARGS) || status=1; \
	exit $$status

## test-gpu-quick: the GPU confirmation that fits one device session (under 8 minutes on one GPU): every
## consumer's GPU tests (the tutorial's consumer of the kit, the collectives, MoE, the writer's routes and
## formats, their refusals, compiled and captured steps) with the ranks sharing the GPUs under MPS at
## GPU_WORLDS, the soaks left out; then, with the daemon stopped, those of them whose kernels trap by design.
GPU_QUICK := tests/gpu/test_gpu_kit.py tests/gpu/test_gpu_refusals.py tests/gpu/test_gpu_collectives.py \
	tests/gpu/test_gpu_moe.py tests/gpu/test_gpu_pcp_formats.py tests/gpu/test_gpu_four.py \
	tests/gpu/test_gpu_compile.py tests/gpu/test_gpu_compile_kv.py tests/gpu/test_gpu_fail_closed.py \
	tests/gpu/test_collectives_trap_gpu.py tests/gpu/test_gpu_cuda.py::test_pcp2_byte_oracle_in_cuda_graph_replay
test-gpu-quick: $(if $(SYSTEM_PY),,$(VENV)/.test)
	@status=0; \
	export PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} SYMMSYNC_SHARE_GPUS=1 SYMMSYNC_GPU_WORLDS=$(GPU_WORLDS); \
	$(GPU_PY) -m symmsync mps run -- $(GPU_PY) -m pytest -m "gpu and not traps and not soak" $(GPU_QUICK) $(PYTEST_ARGS) || status=1; \
	$(GPU_PY) -m pytest -m "gpu and traps" $(GPU_QUICK) $(PYTEST_ARGS) || status=1; \
	exit $$status

## verify: model-check the fence, the signals and the collectives' slots with Spin, every configuration (verify/README.md)
verify: install-spin
	$(PYTHON) verify/check.py

.PHONY: verify install-spin
# The Spin model checker from the distribution's packages, when it is not on PATH (root or sudo).
install-spin:
	@command -v spin >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null 2>&1; then SUDO=sudo; \
	  else echo "make: spin is missing; installing it needs root or sudo: apt-get install spin" >&2; exit 1; fi; \
	  command -v apt-get >/dev/null 2>&1 || { \
	    echo "make: spin is missing and there is no apt-get: install Spin 6 and gcc by hand" >&2; exit 1; }; \
	  echo "make: installing spin (apt-get)"; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q spin >/dev/null 2>&1 || { \
	    $$SUDO apt-get update -q >/dev/null && \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q spin >/dev/null; } || { \
	    echo "make: apt-get could not install spin" >&2; exit 1; }; }
	@command -v gcc >/dev/null 2>&1 || { echo "make: gcc is missing; Spin's verifiers are C programs" >&2; exit 1; }

## docs: the documentation site, built into site/ in strict mode (a broken link, include or reference fails it)
# NO_MKDOCS_2_WARNING silences the theme's notice about its own end of life, which is not about these docs.
.PHONY: docs
docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

## wheel-check: build the wheel, install it into a fresh environment after CPU torch, use it outside the tree
# The wheel must bring no CUDA package along on a CPU machine, import from the installed copy,
# and run a 2-rank torchrun job (host backend, Triton's interpreter turned on by import).
wheel-check: | $(PY)
	rm -rf $(WHEEL_DIR) $(WHEEL_VENV)
	$(PIP) wheel --quiet --no-deps --wheel-dir $(WHEEL_DIR) .
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install --quiet $(TORCH_CPU)
	$(WHEEL_VENV)/bin/python -m pip install --quiet $(WHEEL_DIR)/symmsync-*.whl
	@if $(WHEEL_VENV)/bin/python -m pip list 2>/dev/null | grep -iE '^(nvidia|cuda)'; then \
	  echo "wheel-check: installing the wheel after CPU torch pulled the CUDA packages above" >&2; exit 1; fi
	cp examples/torchrun_job.py $(WHEEL_VENV)/job.py
	cd $(WHEEL_VENV) && env -u TRITON_INTERPRET -u PYTHONPATH bin/python -c \
	  "import symmsync, symmsync.language, symmsync.pcp, sys; \
	   assert 'site-packages' in symmsync.__file__, symmsync.__file__; \
	   print('wheel-check: symmsync', symmsync.__version__, 'imports from', symmsync.__file__)"
	cd $(WHEEL_VENV) && env -u TRITON_INTERPRET -u PYTHONPATH timeout 300 bin/python -m torch.distributed.run \
	  --nproc-per-node 2 --master-addr 127.0.0.1 --master-port $$(bin/python -c \
	  "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])") job.py

bench-fence: $(VENV)/.bench
	$(PY) benchmarks/fence.py

bench-pcp: $(VENV)/.bench
	$(PY) benchmarks/pcp_kv.py

doctor: $(VENV)/.base
	$(PY) -m symmsync doctor

lint: $(VENV)/.test
	$(PIP) install --quiet ruff
	$(PY) -m ruff check symmsync tests examples benchmarks verify

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis site
