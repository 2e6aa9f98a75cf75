#!/usr/bin/env bash
# The whole test suite on a fresh Debian machine as root: installs the system packages
# (SLURM, munge, sshd) and the venv, then runs lint, type checks and every test (slow ones
# included). The test fixtures start the two-cluster SLURM + sshd stack themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-system-deps.sh
bash scripts/setup-venv.sh
.venv/bin/ruff check .
bash scripts/typecheck.sh
# two workers (pytest-xdist), each with its own SLURM stack (tests/stack/fixtures.py);
# XFFL_TEST_WORKERS=0 runs everything in this process
exec .venv/bin/python -m pytest -p no:cacheprovider -n "${XFFL_TEST_WORKERS:-2}" \
  --dist loadgroup "$@"
