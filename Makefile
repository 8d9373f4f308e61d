# Two commands for a newcomer on a fresh machine: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[cpu,test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/plan_demo.py

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# `make bench` runs every benchmark in quick mode (about 15 minutes on 2 cores) and rewrites their tables;
# `make bench FULL=1` runs the long sweeps. Each benchmarks/*/README.md says what it measures.
BENCH_MODE := $(if $(FULL),--full,--quick)

bench: $(STAMP)
	$(PY) benchmarks/planner_speed/run.py $(BENCH_MODE)
	$(PY) benchmarks/planner_quality/run.py $(BENCH_MODE)
	$(PY) benchmarks/gpipe_scaling/run.py $(BENCH_MODE)
	$(PY) benchmarks/runtime/run.py $(if $(FULL),,--quick)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
