"""A stand-in for the aggregate step: joins the updates that came back, in site order."""
import argparse
import json
import os
import sys

p = argparse.ArgumentParser()
p.add_argument("--round", type=int)
p.add_argument("--max-rounds", type=int)
p.add_argument("--min-sites", type=int)
p.add_argument("--update", action="append", default=[])
a = p.parse_args()
got = dict(u.split("=", 1) for u in a.update)
if len(got) < a.min_sites:
    print(f"round {a.round}: {len(got)} update(s), need {a.min_sites}", file=sys.stderr)
    sys.exit(1)
os.makedirs("global")
parts = []
for site in sorted(got):
    with open(os.path.join(got[site], "content")) as fh:
        parts.append(fh.read().strip())
with open("global/content", "w") as fh:
    fh.write("+".join(parts))
with open("cwl.output.json", "w") as fh:
    json.dump({"model": {"class": "Directory", "path": os.path.abspath("global")},
               "next_round": a.round + 1, "go": a.round < a.max_rounds}, fh)
