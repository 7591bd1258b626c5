# Two commands: `make serve` and `make test`. Both create .venv and install the project when missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint format install llamacpp bench clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/switchboard serve

# llama.cpp's server for the remote-tier tests and the benchmarks' baseline: built for this CPU without AMX tiles and
# reinstalled when the venv's build was made for another instruction set (a no-op otherwise; bench/llamacpp_build.py).
llamacpp: $(STAMP)
	$(BIN)/python -m bench.llamacpp_build install

test: llamacpp
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean-venv:
	rm -rf $(VENV)
