#!/usr/bin/env bash
# The whole test suite on a fresh Debian machine as root: installs the system packages
# (SLURM, munge, sshd) and the venv, then runs lint, type checks and every test (slow ones
# included). The test fixtures start the two-cluster SLURM + sshd stack themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
# the suite's processes write the bytecode of what they import, once (setup-venv.sh writes
# it for torch, StreamFlow and cwltool; the rest would be compiled again in every process)
unset PYTHONDONTWRITEBYTECODE
bash scripts/install-system-deps.sh
bash scripts/setup-venv.sh
bash scripts/site-wheels.sh  # the wheels `xffl profiles install` tests build a wheelhouse from
.venv/bin/ruff check .
# mypy (one core, ~15 CPU-s) runs beside the suite's start-up (collection, the workers' SLURM
# stacks coming up); it prints its verdict when done and the script fails if it found anything
mkdir -p build
# (no cache: a fresh clone has none to reuse, and writing mypy's ~150 MB of it costs 7 CPU-s)
(rc=0; MYPY_CACHE_DIR=/dev/null bash scripts/typecheck.sh > build/typecheck.log 2>&1 || rc=$?
 cat build/typecheck.log; exit "$rc") &
typecheck=$!
# the docs site, strict (a broken link or anchor, or a page out of the nav, fails it; not
# --quiet, which hides the warnings strict mode counts), also beside the start-up
(rc=0; .venv/bin/mkdocs build --strict --clean -d build/site > build/mkdocs.log 2>&1 || rc=$?
 [ "$rc" -eq 0 ] || cat build/mkdocs.log; exit "$rc") &
docs=$!
# four workers (pytest-xdist), each with its own SLURM stack (tests/stack/fixtures.py). One
# runs the tests that wait out deadlines (idle for minutes: the ``waits`` mark) and the serial
# ones; the other three keep both cores busy while one of them waits on a SLURM poll or a
# sbatch (on 2026-11-29, 1755 tests: 3 workers without that split 603 s of pytest, 3 with it
# 581 s, 4 with it 481 s); XFFL_TEST_WORKERS=0 runs everything here.
# scripts/test_cost.py prints the run's CPU-seconds at the end, by process name: the SLURM
# jobs (slurmstepd) and the stacks' daemons included, which the workers never wait for
set +e
.venv/bin/python scripts/test_cost.py -- \
  .venv/bin/python -m pytest -p no:cacheprovider -n "${XFFL_TEST_WORKERS:-4}" --durations=15 \
  --dist loadgroup --no-loadscope-reorder "$@"
tests=$?
wait "$typecheck"
types=$?
wait "$docs"
site=$?
set -e
if [ "$types" -ne 0 ]; then
  echo "scripts/test.sh: mypy found problems (its output is above)" >&2
  exit 1
fi
if [ "$site" -ne 0 ]; then
  echo "scripts/test.sh: the docs site does not build (mkdocs' output is above)" >&2
  exit 1
fi
exit "$tests"
