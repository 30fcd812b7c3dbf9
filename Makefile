# The two commands a new user runs: `make demo` (the main job) and `make test`.
# Both create .venv when missing and install torch 2.13.0 (the CPU wheel that
# pip finds on this machine's disk) before the package, so pip never reaches
# for a CUDA build.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.shardwise-installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m shardwise demo

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) -m shardwise bench layout

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
