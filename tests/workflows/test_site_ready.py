"""Refused before anything runs, with the fix: a LoRA job where peft is missing (on the
coordinator, at a site), and a local site whose data would fail round 1. The same data
cases on the SLURM sites of the test stack: tests/workflows/test_site_ready_stack.py."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner, Result

from tests.conftest import QUICKSTART
from tests.site_profiles.other_xffl import other_xffl_python, refusal
from tests.workflows.site_data import bad_data, write_shards
from xffl.cli.app import app
from xffl.jobs.spec.peft_check import PEFT_REQUIREMENT

runner = CliRunner()


def _no_runs() -> None:
    """Nothing registered: `xffl runs` lists no run."""
    listed = runner.invoke(app, ["runs", "--json"])
    assert listed.exit_code == 0 and json.loads(listed.stdout) == [], listed.output


def _init_sft_lora(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    done = runner.invoke(app, ["init", "-t", "sft-lora", "demo"])
    assert done.exit_code == 0, done.output
    return tmp_path / "demo" / "job.yaml"


def test_pinned_peft_is_the_core_dependency() -> None:
    """The install command names the version pyproject.toml installs with xffl."""
    text = (QUICKSTART.parents[1] / "pyproject.toml").read_text()
    core = text.split("dependencies = [", 1)[1].split("]", 1)[0]  # [project]'s own list
    assert f'"{PEFT_REQUIREMENT}"' in core


def test_lora_without_peft_is_refused_at_validate_and_submit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sft-lora template in a process where peft cannot be imported (sys.modules entry
    None: how Python itself models a missing package): exit 2, the install command."""
    job = _init_sft_lora(tmp_path, monkeypatch)
    monkeypatch.setitem(sys.modules, "peft", None)
    install = f"{shlex.quote(sys.executable)} -m pip install 'peft>=0.13,<1'"
    for command in ("validate", "submit"):
        done = runner.invoke(app, [command, str(job)])
        assert done.exit_code == 2, (command, done.output)
        assert install in done.output and "training.lora" in done.output, done.output
        assert "Traceback" not in done.output
    _no_runs()


def test_a_site_whose_python_lacks_peft_is_refused_at_submit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Site alpha's Python is a real one without site-packages (python -S), so without
    peft: submit names the site, its Python and the command that installs peft there."""
    job = _init_sft_lora(tmp_path, monkeypatch)
    site_python = tmp_path / "site-python"
    site_python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S "$@"\n')
    site_python.chmod(0o755)
    (tmp_path / "demo" / "site_profiles").mkdir()
    (tmp_path / "demo" / "site_profiles" / "bare.yaml").write_text(yaml.safe_dump({
        "name": "bare", "connector": {"type": "local"}, "python": str(site_python)}))
    spec = yaml.safe_load(job.read_text())
    spec["sites"][0]["profile"] = "bare"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    done = runner.invoke(app, ["submit", str(job)])
    assert done.exit_code == 2, done.output
    install = f"{site_python} -m pip install 'peft>=0.13,<1'"
    assert "site 'alpha'" in done.output and install in done.output.replace("\n", ""), \
        done.output
    _no_runs()


def _quickstart(tmp_path: Path, alpha_data: str) -> Path:
    """The quickstart with site alpha's data at ``alpha_data`` (not synthetic)."""
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["sites"][0]["data"] = {"path": alpha_data}
    spec["sites"][1]["data"]["path"] = str(tmp_path / "beta")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


@pytest.mark.parametrize("case", ["missing", "relative", "empty", "vocab"])
def test_bad_data_at_a_local_site_is_refused_at_submit(
        case: str, tmp_path: Path, xffl_home: Path) -> None:
    """Exit 2 naming the site and the folder; the folder's path does not run in the shell."""
    marker = tmp_path / "pwned"
    path, folder = bad_data(case, tmp_path, marker)
    folder = f"{xffl_home}/sites/alpha{folder}" if case == "relative" else folder
    done = runner.invoke(app, ["submit", str(_quickstart(tmp_path, path))])
    assert done.exit_code == 2, done.output
    text = " ".join(done.output.split())
    assert f"site 'alpha': its data.path folder {folder} " in text, text
    assert not marker.exists()
    _no_runs()


def test_a_relative_data_path_is_read_under_the_workdir(tmp_path: Path,
                                                         xffl_home: Path) -> None:
    """As the docs say: a relative data.path names a folder under the site's workdir."""
    write_shards(xffl_home / "sites" / "alpha" / "prepared", 4096)
    done = runner.invoke(app, ["submit", str(_quickstart(tmp_path, "prepared")), "--no-start",
                               "--json"])
    assert done.exit_code == 0, done.output


def test_profiles_check_data_shows_each_sites_folders(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`xffl profiles check local --data JOB`: a row per site of the job on that profile;
    alpha's folder tokenized for a larger vocabulary fails it (exit 1), beta's synthetic
    data passes."""
    monkeypatch.chdir(tmp_path)
    path, folder = bad_data("vocab", tmp_path, tmp_path / "pwned")
    done = runner.invoke(app, ["profiles", "check", "local", "--data",
                               str(_quickstart(tmp_path, path)), "--json"])
    assert done.exit_code == 1, done.output
    rows = {r["check"]: r for r in json.loads(done.stdout)["checks"]}
    assert not rows["data alpha"]["ok"] and rows["data beta"]["ok"], rows
    assert f"its data.path folder {folder} was tokenized for a vocabulary of 50000 tokens" in \
        rows["data alpha"]["detail"]


def _submit_on(tmp_path: Path, profile: str, python: Path) -> tuple[Path, Result]:
    """``xffl submit`` of the quickstart with site alpha on a local profile ``profile`` whose
    python is ``python``: the job file and the CLI's result."""
    profiles = tmp_path / "site_profiles"
    profiles.mkdir()
    (profiles / f"{profile}.yaml").write_text(yaml.safe_dump({
        "name": profile, "connector": {"type": "local"}, "python": str(python)}))
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["sites"][0]["profile"] = profile
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job, runner.invoke(app, ["submit", str(job), "--trust-entry-point"])


def test_a_site_whose_xffl_writes_another_format_is_refused_at_submit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, xffl_home: Path) -> None:
    """Site alpha's Python is a real one whose xffl is 9.9.9 of exchange format 99
    (tests/site_profiles/other_xffl.py): submit names the site, its Python, both xffl
    versions, both formats and the install command, and registers nothing."""
    monkeypatch.chdir(tmp_path)  # no xffl.egg-info in the folder the site's Python starts in
    python = other_xffl_python(tmp_path / "alpha")
    job, done = _submit_on(tmp_path, "other", python)
    assert done.exit_code == 2, done.output
    text = " ".join(done.output.split())
    assert refusal(job, python) in text, text
    assert "site 'beta'" not in text and "Traceback" not in text
    _no_runs()


@pytest.mark.parametrize("answer", ["missing", "garbage"])
def test_a_site_python_that_does_not_answer_the_probe_is_refused_at_submit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, xffl_home: Path, answer: str) -> None:
    """A profile's python that is not there, or that answers with an escape where the format
    should be: one line naming the site and that Python (the site's text not echoed)."""
    monkeypatch.chdir(tmp_path)
    python = tmp_path / "python"
    if answer == "garbage":
        python.write_text("#!/bin/sh\nprintf 'xffl-versions {\"format\": \"2\\033[2J\"}\\n'\n")
        python.chmod(0o755)
    _, done = _submit_on(tmp_path, "odd", python)
    assert done.exit_code == 2, done.output
    text = " ".join(done.output.split())
    assert f"site 'alpha': its Python {python} does not answer xffl's version probe (" in text
    why = "not found" if answer == "missing" else "it printed no answer the probe prints"
    assert why in text and "\x1b" not in done.output, text
    _no_runs()
