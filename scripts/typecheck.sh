#!/usr/bin/env bash
# mypy, strict, on a real xffl/ package tree. The repository maps xffl.<pkg> to the folder
# <pkg>/ (pyproject's package-dir), which mypy cannot follow; build/typecheck/xffl/<pkg> are
# symlinks to those folders, so every `from xffl.x import Y` is checked against Y itself.
# Extra arguments go to mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck
rm -rf "$tree" && mkdir -p "$tree/xffl"
packages=()
for pkg in $(.venv/bin/python scripts/packages.py); do
  ln -s "../../../$pkg" "$tree/xffl/$pkg"
  packages+=(-p "xffl.$pkg")
done
MYPYPATH="$tree" exec .venv/bin/mypy --config-file pyproject.toml "$@" "${packages[@]}"
