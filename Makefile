# The two commands a new user runs: `make demo` (the main job) and `make test`.
# Both create .venv when missing and install torch 2.13.0 (the CPU wheel that
# pip finds on this machine's disk) before the package, so pip never reaches
# for a CUDA build. `make demo` installs only the package and what it needs;
# `make test` adds the test tools and the real client packages
# (requirements/clients*.txt) under requirements/constraints.txt, which pins
# torch==2.13.0 for the same reason. `make docs` builds the site in docs/ into
# build/docs (warnings are errors); `make lint` runs ruff and mypy.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.shardwise-installed

.PHONY: demo test docs lint bench wheel clean

CLIENTS := $(VENV)/.shardwise-clients-installed

# The package alone: what `make demo` needs.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c requirements/constraints.txt -e .
	touch $(STAMP)

# One stamp per extra, each installed once over the package (kept: not intermediate).
.PRECIOUS: $(VENV)/.shardwise-%-installed
$(VENV)/.shardwise-%-installed: $(STAMP)
	$(PY) -m pip install --quiet -c requirements/constraints.txt -e '.[$*]'
	touch $@

# The real Megatron-Core, PhysicsNeMo and TorchRec the client tests run against.
$(CLIENTS): $(VENV)/.shardwise-test-installed requirements/constraints.txt requirements/clients.txt requirements/clients-nodeps.txt
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
lint: $(VENV)/.shardwise-lint-installed
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m ruff format --check src tests benchmarks examples
	$(PY) -m mypy

# The documentation site (user guide, format, API reference from the docstrings).
docs: $(VENV)/.shardwise-docs-installed
	$(PY) -m sphinx -W --keep-going -q -b html docs build/docs
	@echo "docs: build/docs/index.html"

bench: $(STAMP)
	$(PY) -m shardwise bench layout

# The wheel a `pip install` gets, into dist/.
wheel: $(STAMP)
	$(PY) -m pip wheel --quiet --no-deps -w dist .

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
