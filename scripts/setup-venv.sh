#!/usr/bin/env bash
# Create or refresh the project's virtual environment in .venv (idempotent).
# torch is pinned to the 2.13.0 CPU build here (the package itself accepts a range).
set -euo pipefail
cd "$(dirname "$0")/.."
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
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e '.[test]'
echo "$want" > "$stamp"
