"""A site whose xffl changes after submit (reinstalled between rounds). Round 1: its xffl is
of another exchange format through and through, so its trainer refuses the coordinator's
global before training. Round 2: its xffl reads this format but writes another (a real
trainer's update whose manifest then says format 99, as a newer xffl's would): the update is
rejected at aggregation. Each time the registry's reason names both formats and both xffl
versions, and the round goes on with the other site."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from tests.site_profiles.other_xffl import other_xffl_python
from xffl.cli.app import app
from xffl.core.versions import FORMAT_VERSION, xffl_version

runner = CliRunner()

#: a site's Python that trains with the real one, then writes its update's manifest as an
#: xffl 9.9.9 of exchange format 99 would (the manifest is not among the files it hashes)
NEWER_WRITER = """import json, subprocess, sys
from pathlib import Path
argv = sys.argv[1:]
code = subprocess.call([{real!r}, *argv])
manifest = Path(argv[argv.index("--out") + 1]) / "manifest.json" if "--out" in argv else None
if code == 0 and manifest is not None and manifest.is_file():
    data = json.loads(manifest.read_text())
    data.update(format_version=99, xffl_version="9.9.9")
    manifest.write_text(json.dumps(data))
sys.exit(code)
"""


def _round(run_id: str, rnd: int) -> dict[str, dict[str, object]]:
    """Run the next round; the sites' rows of round ``rnd`` in `xffl status --json`."""
    done = runner.invoke(app, ["round", run_id, "--json"])
    assert done.exit_code == 0, done.output
    shown = runner.invoke(app, ["status", run_id, "--json"])
    assert shown.exit_code == 0, shown.output
    status = json.loads(shown.stdout)
    row = next(r for r in status["rounds"] if r["round"] == rnd)
    return {s["site"]: s for s in row["sites"]}


@pytest.mark.slow
def test_an_update_of_another_format_is_rejected_at_aggregation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, xffl_home: Path) -> None:
    monkeypatch.chdir(tmp_path)  # no xffl.egg-info where the site's Python starts
    site = tmp_path / "alpha-site"
    site.mkdir()
    python = site / "python"  # at submit: this venv's xffl, which the version probe admits
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    profiles = tmp_path / "site_profiles"
    profiles.mkdir()
    (profiles / "alpha-python.yaml").write_text(yaml.safe_dump({
        "name": "alpha-python", "connector": {"type": "local"}, "python": str(python),
        "launcher": "none"}))
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    spec.update(name="otherformat", rounds=2, model={"preset": "tiny-test"},
                training={"steps": 2, "batch_size": 2, "seq_len": 16},
                failure={"min_sites": 1})
    for entry in spec["sites"]:
        entry.update(ranks=1)
        entry["data"].update(synthetic_sequences=32)
    spec["sites"][0]["profile"] = "alpha-python"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    submitted = runner.invoke(app, ["submit", str(job), "--no-start", "--trust-entry-point",
                                    "--json"])
    assert submitted.exit_code == 0, submitted.output
    run_id = json.loads(submitted.stdout)["run_id"]
    both = (f"format version 2 (written by xffl {xffl_version()}), where this xffl 9.9.9 "
            "reads format version 99")

    assert other_xffl_python(site) == python  # the site's xffl is now 9.9.9, format 99
    sites = _round(run_id, 1)
    assert sites["beta"]["state"] == "completed", sites
    assert sites["alpha"]["state"] == "failed", sites["alpha"]
    assert both in str(sites["alpha"]["reason"]), sites["alpha"]["reason"]

    python.write_text(f"#!{sys.executable}\n" + NEWER_WRITER.format(real=sys.executable))
    sites = _round(run_id, 2)
    assert sites["beta"]["state"] == "completed", sites
    assert sites["alpha"]["state"] == "rejected", sites["alpha"]
    assert (f"format version 99 (written by xffl 9.9.9), where this xffl {xffl_version()} "
            f"reads format version {FORMAT_VERSION}") in str(sites["alpha"]["reason"]), \
        sites["alpha"]["reason"]
    # the admitted update, written by beta's real trainer, names the xffl that wrote it
    shown = json.loads(runner.invoke(app, ["status", run_id, "--json"]).stdout)
    beta = json.loads((Path(shown["run_dir"]) / "rounds" / "2" / "updates" / "beta" /
                       "manifest.json").read_text())
    assert (beta["format_version"], beta["xffl_version"]) == (FORMAT_VERSION, xffl_version())
