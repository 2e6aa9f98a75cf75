#!/usr/bin/env bash
# Set up everything on a fresh Debian machine (as root) and run the quickstart job:
# two "facilities" on this machine, 3 federated rounds of a tiny LLaMA-style model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
exec .venv/bin/xffl submit jobs/quickstart.yaml --wait "$@"
