#!/usr/bin/env bash
# Download the wheels the one-GPU check carries to a machine with no network: what xffl's
# training, admission and aggregation import beyond what that machine's Python has (torch,
# numpy, safetensors, peft, pyyaml, jinja2 are there). The versions are this venv's, for
# CPython 3.12 on manylinux x86-64. The folder is git-ignored; `run` carries it (--carry).
set -euo pipefail
cd "$(dirname "$0")"
py=../../.venv/bin/python
pins=()
for pkg in pydantic pydantic-core annotated-types typing-inspection typing-extensions \
           transformers tokenizers huggingface-hub; do
  pins+=("$pkg==$("$py" -c "import importlib.metadata as m; print(m.version('$pkg'))")")
done
rm -rf wheels && mkdir -p wheels
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -d wheels "${pins[@]}"
du -sh wheels
