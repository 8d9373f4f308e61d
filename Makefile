# Two commands for a newcomer on a fresh machine: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# keras-hub's metadata requires tensorflow-text, which requires full `tensorflow`: pip would put it beside
# tensorflow-cpu. So keras-hub comes without its dependencies, plus the two that `import keras_hub` needs
# beyond Keras (its byte-pair tokenizers); kagglehub, sentencepiece and tensorflow-text are for presets
# and tokenizers this project does not use. The `[hub]` extra is for environments with full tensorflow.
KERAS_HUB := keras-hub==0.32.0
KERAS_HUB_DEPS := regex tokenizers

.PHONY: test-slow install demo test lint bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[cpu,test]"
	$(PY) -m pip install --quiet --no-deps "$(KERAS_HUB)"
	$(PY) -m pip install --quiet $(KERAS_HUB_DEPS)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/plan_demo.py

# make test runs its files on TEST_WORKERS processes (pytest-xdist), a file's tests in one process (its module
# fixtures built once): 8m28s with 2 on 2 cores, where one process took 14m19s
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" -n $(TEST_WORKERS) --dist loadfile
	$(PY) -m pytest -q -p no:cacheprovider --doctest-modules partitioner  # the docstrings' examples

# the tests marked slow (keras.applications models, minutes on 2 cores); CI runs them after `make test`
test-slow: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# `make bench` runs every benchmark in quick mode (about 20 minutes on 2 cores) and rewrites their tables;
# `make bench FULL=1` runs the long sweeps. Each benchmarks/*/README.md says what it measures.
BENCH_MODE := $(if $(FULL),--full,--quick)

bench: $(STAMP)
	$(PY) benchmarks/planner_speed/run.py $(BENCH_MODE)
	$(PY) benchmarks/planner_quality/run.py $(BENCH_MODE)
	$(PY) benchmarks/gpipe_scaling/run.py $(BENCH_MODE)
	$(PY) benchmarks/runtime/run.py $(if $(FULL),,--quick)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
