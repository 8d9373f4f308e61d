# Two commands for a newcomer on a fresh machine: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[tf,test,bench]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/plan_demo.py

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/planner/run.py $(if $(FULL),--full,)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
