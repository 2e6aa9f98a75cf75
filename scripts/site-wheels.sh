#!/usr/bin/env bash
# Fetch, once, the wheels of xffl's pinned dependencies (torch aside: a site's own) into
# build/site-wheels: the tests of `xffl profiles install` build a site's wheelhouse from this
# folder with no index (`--find-links build/site-wheels`), so that no test talks to one.
# About 118 MB (44 files: the coordinator's own packages are not a site's) for CPython 3.11
# on x86_64 Linux. Idempotent: pip skips files
# that are there already.
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/site-wheels
stamp="$out/.pins"
pins=$(.venv/bin/python -m xffl.site_profiles.pins)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$pins" ]; then
  echo "site-wheels: $out is up to date"
  exit 0
fi
mkdir -p "$out"
echo "site-wheels: fetching $(echo "$pins" | wc -l) pinned dependencies into $out"
# --no-deps: the pins are the whole closure already; sdists (packages without wheels) are
# kept as they are: the wheelhouse build turns the pure-Python ones into wheels
echo "$pins" | .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps \
  --prefer-binary -d "$out" -r /dev/stdin
echo "$pins" > "$stamp"
echo "site-wheels: done ($(du -sh "$out" | cut -f1))"
