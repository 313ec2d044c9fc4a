# Set-up is part of both targets: a virtual environment in .venv with an editable install, which also
# compiles the exit-recording shim (setup.py; skipped with a warning where no C compiler is found).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

$(STAMP): pyproject.toml setup.py engine/cron/_shim.c engine/_spawn_direct.c
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

.PHONY: setup demo test lint
setup: $(STAMP)

# The main job: the supervisor, the service and its agent tool, then the standalone engine, on real input.
demo: $(STAMP)
	$(PY) docs/examples/demo.py
	$(PY) docs/examples/service_demo.py
	$(PY) docs/examples/standalone_demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check engine tests benchmarks docs/examples
	$(VENV)/bin/ruff format --check engine tests benchmarks docs/examples
	$(VENV)/bin/mypy

# Two passes: the tests without time bounds two at a time (pytest-xdist; each worker is a test session of
# its own, with its own marker, temp dir and PostgreSQL), then the serial and machine-wide ones alone, so
# the kill budgets are measured on an otherwise idle machine. Plain `pytest` runs all of them in one.
test: lint
	$(VENV)/bin/pytest -n 2 --dist worksteal -m "not serial and not machine_wide"
	$(VENV)/bin/pytest -m "serial or machine_wide"
