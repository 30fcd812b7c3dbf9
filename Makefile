# The two commands a new user runs: `make demo` (the main job) and `make test`.
# Both create .venv when missing and install torch 2.13.0 (the CPU wheel that
# pip finds on this machine's disk) before the package, so pip never reaches
# for a CUDA build. `make test` also installs the real client packages
# (requirements/clients*.txt) under requirements/constraints.txt, which pins
# torch==2.13.0 for the same reason.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.shardwise-installed

.PHONY: demo test lint bench clean

CLIENTS := $(VENV)/.shardwise-clients-installed

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c requirements/constraints.txt -e '.[test]'
	touch $(STAMP)

# The real Megatron-Core, PhysicsNeMo and TorchRec the client tests run against.
$(CLIENTS): $(STAMP) requirements/constraints.txt requirements/clients.txt requirements/clients-nodeps.txt
	$(PY) -m pip install --quiet -c requirements/constraints.txt -r requirements/clients.txt
	$(PY) -m pip install --quiet -c requirements/constraints.txt --no-deps --ignore-requires-python \
		-r requirements/clients-nodeps.txt
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(CLIENTS)

demo: $(STAMP)
	$(PY) -m shardwise demo

test: $(CLIENTS)
	$(PY) -m pytest tests

# Lint and types on the package (CI runs this before the tests).
lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) -m shardwise bench layout

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
