# Two commands on a fresh machine:
#   make train   set up .venv, train the quickstart GPT, print where the TensorBoard logs are
#   make train-llama   the same for a tiny Hugging Face Llama (examples/configs/llama_tiny.yaml)
#   make test    set up .venv if needed, run the test suite (the default tier)
# More tiers: make test-mp (multi-process pipelines, CLI and docs runs), make test-slow; make lint.
# Lightning's own tests with the strategy put in: make conformance FORM=async_pp|microbatches|none FOLDER=trainer
VENV ?= .venv
PYTHON ?= python3
# Pinned in the same pip call as the package so that pip never picks another (e.g. a CUDA) build.
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Each tier prints its 15 slowest tests.
PYTEST := $(PY) -m pytest -q --durations=15

.PHONY: train train-llama lint test test-mp test-slow conformance bench clean

# Not a tier: Lightning's test suite (tests/conformance/run.py; the summary under runs/conformance/).
FORM ?= async_pp
FOLDER ?= trainer

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)" -e ".[test,hf,research]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m lightning_async_pp fit --config examples/configs/quickstart.yaml

train-llama: $(STAMP)
	$(PY) -m lightning_async_pp fit --config examples/configs/llama_tiny.yaml

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(STAMP)
	$(PYTEST)

test-mp: $(STAMP)
	$(PYTEST) -m "multiprocess and not slow"

test-slow: $(STAMP)
	$(PYTEST) -m slow

conformance: $(STAMP)
	$(PY) -m pip install --quiet cloudpickle  # imported by some of Lightning's test modules
	$(PY) tests/conformance/run.py --form $(FORM) --folder $(FOLDER)

clean:
	rm -rf $(VENV) runs lightning_logs
