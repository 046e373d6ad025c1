# Every target creates (once) and reuses the virtual environment .venv in the repo root.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.comera-installed
TORCH_VERSION ?= 2.13.0

.PHONY: install test test-slow demo inspect bench bench-quick clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[test,examples,bench]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -q

test-slow: $(STAMP)  # pytest exits 5 when nothing is marked slow: not an error here
	$(PY) -m pytest -m slow -q || test $$? -eq 5

demo: $(STAMP)
	$(VENV)/bin/comera-compile demo

inspect: $(STAMP)
	$(VENV)/bin/comera-compile inspect --example six-encoder

bench: $(STAMP)
	$(VENV)/bin/comera-compile bench

bench-quick: $(STAMP)
	$(VENV)/bin/comera-compile bench --quick

clean:
	rm -rf $(VENV) build *.egg-info
