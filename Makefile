# Quick start: `make demo` and `make test` set everything up themselves; `make test-fast`
# (a few minutes) while iterating. docs/TESTING.md says what each runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-stamp
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast test-frameworks bench patches-report clean gpu-kit

setup: $(STAMP)

# torch is pinned: an unpinned torch would pull a multi-GB CUDA build. megatron-core 0.19.2
# declares Requires-Python >= 3.12 but ships a working cp311 wheel; its only hard deps are
# torch, numpy and packaging, installed here first (see README "Installing"). transformers is
# a test-only dependency (it does not depend on torch's wheel: it leaves torch as installed).
# pybind11 / psutil / tensorboard are what megatron.training (examples/megatron_lm) needs beyond
# megatron-core: its dataset helpers are built with pybind11, its checkpoint writers use psutil,
# --tensorboard-dir needs tensorboard. matplotlib draws the tools' PNGs (sweep, replay, capacity
# frontier, plan timeline); tqdm their progress bars.
# Re-run when the patch declarations change: `apply` adds new patches and leaves applied ones.
$(STAMP): setup.py Makefile megatron_patches/patching/declarations.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0 numpy==2.4.6 'packaging>=24.2' 'pytest>=8' 'hypothesis>=6'
	$(PIP) install -q --no-deps --ignore-requires-python megatron-core==0.19.2
	$(PIP) install -q transformers==5.23.0  # test-only: cross-checks tests/reference_impl.py
	$(PIP) install -q safetensors==0.8.0  # tools/replay.py checkpoints (also a transformers dep)
	$(PIP) install -q einops==0.8.1  # megatron.core.ssm (Mamba layers) needs it
	$(PIP) install -q pybind11==3.1.0 psutil==7.2.2 tensorboard==2.21.0  # megatron.training
	$(PIP) install -q matplotlib==3.10.7 tqdm==4.70.1  # tools/: plots (sweep, replay, capacity, plan, predict) and progress
	$(PIP) install -q httpx==0.28.1 fastapi==0.115.12 uvicorn==0.34.2 'openai[aiohttp]==1.99.9'  # megatron/rl imports (tests/test_megatron_rl_train_rl.py)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PY) -m megatron_patches apply
	touch $(STAMP)

demo: setup
	$(PY) examples/grpo_demo.py

# The framework tests (names with verl / train_rl, and tests/test_fw_*.py) run in `make test-frameworks` (CI runs both):
# once is enough, and there in the environment verl needs.
test: setup
	$(PY) -m pytest -q $(addprefix --ignore=,$(FW_TESTS)) $(PYTEST_ARGS) tests

# The fast tiers: plan / validator / simulator, attention, data, planner, traces, tools' output,
# import graph, patch registry on the installed Megatron -- everything not marked megatron, slow,
# versions or gpu, less the files that start processes (gloo ranks, fresh interpreters).
FAST_MARKERS := not megatron and not slow and not versions and not gpu
FAST_SKIP := test_cp_phase_c_memory.py test_cpu_support.py test_dist_harness.py \
	test_model_configs.py test_plan_tool.py
test-fast: setup
	$(PY) -m pytest -q -m "$(FAST_MARKERS)" $(addprefix --ignore=tests/,$(FAST_SKIP)) $(PYTEST_ARGS) tests

bench: setup
	$(PY) tools/bench.py

# The wheels a bare GPU machine lacks for `tools/gpu_check.py --quick` (docs/GPU.md), in .gpu-kit/
# (ignored by git, < 64 MiB), and the one command line to run there. Never downloads torch.
gpu-kit: setup
	$(PY) tools/gpu_kit.py --kit .gpu-kit

patches-report: setup
	$(PY) -m megatron_patches report

clean:
	rm -rf $(VENV) $(FW_VENV) build *.egg-info

# Framework tests (test names say verl / train_rl, or start with test_fw_) in their own venv: verl 0.9.1 pins transformers
# < 5.11 and tensordict <= 0.10 (ours: 5.23). torch goes in first, pinned, and everything else
# with --no-deps from a pinned list, so no CUDA torch is ever pulled.
FW_VENV := .venv-frameworks
FW_PY := $(FW_VENV)/bin/python
FW_STAMP := $(FW_VENV)/.setup-stamp
FW_TESTS := $(wildcard tests/test_*verl*.py tests/test_*train_rl*.py tests/test_fw_*.py)

$(FW_STAMP): setup.py Makefile tools/frameworks-requirements.txt megatron_patches/patching/declarations.py
	test -x $(FW_PY) || $(PYTHON) -m venv $(FW_VENV)
	$(FW_PY) -m pip install -q torch==2.13.0 numpy==2.4.6 'packaging>=24.2' 'pytest>=8' 'hypothesis>=6'
	$(FW_PY) -m pip install -q --no-deps --ignore-requires-python megatron-core==0.19.2
	$(FW_PY) -m pip install -q --no-deps verl==0.9.1 -r tools/frameworks-requirements.txt
	$(FW_PY) -m pip install -q --no-deps --no-build-isolation -e .  # verl's workers import megatron_patches from any directory (external_lib)
	$(FW_PY) -m megatron_patches apply
	touch $(FW_STAMP)

test-frameworks: $(FW_STAMP)
	PREFIX_REUSE_REQUIRE_FRAMEWORKS=1 $(FW_PY) -m pytest -q $(PYTEST_ARGS) $(FW_TESTS)
