# Every target works on a fresh machine: `venv` creates .venv and installs the pinned stack.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint mutants bench clean

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

## demo: make sample frames, train the autoencoder on 1 and 2 CPU processes, print the scaling table, export ONNX
demo: $(STAMP)
	bash scripts/demo.sh

## test: the whole suite, as CI runs it; its report (.test-results.xml) spares make mutants the tests it proved
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20 --junitxml=.test-results.xml

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/mypy
	$(BIN)/lint-imports

## mutants: plant each known fault in a copy of the code, one at a time; fails if a fast test misses one (docs/testing.md)
mutants: $(STAMP)
	$(BIN)/python scripts/mutants.py

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf runs build *.egg-info
