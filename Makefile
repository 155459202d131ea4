# The two set-up commands of the README: `make demo` (the main job) and `make test`.
# Both create or refresh .venv first. torch is pinned to 2.13.0 so that machines with a local CPU wheel use it
# instead of downloading a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Test files run on this many pytest-xdist workers, each file on one worker (its module fixtures start once). The
# programs the tests start are forked from a process that imported torch once (tests/template.py), so they start in
# well under a second of CPU, and most tests then wait on timers: three workers fill a 2-core machine's idle time
# (four were 10% faster on 2026-11-28 with 89% of both cores busy; three keep some room). 0: one process.
TEST_WORKERS ?= 3

.PHONY: venv demo test clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(BIN)/python -m clients.swarm_demo

test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
