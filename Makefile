# The two commands a new user runs (see README):
#   make demo   -- sets up a virtual environment with hifigrad[demo] when missing (only what the
#                  demo imports: flax, optax, rich, matplotlib), then runs the main demo
#   make test   -- sets up a virtual environment with hifigrad[test] when missing, then runs the
#                  whole default test suite (about 1710 tests; see docs/getting-started.md for its time)
#   make test-quick -- the same venv, a quick subset (QUICK below): a few minutes
# PYTHON selects the interpreter; each gets its own venvs.
# JAX selects a tested JAX release (one of ci/jax-*.txt, e.g. JAX=0.11.2): the venv then gets
# exactly the pinned packages of that file (what CI installs), in a venv of its own.
PYTHON ?= python3
JAX ?=
PYVER := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
VENV ?= .venv-$(PYVER)$(if $(JAX),-jax$(JAX))
PINS := $(if $(JAX),ci/jax-$(JAX).txt)
STAMP := $(VENV)/.installed-stamp
DEMO_VENV ?= .venv-$(PYVER)$(if $(JAX),-jax$(JAX))-demo
DEMO_STAMP := $(DEMO_VENV)/.installed-stamp
PYTEST_ARGS ?=
# The test targets run pytest in PYTEST_WORKERS processes (pytest-xdist, whole modules per
# process: a module's fixtures are built once; 0: one process, no xdist): a test run is mostly
# one XLA compile thread, so one process leaves a core of 2 idle. The default suite on 2 idle
# cores (JAX 0.10.2): 15 min 38 s in one process, 10 min 55 s in 2.
PYTEST_WORKERS ?= 2
# ... and share one JAX persistent compilation cache, new at each run and removed after it (the
# suite compiles many programs more than once: a test's jitted and staged twins, the same model
# in several modules); a JAX_COMPILATION_CACHE_DIR already set (CI's, shared by the lanes of a
# release) is used instead and kept.
# XLA:CPU compiles the tests' programs with LLVM at optimization level 1 (TEST_XLA_FLAGS; XLA's
# default is 3): the tests' programs are small and run a few times each, so generating their
# machine code is a large share of a test's time. On XLA:CPU the level is LLVM's code
# generation only: three programs of hg.grad over checkpoints compiled to the same optimized
# HLO, memory_analysis and gradient bits at 3 and at 1 (and the suite's bit-for-bit
# comparisons pass at 1; at level 0 one does not, so 0 is not used). Measured on jax 0.12.1,
# tests/test_checkpoint.py alone: 116 s at the default level, 96 s at 1; make test-quick back
# to back: 180 s against 154 s of tests. A user's XLA_FLAGS come after it, so theirs win;
# TEST_XLA_FLAGS= runs at XLA's default. Not used on a TPU (`make tpu-check`).
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=1
define pytest
	@set -e; \
	export XLA_FLAGS="$(strip $(TEST_XLA_FLAGS) $${XLA_FLAGS:-})"; \
	if [ -z "$${JAX_COMPILATION_CACHE_DIR:-}" ]; then \
		own=$$(mktemp -d "$${TMPDIR:-/tmp}/hifigrad-jax-cache.XXXXXX"); trap 'rm -rf "$$own"' EXIT; \
		export JAX_COMPILATION_CACHE_DIR=$$own JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
			JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1; \
	fi; \
	$(1) $(VENV)/bin/python -m pytest \
		$(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(2)
endef
DEMO_ARGS ?= --out demo-out
# The subset CI runs on the releases it does not test in full: the API, the rules, the
# checkpoints, the Flax wrappers, the census and the compat layer, each case jitted only (the
# releases tested in full run the eager variants, examples/ and the demo too).
# test_checkpoint's, test_rules' and test_flax's cases run one in two, in turn (tests/conftest.py's
# HIFIGRAD_TURNS: which half depends on the release, so the four subset releases share them out).
SUBSET_K ?= not eager
SUBSET ?= tests/test_api.py tests/test_rules.py tests/test_checkpoint.py tests/test_flax.py \
	tests/test_census.py tests/test_compat.py
SUBSET_TURNS ?= test_checkpoint=2 test_rules=2 test_flax=2

# The quick check a newcomer runs first (`make test-quick`): the public API, the checkpoints and
# the drop-in compression, the policies, dtypes and the interpreter, the README's quickstart,
# each case jitted only: 286 tests, 2 min 34 s on 2 idle cores in 2 processes (JAX 0.10.2,
# Python 3.11; see docs/getting-started.md).
QUICK_K ?= not eager
QUICK ?= tests/test_api.py tests/test_checkpoint.py tests/test_compress.py tests/test_policy.py \
	tests/test_dtypes.py tests/test_interpreter.py tests/test_readme.py

# The policy's choices on a TPU, taken on this machine (HIFIGRAD_PLATFORM=tpu: 'auto' resolves
# as on a TPU, coefficients 'tangent' and matmul 'fast'): the modules of the batch-sliced
# backward and its fuzzers, and the public API, jitted. CI runs it on one lane (.ci/run).
TPU_CHOICES ?= tests/test_checkpoint.py tests/test_compress.py tests/test_separable.py \
	tests/test_resize.py tests/test_primitives.py tests/test_policy.py tests/test_api.py

.PHONY: demo test test-quick test-subset test-slow test-all test-tpu-choices bench lint venv pins clean

venv: $(STAMP)

# $(call make_venv,DIR,EXTRA): a venv at DIR with hifigrad[EXTRA] installed (editable), with
# exactly the pinned packages of JAX=<release> when it is given. (pip byte-compiles what it
# installs, 49 of a [test] install's 65 CPU seconds, and that stays: with --no-compile, where
# PYTHONDONTWRITEBYTECODE is set (as on this machine), every process compiled jax and flax from
# source at import: CI's subset lanes, in 2 pytest processes and their children, took 287 and
# 307 s against 233 and 188 s.)
define make_venv
@if [ -n "$(JAX)" ] && [ ! -f "$(PINS)" ]; then \
	echo "no pins for JAX=$(JAX): tested releases are $$(ls ci | sed -n 's/^jax-\(.*\)\.txt$$/\1/p' | tr '\n' ' ')"; exit 2; fi
$(PYTHON) -m venv $(1)
$(1)/bin/python -m pip install -q --upgrade pip
$(1)/bin/python -m pip install -q -e '.[$(2)]' $(if $(PINS),-c $(PINS))
touch $(1)/.installed-stamp
endef

$(STAMP): pyproject.toml $(PINS)
	$(call make_venv,$(VENV),test)

# The demo's venv: hifigrad and its `demo` extra only (not the test suite's frameworks).
$(DEMO_STAMP): pyproject.toml $(PINS)
	$(call make_venv,$(DEMO_VENV),demo)

demo: $(DEMO_STAMP)
	$(DEMO_VENV)/bin/python -m hifigrad demo $(DEMO_ARGS)

test: $(STAMP)
	$(call pytest,,$(PYTEST_ARGS))

test-quick: $(STAMP)
	$(call pytest,,$(QUICK) -k "$(QUICK_K)" $(PYTEST_ARGS))

test-subset: $(STAMP)
	$(call pytest,HIFIGRAD_TURNS="$(SUBSET_TURNS)",$(SUBSET) -k "$(SUBSET_K)" $(PYTEST_ARGS))

test-tpu-choices: $(STAMP)
	$(call pytest,HIFIGRAD_PLATFORM=tpu,$(TPU_CHOICES) -k "not eager" $(PYTEST_ARGS))

# The second tier (`slow`: what was moved out of the default suite for its time, eager runs of
# cases whose jitted runs are in it, the fuzzers' next seeds, the benchmark scripts' tables):
# CI runs all of it on one lane each run. `make test` then `make test-slow` is everything CI runs
# on a release.
test-slow: $(STAMP)
	$(call pytest,,-m slow $(PYTEST_ARGS))

# Everything: the default suite, the `slow` tier and the exhaustive `sweep`s (every program of the
# corpus under every policy, dtype and eager/jit, the long fuzzers when HIFIGRAD_FUZZ_EXAMPLES=N).
test-all: $(STAMP)
	$(call pytest,,-m "slow or sweep or not (slow or sweep)" $(PYTEST_ARGS))

# Regenerates ci/jax-$(JAX).txt from a fresh, unpinned environment with that JAX release.
pins:
	@test -n "$(JAX)" || { echo "usage: make pins JAX=<release> [PYTHON=...]"; exit 2; }
	rm -rf .venv-pins
	$(PYTHON) -m venv .venv-pins
	.venv-pins/bin/python -m pip install -q --upgrade pip
	.venv-pins/bin/python -m pip install -q -e '.[test]' 'jax==$(JAX)'
	{ echo "# Pins for the test environment of jax $(JAX) (Python $(PYVER)), used by 'make test JAX=$(JAX)' and .ci/run."; \
	  echo "# Regenerate: make pins JAX=$(JAX) PYTHON=python$(PYVER) (pip freeze of a fresh environment)."; \
	  .venv-pins/bin/python -m pip freeze --exclude-editable; } > ci/jax-$(JAX).txt
	rm -rf .venv-pins

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/core_bench.py

lint: $(STAMP)
	$(VENV)/bin/python -m pip install -q ruff
	$(VENV)/bin/ruff check hifigrad tests benchmarks examples

clean:
	rm -rf .venv-* .pytest_cache

# The documentation site (mkdocs-material + mkdocstrings, mkdocs.yml), built in strict mode
# (any warning fails: a broken link, a missing reference, a malformed docstring) into site/.
# Its own venv, from the `docs` extra (pinned) plus flax and equinox for hifigrad.flax/.equinox.
DOCS_VENV ?= .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.installed-stamp

.PHONY: docs docs-serve

$(DOCS_STAMP): pyproject.toml
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install -q --upgrade pip
	$(DOCS_VENV)/bin/python -m pip install -q -e '.[docs,flax,equinox]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(DOCS_VENV)/bin/python -m mkdocs build --strict --site-dir site

# The site with its search box (search needs a server; site/ opened from disk has the pages
# and their links but no search): http://127.0.0.1:8000/
docs-serve: $(DOCS_STAMP)
	$(DOCS_VENV)/bin/python -m mkdocs serve

# The whole check on the lent GPU machine (benchmarks/gpu_check.sh): the test suite (pytest -n 14,
# junit), `hifigrad demo --quick` and benchmarks/gpu_bench.py, each time-limited (under 8 minutes
# on an H200), into OUT (default gpu-out: at most 8 files). It uses that machine's own python3
# (PYTHON=...) and this source tree (PYTHONPATH), no venv. GPU_CHECK_SMALL=1: a CPU dry run.
.PHONY: gpu-check

gpu-check:
	OUT=$(or $(OUT),gpu-out) PYTHON=$(PYTHON) bash benchmarks/gpu_check.sh

# The suite on the lent TPU machine (benchmarks/tpu_check.sh): one chunk of it per call, in one
# process (one program at a time holds the chip), junit per chunk, within a 10-minute call:
#   make tpu-check TPU_CHUNK=1/4 OUT=$$OUT   (then 2/4, 3/4, 4/4 in later calls; a third of
#   the suite took 520 s on a TPU v5e, so quarters leave room in a 10-minute call)
# It uses that machine's own python3 (PYTHON=...) and this source tree (PYTHONPATH), no venv;
# flax, optax and pytest-timeout come from the machine's own package index. BENCH=1 also runs
# benchmarks/tpu_bench.py after the suite.
.PHONY: tpu-check

tpu-check:
	OUT=$(or $(OUT),tpu-out) PYTHON=$(PYTHON) TPU_CHUNK=$(or $(TPU_CHUNK),1/1) \
		bash benchmarks/tpu_check.sh
