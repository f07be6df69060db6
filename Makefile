# The two set-up commands (see README): `make demo` and `make test`. Each creates .venv on a
# fresh machine, installs torch 2.13.0 first (the CPU wheel; an unpinned torch would pull a
# multi-GB CUDA build), then the project.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
DEMO_DIR ?= demo

.PHONY: demo test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	$(PIP) "torch==2.13.0"
	touch $@

$(VENV)/.installed-demo: pyproject.toml $(VENV)/.torch
	$(PIP) -e ".[encode,train]"
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.torch
	$(PIP) -e ".[dev]"
	touch $@

demo: $(VENV)/.installed-demo
	$(PY) -m mmcache.precompute.demo --out $(DEMO_DIR)

# One process per CPU this job may use (its affinity, not the host's cores: a container of 2 CPUs on
# a big host), at most 4, each taking whole test files (their module fixtures are built once): most
# tests wait on ranks, workers and servers they start, so two CPUs run the suite in ~60 % of the
# time one process takes.
TEST_PROCS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1))")
test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n $(TEST_PROCS) --dist loadfile

# ruff (a small rule set) and mypy (lenient, on the packages): both configured in pyproject.toml.
lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: $(VENV)/.installed-test
	$(PY) benchmarks/featstore_bench.py

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache
