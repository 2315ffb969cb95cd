# Every target makes its own virtual environment, so a fresh clone needs nothing else. The demo
# needs the package alone; the tests and benchmarks also PyTorch (a reference) and the test tools.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test bench clean

$(STAMP): setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP) Makefile
	$(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q "torch>=2.0"
	$(BIN)/pip install -q -e ".[test]"
	touch $(TEST_STAMP)

demo: $(STAMP)
	$(BIN)/python -m apps.demo

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(TEST_STAMP)
	@for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache
