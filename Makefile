# The two set-up commands of the README: `make demo` (the main job) and `make test`.
# Both create or refresh .venv first. torch is pinned to 2.13.0 so that machines with a local CPU wheel use it
# instead of downloading a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(BIN)/python -m clients.swarm_demo

test: venv
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
