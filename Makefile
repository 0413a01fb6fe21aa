# kvwatch: the two commands a newcomer runs are `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch. A GPU user overrides it (see docs/gpu.md), e.g.
#   make setup TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
TORCH           ?= torch==2.13.0
TORCH_INDEX_URL ?=
DEMO_DIR        ?= kvwatch-demo
# --no-compile: pip byte-compiles every module it installs (torch's alone is ~2/3 of its
# install time); Python compiles the few a process imports on first import instead.
PIP     := $(BIN)/pip install --quiet --disable-pip-version-check --no-compile
STAMP   := $(VENV)/.kvwatch-installed
RUNTIME := $(VENV)/.kvwatch-runtime

COMMA   := ,

ENGINES := vllm sglang
ENGINE_STAMPS := $(ENGINES:%=.venv-%/.kvwatch-installed)

.PHONY: runtime setup engines wheels demo test pytest pytest-engines lint docs docs-config docs-runbooks dashboards clean

# What the demo needs (runtime): torch's CPU wheel and kvwatch with its runtime dependencies;
# what the tests and linters add (setup): pytest and its plugins, mypy, ruff, playwright...
# setup installs both in one pass (a second pip pass re-resolves everything and rebuilds the
# editable install: tens of seconds), and counts as runtime too. Each step says what it
# installs (pip itself stays quiet).
# pip stays quiet for minutes on a cold cache: a line every 10 s says it is still at work
HEARTBEAT := bash -c '( while sleep 10; do echo "    ... still installing ($$SECONDS s)"; done ) & beat=$$!; "$$@"; rc=$$?; kill $$beat; exit $$rc' heartbeat
$(RUNTIME) $(STAMP): EXTRAS = $(if $(filter $@,$(STAMP)),engine$(COMMA)dev,engine)
$(RUNTIME) $(STAMP): pyproject.toml Makefile
	@echo "==> [1/3] creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [2/3] installing $(TORCH) (the CPU wheel; see docs/gpu.md for CUDA)"
	@$(HEARTBEAT) $(PIP) $(TORCH) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	@echo "==> [3/3] installing kvwatch and its runtime dependencies$(if $(filter $@,$(STAMP)),$(COMMA) and the development tools (tests, lint, types))"
	@$(HEARTBEAT) $(PIP) -e '.[$(EXTRAS)]'
	touch $(RUNTIME) $@

runtime: $(RUNTIME)
setup: $(STAMP)

# One venv per real engine (their pins conflict with each other and with ours).
.venv-%/.kvwatch-installed: engines/%/nodeps.txt engines/%/requirements.txt engines/build-venv.sh pyproject.toml probe/pyproject.toml
	PYTHON=$(PYTHON) TORCH='$(TORCH)' TORCH_INDEX_URL='$(TORCH_INDEX_URL)' bash engines/build-venv.sh $*

engines: $(ENGINE_STAMPS)

# The two distributions, as a release publishes them: kvwatch (collector, dashboard, CLI) and
# kvwatch-probe (what runs inside an engine: probe/pyproject.toml), into dist/.
wheels: setup
	$(BIN)/python -m build --wheel --outdir dist .
	$(BIN)/python -m build --wheel --outdir dist probe

demo: $(RUNTIME)
	@echo "==> running the demo (kvwatch demo --dir $(DEMO_DIR))"
	$(BIN)/kvwatch demo --dir $(DEMO_DIR)

# The three venvs build side by side (mostly downloads and unpacking): minutes off CI. Lint
# starts as soon as .venv is ready and each engine's suite as soon as its venv is, while the
# other venvs still build; then the main suite, which needs every venv and the cores.
# --output-sync: each target's output in one piece, not interleaved.
test:
	$(MAKE) -j3 --output-sync=target lint pytest-engines
	$(MAKE) pytest

# Two workers, a test module each at a time (module fixtures stay shared); the tests marked
# serial (one restarts PostgreSQL, which every other test uses; the live vLLM server's times
# a client's disconnect, and every test of that server shares its one start) run alone
# afterwards.
PYTEST_WORKERS ?= 2
pytest: setup engines
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not serial"
	$(BIN)/python -m pytest -m serial

# Tests that drive the engines' own classes in-process run inside each engine's venv.
pytest-engines: $(ENGINES:%=pytest-engines-%)
pytest-engines-%: .venv-%/.kvwatch-installed
	.venv-$*/bin/python -m pytest -p no:cacheprovider --confcutdir=tests/engines tests/engines/$*

# docs runs inside the recipe, after setup: as a prerequisite it would ask for the runtime
# venv, which make -j would build beside setup's, two pips in one venv at once
lint: setup
	$(MAKE) --no-print-directory docs
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The documentation site (mkdocs.yml): --strict fails on a broken link or anchor, or a page
# missing from the nav. docs/configuration.md is generated from the settings classes.
docs: $(RUNTIME)
	@$(BIN)/python -c "import mkdocs" 2>/dev/null || $(HEARTBEAT) $(PIP) -e '.[engine,docs]'
	$(BIN)/mkdocs build --strict --site-dir site

docs-config: setup
	$(BIN)/python -m kvwatch.docs_config > docs/configuration.md

# docs/runbooks.md is generated from the runbooks the package ships (policies/runbooks/).
docs-runbooks: setup
	$(BIN)/python -m kvwatch.docs_runbooks > docs/runbooks.md

# The Grafana dashboards (deploy/grafana/*.json) are generated: edit generate.py, then this.
dashboards: setup
	$(BIN)/python -m deploy.grafana.generate

clean:
	rm -rf $(VENV) $(ENGINES:%=.venv-%) $(DEMO_DIR) site .pytest_cache .mypy_cache .ruff_cache *.egg-info
