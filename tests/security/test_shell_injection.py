"""A profile's ``env`` values and ``workdir`` never run as shell commands, locally or at a site.

StreamFlow 0.2.0rc3 builds every command line as ``cd {workdir} && export K="V" && ...``
(``streamflow.core.utils.create_command``), nothing quoted: a backtick, ``$(``, a ``"`` or a
newline in a value ran, on the coordinator for a local site. xffl's plugin puts
:func:`xffl.workflows.extensions.shell.create_command` in its place (each value shell-quoted: the
value arrives as literal text), and the profile schema refuses a workdir that is more than
plain path text (StreamFlow also joins it, unquoted, into mkdir, tar and sbatch command lines
at an SSH site) with its file and line. Each payload would ``touch`` a marker file; the
marker must never appear.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from streamflow.core import utils as sf_utils
from streamflow.core.deployment import ExecutionLocation
from streamflow.core.exception import WorkflowExecutionException
from streamflow.deployment.connector.local import LocalConnector
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from xffl.cli.app import app
from xffl.site_profiles.schema import SiteProfile
from xffl.workflows.extensions import shell as sf_shell
from xffl.workflows.extensions.connectors import XfflLocalConnector, XfflSlurmConnector
from xffl.workflows.plan.deployments import batch_script

STREAMFLOW = Path(sys.executable).with_name("streamflow")
runner = CliRunner()

# each runs `touch MARKER` if a shell reads the value as more than text
PAYLOADS = {
    "backticks": "`touch {m}`",
    "substitution": "$(touch {m})",
    "quote": '"; touch {m}; echo "',
    "semicolon": "; touch {m}; true",
    "newline": "x\ntouch {m}\n",
}
# which of them upstream's `cd {workdir} && export K="{value}"` runs (a `;` or a newline
# inside the double quotes is text; a `"` in the unquoted workdir only opens a string there,
# but breaks out of sbatch's `--chdir "{workdir}"`: test_xffl_slurm_refuses_...)
UPSTREAM_RUNS = {"env": {"backticks", "substitution", "quote"},
                 "workdir": {"backticks", "substitution", "semicolon", "newline"}}
# what CWL itself reads as an expression never reaches StreamFlow's command line: the
# schema refuses it (test_env_and_workdir_payloads_are_refused_at_validate)
CWL_SAFE = {k: v for k, v in PAYLOADS.items() if "$(" not in v}


def _run(connector: Any, workdir: str, environment: dict[str, str],
         job_name: str | None) -> str:
    """A real connector runs ``printf`` of the variable and ``pwd`` in a real shell."""
    location = ExecutionLocation(name="__LOCAL__", deployment="site", local=True)
    command = ["printf", "'%s|%s|end'", '"$XFFL_PROBE"', '"$PWD"']
    result = asyncio.run(connector.run(location, command, environment=environment,
                                       workdir=workdir, capture_output=True, timeout=60,
                                       job_name=job_name))
    assert result is not None
    return str(result[0])


@pytest.mark.parametrize("field", ["env", "workdir"])
@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_upstream_runs_the_payload_and_xffl_passes_it_as_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, name: str) -> None:
    marker = tmp_path / "pwned"
    value = PAYLOADS[name].format(m=marker)
    workdir = tmp_path / "work" / (value if field == "workdir" else "plain")
    workdir.mkdir(parents=True)  # the payload is a real folder's name (slashes nest it)
    environment = {"XFFL_PROBE": value if field == "env" else "plain"}
    connector = LocalConnector(deployment_name="site", config_dir=str(tmp_path))

    # StreamFlow 0.2.0rc3's own command line: the value runs
    monkeypatch.setattr(sf_utils, "create_command", sf_shell.upstream_create_command())
    _run(connector, str(workdir), environment, None)
    assert marker.exists() == (name in UPSTREAM_RUNS[field]), (name, field)
    marker.unlink(missing_ok=True)

    # xffl's adapter, as its StreamFlow plugin installs it: upstream's connector and xffl's
    # own (its job path builds the line itself), the value arrives as text
    monkeypatch.undo()
    sf_shell.install()
    for conn, job in ((connector, None), (XfflLocalConnector("site", str(tmp_path)), "j1")):
        out = _run(conn, str(workdir), environment, job)
        assert not marker.exists()
        assert out == f"{environment['XFFL_PROBE']}|{workdir}|end", out


def test_a_name_that_is_not_an_identifier_is_refused() -> None:
    with pytest.raises(WorkflowExecutionException, match="not a name"):
        sf_shell.create_command("x", ["true"], {"A;touch x;B": "1"})


def _job(tmp_path: Path, profile: dict[str, Any]) -> Path:
    """The quickstart, its one site on ``profile`` (written next to the job spec)."""
    (tmp_path / "site_profiles").mkdir(exist_ok=True)
    (tmp_path / "site_profiles" / "mine.yaml").write_text(yaml.safe_dump(profile))
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    spec["sites"] = spec["sites"][:1]
    spec["sites"][0]["profile"] = "mine"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path / "job.yaml"


SLURM_PROFILE = {"launcher": "srun", "slurm": {"partition": "debug"},
                 "connector": {"type": "ssh", "host": "127.0.0.1", "known_hosts": "/dev/null"}}


@pytest.mark.parametrize("kind", ["local", "slurm"])
@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_workdir_payloads_are_refused_at_validate(tmp_path: Path, kind: str, name: str) -> None:
    marker = tmp_path / "pwned"
    profile: dict[str, Any] = {"name": "mine", "workdir": f"/scratch/x{PAYLOADS[name]}"
                               .format(m=marker), **(SLURM_PROFILE if kind == "slurm" else {})}
    job = _job(tmp_path, profile)
    for command in (["validate"], ["render", "-o", str(tmp_path / "plan")]):
        result = runner.invoke(app, [*command, str(job)])
        assert result.exit_code == 2, result.output
        line = result.stderr.strip()
        assert "site_profiles/mine.yaml:" in line and "workdir" in line, line
        assert re.search("control character|unquoted to a shell|CWL reads", line), line
    assert not (tmp_path / "plan").exists() and not marker.exists()


@pytest.mark.parametrize(("env", "why"), [
    ({"X": "$(touch /tmp/pwned)"}, "CWL reads as an expression"),
    ({"A;touch /tmp/pwned;B": "1"}, "not a valid environment variable name"),
    ({"É": "1"}, "not a valid environment variable name"),
])
def test_env_values_cwl_would_evaluate_and_bad_names_are_refused_at_validate(
        tmp_path: Path, env: dict[str, str], why: str) -> None:
    job = _job(tmp_path, {"name": "mine", "env": env})
    result = runner.invoke(app, ["validate", str(job)])
    assert result.exit_code == 2, result.output
    assert "site_profiles/mine.yaml:" in result.stderr and why in result.stderr


def test_xffl_slurm_refuses_a_job_folder_sbatch_would_expand(tmp_path: Path) -> None:
    """Upstream writes ``sbatch --chdir "{workdir}"``: the folder must be plain path text."""
    marker = tmp_path / "pwned"
    (tmp_path / "t.j2").write_text("#!/bin/sh\n{{streamflow_command}}\n")
    connector = XfflSlurmConnector(
        deployment_name="site", config_dir=str(tmp_path), service=None,
        connector=LocalConnector(deployment_name="login", config_dir=str(tmp_path)),
        services={"train": {"file": "t.j2"}})
    location = ExecutionLocation(name="__LOCAL__", deployment="login", local=True)
    with pytest.raises(WorkflowExecutionException, match="refused to submit"):
        asyncio.run(connector._run_batch_command(
            "true", None, "j1", location, workdir=f"/tmp/`touch {marker}`"))
    assert not marker.exists()


# a one-step workflow: the site's tool writes its XFFL_P_* variables and its folder as JSON
# (and, in a SLURM job, the script SLURM ran)
_PROBE_PY = ("import json, os; json.dump({'env': {k: v for k, v in os.environ.items() "
             "if k.startswith('XFFL_P_')}, 'pwd': os.getcwd()}, open('probe.json', 'w'))")
TOOL_LINE = (f"{shlex.quote(sys.executable)} -c {shlex.quote(_PROBE_PY)} && "
             'if [ -n "$SLURM_JOB_ID" ]; then '
             'scontrol write batch_script "$SLURM_JOB_ID" script.txt; fi')


def _streamflow_run(tmp_path: Path, env: dict[str, str], deployments: dict[str, Any],
                    target: dict[str, Any]) -> dict[str, Any]:
    """``streamflow run`` the tool (xffl's plugin loaded from its entry point): its probe."""
    (tmp_path / "tool.cwl").write_text(yaml.safe_dump({
        "cwlVersion": "v1.2", "class": "CommandLineTool",
        "requirements": {"EnvVarRequirement": {"envDef": env}},
        "baseCommand": ["bash", "-c"], "arguments": [TOOL_LINE], "inputs": [],
        "outputs": {"probe": {"type": "File", "outputBinding": {"glob": "probe.json"}}}}))
    (tmp_path / "inputs.yml").write_text("{}\n")
    (tmp_path / "streamflow.yml").write_text(yaml.safe_dump({
        "version": "v1.0",
        "workflows": {"probe": {"type": "cwl", "config": {"file": "tool.cwl",
                                                          "settings": "inputs.yml"},
                                "bindings": [{"step": "/", "target": target}]}},
        "deployments": deployments,
        "database": {"type": "default", "config": {"connection": str(tmp_path / "sf.db")}}}))
    proc = subprocess.run([str(STREAMFLOW), "run", "streamflow.yml", "--outdir", "out"],
                          cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    probe: dict[str, Any] = json.loads((tmp_path / "out" / "probe.json").read_text())
    return probe


def _probe_env(marker: Path) -> dict[str, str]:
    return {f"XFFL_P_{k}": v.format(m=marker) for k, v in CWL_SAFE.items()}


def test_a_local_site_gets_the_payloads_as_text(tmp_path: Path) -> None:
    """A real StreamFlow run on ``xffl-local``: a workdir and variables full of payloads."""
    marker = tmp_path / "pwned"
    env = _probe_env(marker)
    workdir = tmp_path / f"w`touch {marker}`;touch {marker}"
    probe = _streamflow_run(tmp_path, env, {"site": {
        "type": "xffl-local", "config": {}, "workdir": str(workdir)}}, {"deployment": "site"})
    assert not marker.exists()
    assert probe["env"] == env
    assert Path(probe["pwd"]).parent == workdir  # the job's folder, under the workdir


@pytest.mark.slow
def test_a_slurm_site_runs_what_the_render_shows(tmp_path: Path, slurm_stack: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A real StreamFlow run through xffl-slurm at cluster beta, with xffl's batch template of
    a profile whose variables are payloads: nothing runs, the job gets the values as text,
    and the script SLURM ran holds each ``export`` line of the rendered ``sbatch/<site>.sh``.
    """
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)  # asyncssh reads ~/.ssh/known_hosts
    cluster = slurm_stack.clusters["beta"]
    workdir = Path(cluster.work_dir) / f"inject-{secrets.token_hex(3)}"
    marker = workdir / "pwned"  # where the job, and the login node, could write
    env = _probe_env(marker)
    profile = SiteProfile(name="beta", slurm={"partition": cluster.partition, "time": "5"},
                          launcher="srun", env=env, workdir=str(workdir))
    by_hand = batch_script("inject", "beta", profile, 1, "data", by_hand=True)
    (tmp_path / "beta.j2").write_text(batch_script("inject", "beta", profile, 1, "data",
                                                   by_hand=False))
    login = {"nodes": [f"127.0.0.1:{cluster.ssh_port}"], "username": slurm_stack.user,
             "sshKey": slurm_stack.ssh_key, "checkHostKey": True,
             "knownHosts": slurm_stack.known_hosts}
    probe = _streamflow_run(tmp_path, env, {
        "login": {"type": "xffl-ssh", "config": login, "workdir": str(workdir)},
        "site": {"type": "xffl-slurm", "wraps": "login", "workdir": str(workdir), "config": {
            "pollingInterval": 1, "services": {"train": {"file": "beta.j2"}}}},
    }, {"deployment": "site", "service": "train"})
    assert not marker.exists()
    assert probe["env"] == env
    script = next(workdir.rglob("script.txt")).read_text()
    for key, value in env.items():  # the render's line, byte for byte, in what SLURM ran
        line = f"export {key}={shlex.quote(value)}\n"
        assert line in by_hand and line in script, (line, script)
        # and StreamFlow's own export of the tool's variable, before the command: the same text
        assert f"export {key}={shlex.quote(value)} && " in script, (key, script)
