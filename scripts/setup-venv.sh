#!/usr/bin/env bash
# Create or refresh the project's virtual environment in .venv (idempotent).
# torch is pinned to its CPU build here (scripts/torch-cpu.txt; the package itself accepts a
# range). Each step says what it does first: the first run takes about a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "setup-venv: $*"; }
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null; then
  echo "xffl needs Python >= 3.10 (found: $("$PY" --version 2>&1)); set PYTHON=/path/to/python3." >&2
  exit 2
fi
if ! "$PY" -c 'import venv, ensurepip' 2>/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-venv python3-dev >/dev/null
  else
    echo "python venv/ensurepip missing: install python3-venv." >&2; exit 2
  fi
fi
stamp=.venv/.xffl-installed
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c 'import xffl.cli.app' 2>/dev/null; then
  say ".venv is up to date"
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  say "creating .venv ($("$PY" --version 2>&1))"
  "$PY" -m venv .venv
fi
# uv resolves and installs in parallel: the same packages as pip, in a third of the time
# (80 s -> 28 s here). The local wheel folders pip is configured with (find-links: where a
# CPU build of torch may lie) are passed on, since uv reads no pip configuration.
say "installing uv into .venv (it installs the rest)"
.venv/bin/python -m pip install -q "uv>=0.5,<1"
links=()
local_torch=""
for d in $(.venv/bin/python -m pip config list 2>/dev/null \
           | sed -n "s/^.*find-links='\(.*\)'$/\1/p" | tr ' ' '\n' | sort -u); do
  links+=(--find-links "$d")
  local_torch+=$(ls "$d"/torch-*.whl 2>/dev/null || true)
done
torch_pin=$(grep -E '^torch[=<>~ ]' scripts/torch-cpu.txt)
# torch's CPU build from PyTorch's index (scripts/torch-cpu.txt), unless a local wheel folder
# holds a torch (then that one: no network for it) or .venv has the pinned one already; the
# install after it keeps that torch, which satisfies the pin
if [ -z "$local_torch" ] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  say "installing torch's CPU build ($torch_pin, no CUDA libraries)"
  .venv/bin/uv pip install -q --python .venv/bin/python -r scripts/torch-cpu.txt
fi
say "installing xffl and its dependencies ($torch_pin, transformers, StreamFlow, ...)"
.venv/bin/uv pip install -q --python .venv/bin/python "${links[@]}" "$torch_pin" -e '.[test]'
# Bytecode for what xffl's processes import (torch with its compiler stack, which
# torch.optim loads; StreamFlow; cwltool: ~3,700 modules), written once by importing them,
# in two processes side by side (11 s here). Compiling the whole venv instead (13,600
# modules) took 25 s on both cores. Without it, an environment that sets
# PYTHONDONTWRITEBYTECODE would compile torch again in every process.
say "compiling the bytecode of what xffl imports (torch, transformers, StreamFlow)"
warm() { env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c "$1"; }
warm 'import torch, torch._dynamo, torch.distributed.run, torch.distributed.fsdp, torch.distributed.tensor.parallel, xffl.training.__main__, transformers.models.llama.modeling_llama, transformers.models.auto.modeling_auto' &
torch_side=$!
warm 'import streamflow.main, cwltool.main, xffl.cli.app, xffl.workflows.supervisor'
wait "$torch_side"
echo "$want" > "$stamp"
say "done: .venv/bin/xffl"
