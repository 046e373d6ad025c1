# Every target creates (once) and reuses the virtual environment .venv in the repo root.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.comera-installed
TORCH_VERSION ?= 2.13.0

# make test-torch TORCH=2.15.0: the suite on another torch release, in a venv of its own outside the repo.
TORCH ?=
TORCH_VENVS ?= $(HOME)/.cache/comera-compile/venvs
# make gpu-check: on a GPU machine, with its own python and torch (no venv, nothing downloaded).
GPU_PYTHON ?= python3
GPU_DEVICE ?= cuda
GPU_REPORT ?= gpu-check
GPU_ARGS ?=
# make gpu-pretrain: the 60M preset on a GPU machine's text (its python's site-packages unless GPU_DATA says),
# resumable: each method's run is kept in GPU_PRETRAIN_OUT as it finishes, and the same command trains the rest.
GPU_DATA ?= $(shell $(GPU_PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
GPU_PRETRAIN_OUT ?= runs/gpu-pretrain
GPU_PRETRAIN_ARGS ?= --preset 60m --methods dense,comera --steps 6104 --max-bytes 200000000
# make test: pytest-xdist workers (2: the CI machine's cores; each takes its share of torch's threads)
TEST_WORKERS ?= 2

.PHONY: install test test-slow test-device test-torch gpu-check gpu-pretrain demo inspect bench bench-quick clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[test,examples,bench]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -q -n $(TEST_WORKERS)

test-device: $(STAMP)  # the tests marked cuda, their code paths on the CPU
	$(PY) -m pytest -m cuda --device cpu -q

test-torch:
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=2.15.0 (a torch release from PyPI)"; exit 2; }
	test -x $(TORCH_VENVS)/torch-$(TORCH)/bin/python || $(PYTHON) -m venv $(TORCH_VENVS)/torch-$(TORCH)
	$(TORCH_VENVS)/torch-$(TORCH)/bin/python -m pip install --quiet "torch==$(TORCH)"
	$(TORCH_VENVS)/torch-$(TORCH)/bin/python -m pip install --quiet -e ".[test,examples,bench]"
	$(TORCH_VENVS)/torch-$(TORCH)/bin/python -m pytest -m "not slow" -q -p no:cacheprovider -n $(TEST_WORKERS)

gpu-check:  # wheels in .whl/ (galore-torch, bitsandbytes, ...) are installed first, from disk
	if ls .whl/*.whl >/dev/null 2>&1; then $(GPU_PYTHON) -m pip install --quiet --no-index --no-deps .whl/*.whl; fi
	$(GPU_PYTHON) -m pip install --quiet --no-index --no-deps --no-build-isolation -e .
	$(GPU_PYTHON) -m comera_compile.benchmarks.gpu_check --device $(GPU_DEVICE) --out $(GPU_REPORT) $(GPU_ARGS)

gpu-pretrain:  # 6,104 steps of 32 x 256 tokens: 50M tokens per method
	$(GPU_PYTHON) -m pip install --quiet --no-index --no-deps --no-build-isolation -e .
	$(GPU_PYTHON) -m comera_compile pretrain --device $(GPU_DEVICE) --data $(GPU_DATA) --out $(GPU_PRETRAIN_OUT) \
		--resume --no-progress $(GPU_PRETRAIN_ARGS)

test-slow: $(STAMP)  # pytest exits 5 when nothing is marked slow: not an error here
	$(PY) -m pytest -m slow -q -n $(TEST_WORKERS) || test $$? -eq 5

demo: $(STAMP)
	$(VENV)/bin/comera-compile demo

inspect: $(STAMP)
	$(VENV)/bin/comera-compile inspect --example six-encoder

bench: $(STAMP)
	$(VENV)/bin/comera-compile bench

bench-quick: $(STAMP)
	$(VENV)/bin/comera-compile bench --quick

clean:
	rm -rf $(VENV) build *.egg-info $(GPU_REPORT)
