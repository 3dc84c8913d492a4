# The two commands a new user runs (see README):
#   make demo   -- sets up a virtual environment when missing, then runs the main demo
#   make test   -- sets up a virtual environment when missing, then runs the test suite
# PYTHON selects the interpreter (CI runs both Python 3.11 and 3.12); each gets its own venv.
PYTHON ?= python3
PYVER := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
VENV ?= .venv-$(PYVER)
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
DEMO_ARGS ?= --out demo-out

.PHONY: demo test test-slow bench lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m hifigrad demo $(DEMO_ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -m "slow or not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/core_bench.py

lint: $(STAMP)
	$(VENV)/bin/python -m pip install -q ruff
	$(VENV)/bin/ruff check hifigrad tests benchmarks examples

clean:
	rm -rf .venv-* .pytest_cache
