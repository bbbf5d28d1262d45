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

# The suite in two passes, so that it fits 20 minutes on 2 cores: first every test that leaves the cores free to
# share (the pure core, single-threaded under Triton's interpreter, and `vllm serve` subprocesses, which mostly wait)
# on TEST_WORKERS pytest-xdist workers, a test file per worker at a time (a module's server starts once); then, one
# at a time, the tests that run a vLLM engine in this process (it uses every core) or keep pace with a wall clock
# (marked `serial`). Both passes run whatever the other found; a pass with nothing selected (PYTEST_ARGS naming a
# subset) is not a failure, both with nothing selected is. TEST_WORKERS=0 runs the first pass in this process.
TEST_WORKERS ?= 2
SHARED := not slow and not engine and not serial
ALONE := not slow and (engine or serial)

test: $(STAMP)
	@run() { "$$@"; rc=$$?; [ $$rc -ne 0 ] || ran=1; [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || status=1; }; \
	status=0; ran=0; \
	echo "==> tests that share the cores ($(TEST_WORKERS) workers)"; \
	run $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "$(SHARED)" $(PYTEST_ARGS); \
	echo "==> tests that need the cores to themselves (one at a time)"; \
	run $(PY) -m pytest -m "$(ALONE)" $(PYTEST_ARGS); \
	[ $$ran -eq 1 ] || [ $$status -ne 0 ] || { echo "make test: no test selected" >&2; status=5; }; \
	exit $$status

test-slow: $(STAMP)
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean-venv:
	rm -rf $(VENV)
