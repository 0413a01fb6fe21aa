#!/usr/bin/env bash
# Builds .venv-NAME, the virtual environment one engine's tests run in (usage: NAME = vllm or
# sglang). vLLM and SGLang pin conflicting versions of their dependencies, and neither may
# pull a multi-GB CUDA torch: so each gets its own venv with the CPU torch on disk, the
# engine itself installed --no-deps (engines/NAME/nodeps.txt), the small dependencies its
# imports need (engines/NAME/requirements.txt), and kvwatch without its dependencies (the
# probe's few are in requirements.txt). Nothing is cached between runs. --no-compile: pip
# byte-compiles every module it installs (most of the install's time, for modules the tests
# never import); Python compiles the ones a process imports on first import instead.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: engines/build-venv.sh vllm|sglang}
dir=engines/$name
venv=.venv-$name
python=${PYTHON:-python3}
torch=${TORCH:-torch==2.13.0}

rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --no-compile --upgrade pip
"$venv/bin/pip" install --quiet --no-compile "$torch" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$venv/bin/pip" install --quiet --no-compile --no-deps -r "$dir/nodeps.txt"
"$venv/bin/pip" install --quiet --no-compile -r "$dir/requirements.txt"
# one editable build of this checkout at a time (make builds the venvs side by side)
flock .editable.lock "$venv/bin/pip" install --quiet --no-compile --no-deps -e .
touch "$venv/.kvwatch-installed"
