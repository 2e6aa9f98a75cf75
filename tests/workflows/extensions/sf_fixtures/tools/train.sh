#!/bin/bash
# A stand-in for a site's training step: SITE ROUND MODEL CTL.
# CTL/fail-SITE-rROUND holds how many more attempts fail (exit 3); CTL/sleep-SITE-rROUND
# how long the job sleeps first (a job that outlives the round's time limit).
# Every attempt appends when it started (seconds since the epoch) to CTL/started-SITE-rROUND.
set -eu
site=$1; round=$2; model=$3; ctl=$4
date +%s.%N >> "$ctl/started-$site-r$round" 2>/dev/null || true  # where ctl is writable
fail="$ctl/fail-$site-r$round"
if [ -f "$fail" ] && [ "$(cat "$fail")" -gt 0 ]; then
  echo $(( $(cat "$fail") - 1 )) > "$fail"
  echo "xffl.training (rank 0): $site cannot train round $round" >&2
  exit 3
fi
pause="$ctl/sleep-$site-r$round"
if [ -f "$pause" ]; then sleep "$(cat "$pause")"; touch "$ctl/woke-$site-r$round"; fi
mkdir -p update
echo "$site@$round($(cat "$model/content"))" > update/content
