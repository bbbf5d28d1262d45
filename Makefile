# cords-vllm: the two commands of the README are `make demo` and `make test`.
# Both create the project's virtualenv (.venv) on first use and reuse it afterwards.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.cords-vllm-installed
PYTEST_ARGS ?=

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1

.PHONY: setup demo test test-slow lint clean-venv

$(STAMP): pyproject.toml scripts/setup-env.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup-env.sh

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m cords_vllm.lab.demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean-venv:
	rm -rf $(VENV)
