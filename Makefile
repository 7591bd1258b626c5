# Two commands: `make serve` and `make test`. Both create .venv and install the project when missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint format install jail llamacpp bench clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The code jail's bubblewrap (grading/jail; Debian's package), installed where it is missing and we are root. Without
# it a root gateway runs no model- or prompt-written code: its checks say 'unavailable' (docs/verifiers.md#the-jail).
jail:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null; }; }; } || \
	  echo "bubblewrap is not installed (apt-get install bubblewrap): see docs/verifiers.md#the-jail"

serve: $(STAMP) jail
	$(BIN)/switchboard serve

# llama.cpp's server for the remote-tier tests and the benchmarks' baseline: built for this CPU without AMX tiles and
# reinstalled when the venv's build was made for another instruction set (a no-op otherwise; bench/llamacpp_build.py).
llamacpp: $(STAMP)
	$(BIN)/python -m bench.llamacpp_build install

test: llamacpp jail
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
