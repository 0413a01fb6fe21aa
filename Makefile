# kvwatch: the two commands a newcomer runs are `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch. A GPU user overrides it (see README, "GPU"), e.g.
#   make setup TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
TORCH           ?= torch==2.13.0
TORCH_INDEX_URL ?=
DEMO_DIR        ?= kvwatch-demo
STAMP  := $(VENV)/.kvwatch-installed

ENGINES := vllm sglang
ENGINE_STAMPS := $(ENGINES:%=.venv-%/.kvwatch-installed)

.PHONY: setup engines demo test pytest pytest-engines lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	# flock: the engine venvs install this checkout editable too, maybe at the same time
	flock .editable.lock $(BIN)/pip install --quiet -e '.[engine,dev]'
	touch $(STAMP)

setup: $(STAMP)

# One venv per real engine (their pins conflict with each other and with ours).
.venv-%/.kvwatch-installed: engines/%/nodeps.txt engines/%/requirements.txt engines/build-venv.sh pyproject.toml
	PYTHON=$(PYTHON) TORCH='$(TORCH)' TORCH_INDEX_URL='$(TORCH_INDEX_URL)' bash engines/build-venv.sh $*

engines: $(ENGINE_STAMPS)

demo: setup
	$(BIN)/kvwatch demo --dir $(DEMO_DIR)

# The three venvs build side by side (mostly downloads and unpacking): minutes off CI.
test:
	$(MAKE) -j3 setup engines
	$(MAKE) lint pytest pytest-engines

pytest: setup engines
	$(BIN)/python -m pytest

# Tests that drive the engines' own classes in-process run inside each engine's venv.
pytest-engines: engines
	$(foreach e,$(ENGINES),.venv-$(e)/bin/python -m pytest -p no:cacheprovider --confcutdir=tests/engines tests/engines/$(e) &&) true

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(ENGINES:%=.venv-%) $(DEMO_DIR) .pytest_cache .mypy_cache .ruff_cache *.egg-info
