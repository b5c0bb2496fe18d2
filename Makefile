# Two commands on a fresh machine:
#   make train   set up .venv, train the quickstart GPT, print where the TensorBoard logs are
#   make train-llama   the same for a tiny Hugging Face Llama (examples/configs/llama_tiny.yaml)
#   make test    set up .venv if needed, run the test suite
VENV ?= .venv
PYTHON ?= python3
# Pinned in the same pip call as the package so that pip never picks another (e.g. a CUDA) build.
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train train-llama test test-slow bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)" -e ".[test,hf,research]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m lightning_async_pp fit --config examples/configs/quickstart.yaml

train-llama: $(STAMP)
	$(PY) -m lightning_async_pp fit --config examples/configs/llama_tiny.yaml

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs lightning_logs
