"""On the test stack's SLURM sites, over their SSH logins: a job whose site data folder is
missing, relative, empty or tokenized for a larger vocabulary is refused at submit, naming
the site and the folder, with nothing registered and no job in either cluster's queue. The
missing folder's path also holds ``; touch MARKER``, which must not run in the site's shell."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from tests.site_profiles.other_xffl import other_xffl_python, refusal
from tests.stack.profiles import write_profile
from tests.stack.stack import StackInfo
from tests.workflows.site_data import bad_data
from xffl.cli.app import app

runner = CliRunner()


def _queued(stack: StackInfo, prefix: str) -> list[str]:
    """The names of the jobs in both clusters' queues (squeue) that start with ``prefix``."""
    names: list[str] = []
    for cluster in ("alpha", "beta"):
        names += subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True,
                                env=stack.slurm_env(cluster), timeout=60,
                                check=True).stdout.split()
    return [n for n in names if n.startswith(prefix)]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "relative", "empty", "vocab"])
def test_bad_site_data_is_refused_before_the_queue(case: str, tmp_path: Path,
                                                   slurm_stack: StackInfo) -> None:
    profiles = tmp_path / "site_profiles"
    profiles.mkdir()
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec.update(name=f"data-{case}", rounds=1)
    for site in spec["sites"]:
        site.update(ranks=1, profile=write_profile(
            profiles, slurm_stack.clusters[site["name"]], slurm_stack))
        site["data"]["path"] = str(tmp_path / "data" / site["name"])  # synthetic: not checked
    marker = tmp_path / "pwned"
    path, folder = bad_data(case, tmp_path, marker)
    if case == "relative":  # read under alpha's workdir, where nothing was prepared
        folder = f"{slurm_stack.clusters['alpha'].work_dir}{folder}"
    spec["sites"][0]["data"] = {"path": path}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))

    done = runner.invoke(app, ["submit", str(job), "--json"])
    assert done.exit_code == 2, done.output
    text = " ".join(done.output.split())
    assert f"site 'alpha': its data.path folder {folder} " in text, text
    assert not marker.exists()  # the path reached the site's shell as one quoted word
    listed = runner.invoke(app, ["runs", "--json"])
    assert listed.exit_code == 0 and json.loads(listed.stdout) == [], listed.output
    assert _queued(slurm_stack, f"xffl-data-{case}") == []


@pytest.mark.slow
def test_a_lora_job_is_refused_where_a_sites_python_lacks_peft(tmp_path: Path,
                                                                slurm_stack: StackInfo) -> None:
    """Site alpha's Python (a real one, without site-packages: python -S) is asked over its
    SSH login whether it can import peft; it cannot, so submit names the site, that Python
    and the command that installs peft there, and queues nothing."""
    profiles = tmp_path / "site_profiles"
    profiles.mkdir()
    bare = tmp_path / "bare python"  # a space: the name reaches the site's shell quoted
    bare.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S "$@"\n')
    bare.chmod(0o755)
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec.update(name="nopeft", rounds=1)
    spec["training"]["lora"] = {"r": 4, "target_modules": ["q_proj"]}
    for site in spec["sites"]:
        site.update(ranks=1, profile=write_profile(
            profiles, slurm_stack.clusters[site["name"]], slurm_stack))
        site["data"]["path"] = str(tmp_path / "data" / site["name"])
    alpha = profiles / f"{spec['sites'][0]['profile']}.yaml"
    alpha.write_text(yaml.safe_dump({**yaml.safe_load(alpha.read_text()), "python": str(bare)}))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    done = runner.invoke(app, ["submit", str(job)])
    assert done.exit_code == 2, done.output
    text = " ".join(done.output.split())
    assert f"site 'alpha': its Python {bare} cannot import peft" in text, text
    assert f"`{shlex.quote(str(bare))} -m pip install 'peft>=0.13,<1'`" in text, text
    assert "site 'beta'" not in text  # beta's Python has it
    assert _queued(slurm_stack, "xffl-nopeft") == []


@pytest.mark.slow
def test_a_site_whose_xffl_writes_another_format_is_refused_before_the_queue(
        tmp_path: Path, slurm_stack: StackInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    """Site alpha's profile names a Python in alpha's workdir whose xffl is 9.9.9 of exchange
    format 99 (a real interpreter: tests/site_profiles/other_xffl.py), asked over alpha's SSH
    login: submit names the site, both versions and the install command (exit 2), registers
    nothing and queues nothing in either cluster; `xffl profiles check` shows the same."""
    profiles = tmp_path / "site_profiles"
    profiles.mkdir()
    workdir = Path(slurm_stack.clusters["alpha"].work_dir)
    python = other_xffl_python(workdir / f"other-xffl-{tmp_path.name}")
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec.update(name="otherxffl", rounds=1)
    for site in spec["sites"]:
        site.update(ranks=1, profile=write_profile(
            profiles, slurm_stack.clusters[site["name"]], slurm_stack))
        site["data"]["path"] = str(tmp_path / "data" / site["name"])
    alpha = profiles / f"{spec['sites'][0]['profile']}.yaml"
    alpha.write_text(yaml.safe_dump({**yaml.safe_load(alpha.read_text()),
                                     "python": str(python)}))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    done = runner.invoke(app, ["submit", str(job)])
    assert done.exit_code == 2, done.output
    text = " ".join(done.output.split())
    assert refusal(job, python, alpha.stem) in text, text
    assert "site 'beta'" not in text and "Traceback" not in text
    listed = runner.invoke(app, ["runs", "--json"])
    assert listed.exit_code == 0 and json.loads(listed.stdout) == [], listed.output
    assert _queued(slurm_stack, "xffl-otherxffl") == []
    monkeypatch.chdir(tmp_path)  # where `profiles check` finds site_profiles/
    checked = runner.invoke(app, ["profiles", "check", alpha.stem, "--json"])
    assert checked.exit_code == 1, checked.output
    rows = {r["check"]: r for r in json.loads(checked.stdout)["checks"]}
    assert not rows["exchange format"]["ok"] and "xffl 9.9.9" in rows["exchange format"]["detail"]
    assert "xffl 9.9.9 (exchange format 99)" in rows["versions"]["detail"], rows
