#!/usr/bin/env bash
# Builds .venv-NAME, the virtual environment one engine's tests run in (usage: NAME = vllm or
# sglang). vLLM and SGLang pin conflicting versions of their dependencies, and neither may
# pull a multi-GB CUDA torch: so each gets its own venv with the CPU torch on disk, the
# engine itself installed --no-deps (engines/NAME/nodeps.txt), the small dependencies its
# imports need (engines/NAME/requirements.txt), and the probe as an engine's image gets it:
# kvwatch-probe's wheel, built here by `python -m build` from probe/ and installed with its
# own declared dependencies (already pinned in requirements.txt: pip adds nothing, and
# fails if the wheel asked for more). Nothing is cached between runs. --no-compile: pip
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
"$venv/bin/pip" install --quiet --no-compile build
rm -rf "$venv/dist"
"$venv/bin/python" -m build --wheel --outdir "$venv/dist" probe > "$venv/build.log" 2>&1 \
    || { cat "$venv/build.log"; exit 1; }
before=$("$venv/bin/pip" list --format=freeze | sort)
"$venv/bin/pip" install --quiet --no-compile "$venv"/dist/kvwatch_probe-*.whl
added=$(comm -13 <(echo "$before") <("$venv/bin/pip" list --format=freeze | sort))
if [ "$(echo "$added" | grep -cv '^kvwatch-probe==')" != 0 ]; then
    echo "kvwatch-probe's wheel pulled more than itself into $venv:" >&2; echo "$added" >&2; exit 1
fi
touch "$venv/.kvwatch-installed"
