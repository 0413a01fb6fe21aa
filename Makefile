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

.PHONY: setup demo test pytest lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(BIN)/pip install --quiet -e '.[engine,dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/kvwatch demo --dir $(DEMO_DIR)

test: setup lint pytest

pytest: setup
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache .mypy_cache .ruff_cache *.egg-info
