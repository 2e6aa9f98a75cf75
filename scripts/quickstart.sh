#!/usr/bin/env bash
# Set up everything on a fresh Debian machine (as root) and run the quickstart job:
# two "facilities" on this machine, 3 federated rounds of a tiny LLaMA-style model.
# It says what it does before each step (the first set-up takes about a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "quickstart: setting up .venv first (uv, torch's CPU build, xffl; about a minute the" \
     "first time), then the quickstart job (2 sites on this machine, 3 rounds)"
bash scripts/setup-venv.sh
echo "quickstart: xffl submit examples/quickstart.yaml --wait"
exec .venv/bin/xffl submit examples/quickstart.yaml --wait "$@"
