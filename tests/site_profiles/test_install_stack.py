"""`xffl profiles install` against the test stack's sshd (site alpha): from an empty workdir
it makes the venv from a wheelhouse built here and uploaded, while the site's pip has an
index on 127.0.0.1 that counts requests and sees none; a SLURM round then trains with that
venv; a second install changes nothing on disk and runs no pip; a site whose xffl is
another version is refused at submit, queueing nothing. Each bad answer of a site (no
python3, no venv module, a full disk, a quota, an unreachable index) is one line with the
fix, and leaves nothing current."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.cli.schemas import check
from tests.conftest import QUICKSTART
from tests.site_profiles.other_xffl import other_xffl_python, refusal
from tests.site_profiles.site_install import (
    SITE_WHEELS,
    counting_index,
    install_profile,
    torch_module,
)
from tests.stack.profiles import write_profile
from tests.stack.stack import StackInfo
from xffl.cli.app import app
from xffl.core.versions import xffl_version

runner = CliRunner()
pytestmark = pytest.mark.slow


@dataclass
class Installed:
    """The module's one install: the profiles folder, alpha's profile, workdir, home."""

    folder: Path
    profile: Path
    workdir: Path
    home: Path
    output: str
    index_requests: list[str]


def _install(folder: Path, *extra: str) -> tuple[int, str, str]:
    """`xffl profiles install test-alpha` from ``folder`` (where site_profiles/ is): its exit
    code, output (stderr's progress included) and stdout."""
    cwd = Path.cwd()
    os.chdir(folder)
    try:
        done = runner.invoke(app, ["profiles", "install", "test-alpha", "--find-links",
                                   str(SITE_WHEELS), *extra])
    finally:
        os.chdir(cwd)
    return done.exit_code, done.output, done.stdout


@pytest.fixture(scope="module")
def installed(slurm_stack: StackInfo, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[Installed]:
    """One install at alpha from an empty workdir, shared by the tests that read it."""
    if not (SITE_WHEELS / ".pins").is_file():
        pytest.fail(f"{SITE_WHEELS} is missing: run scripts/site-wheels.sh (scripts/test.sh "
                    "does)", pytrace=False)
    root = tmp_path_factory.mktemp("install")
    folder = root / "job"
    (folder / "site_profiles").mkdir(parents=True)
    workdir = Path(slurm_stack.clusters["alpha"].work_dir) / f"install-{uuid.uuid4().hex}"
    assert not workdir.exists()  # an empty workdir: the install starts from nothing
    python = torch_module(root / "site")
    with counting_index() as (url, seen), pytest.MonkeyPatch.context() as env:
        env.setenv("XFFL_HOME", str(root / "home"))
        env.setenv("XDG_CONFIG_HOME", str(root / "config"))
        path = install_profile(folder / "site_profiles", slurm_stack, workdir,
                               install={"python": str(python)},
                               setup=[f"export PIP_INDEX_URL={url}"])
        code, output, _ = _install(folder)
        assert code == 0, output
        yield Installed(folder, path, workdir, root / "home", output, seen)
    shutil.rmtree(workdir)  # its venv: 600 MB, in the stack's folder that outlives the tests


def test_install_makes_the_venv_from_the_uploaded_wheelhouse(installed: Installed) -> None:
    current = installed.workdir / "xffl-venvs" / "current"
    python = yaml.safe_load(installed.profile.read_text())["python"]
    assert python == f"{current}/bin/python", installed.output
    assert current.is_symlink() and (current / "xffl-install.json").is_file()
    # the site's pip had an index (PIP_INDEX_URL, set by the profile's setup) and asked it
    # nothing: it ran with --no-index and the uploaded wheelhouse only
    assert installed.index_requests == []
    log = (current / "xffl-pip.log").read_text()
    assert "Ignoring indexes:" in log and "127.0.0.1" in log.split("Ignoring indexes:")[1]
    wheelhouse = {p.name for p in (installed.workdir / "xffl-wheelhouse").iterdir()}
    assert len(wheelhouse) == 1, wheelhouse
    asked = subprocess.run([python, "-c", "import torch, xffl.core.versions as v, sys; "
                            "print(v.xffl_version(), torch.__file__)"],
                           capture_output=True, text=True, timeout=120, check=True,
                           cwd=installed.workdir)
    version, torch_file = asked.stdout.split()
    assert version == xffl_version() and "torch-module" in torch_file  # the site's own torch


def _state(workdir: Path) -> dict[str, tuple[int, int]]:
    """(mtime ns, size) of everything xffl's install keeps in the workdir, down to the venv's
    site-packages entries, the current link itself, the stamp and pip's log."""
    venvs = workdir / "xffl-venvs"
    state = {}
    for path in [venvs, *venvs.iterdir(), *(workdir / "xffl-wheelhouse").iterdir()]:
        st = path.lstat()
        state[str(path)] = (st.st_mtime_ns, st.st_size)
    current = (venvs / "current").resolve()
    site = next(current.glob("lib/python*/site-packages"))
    for path in [current / "xffl-install.json", current / "xffl-pip.log", site,
                 *site.iterdir()]:
        st = path.lstat()
        state[str(path)] = (st.st_mtime_ns, st.st_size)
    return state


def test_a_second_install_changes_nothing(installed: Installed,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    before = _state(installed.workdir)
    profile = installed.profile.read_bytes()
    monkeypatch.setenv("XFFL_HOME", str(installed.home))
    code, output, stdout = _install(installed.folder, "--json")
    assert code == 0, output
    shown = check("profiles-install", json.loads(stdout))
    assert shown["changed"] is False and "uploading" not in output, output
    print(f"second install: {shown['seconds']} s")  # the bound: under 10 s
    assert _state(installed.workdir) == before  # same venv, same files, no pip run
    assert installed.profile.read_bytes() == profile


def _job(installed: Installed, stack: StackInfo, name: str, beta: bool = True) -> Path:
    """The quickstart for one round, alpha on the installed profile, one rank a site; beta
    on the stack's own profile unless ``beta`` is False."""
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec.update(name=name, rounds=1)
    spec["sites"] = spec["sites"][:2 if beta else 1]
    for site in spec["sites"]:
        site["ranks"] = 1
        site["data"]["path"] = str(installed.folder / "data" / site["name"])
    spec["sites"][0]["profile"] = installed.profile.stem
    if beta:
        spec["sites"][1]["profile"] = write_profile(installed.folder / "site_profiles",
                                                    stack.clusters["beta"], stack)
    spec.setdefault("evaluation", {})["final"] = False
    job = installed.folder / f"{name}.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


def test_a_slurm_round_trains_with_the_installed_venv(installed: Installed,
                                                      slurm_stack: StackInfo) -> None:
    # alpha alone: the venv is alpha's, and a job of beta's would prove nothing of it
    job = _job(installed, slurm_stack, "installed", beta=False)
    done = runner.invoke(app, ["submit", str(job), "--wait", "--json", "--timeout", "600"])
    assert done.exit_code == 0, done.output
    status = json.loads(done.stdout)
    alpha = [r for r in slurm_stack.jobcomp_records("alpha")
             if r.get("Name") == f"xffl-{status['run_id']}-alpha-r1"]
    assert len(alpha) == 1 and alpha[0]["JobState"] == "COMPLETED", alpha
    python = f"{installed.workdir}/xffl-venvs/current/bin/python"
    # the batch script SLURM ran starts the launcher with the installed venv's python (a file
    # of the run naming it is not enough: the job's copy of the profile names it whatever
    # python the plan's commands use)
    job_id = json.loads((Path(status["run_dir"]) / "rounds" / "1" / "updates" / "alpha" /
                         "slurm_job.json").read_text())["job_id"]
    shown = subprocess.run(["scontrol", "write", "batch_script", job_id, "-"],
                           env=slurm_stack.slurm_env("alpha"), capture_output=True, text=True,
                           timeout=30)
    assert shown.returncode == 0, shown.stderr
    launches = [ln for ln in shown.stdout.splitlines() if "xffl.training.launch" in ln]
    assert launches and all(python in ln for ln in launches), shown.stdout


def _queued(stack: StackInfo) -> list[str]:
    """Every job name in either cluster's queue (squeue)."""
    names: list[str] = []
    for cluster in ("alpha", "beta"):
        names += subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True,
                                env=stack.slurm_env(cluster), timeout=60,
                                check=True).stdout.split()
    return names


def test_a_site_with_another_xffl_is_refused_at_submit(installed: Installed,
                                                       slurm_stack: StackInfo) -> None:
    """The installed venv's interpreter, its xffl seen as 9.9.9 of format 99: submit names
    the site, both versions and `xffl profiles install test-alpha`; SLURM gets no job, not
    even one of beta, whose xffl is this one."""
    venv_python = f"{installed.workdir}/xffl-venvs/current/bin/python"
    other = other_xffl_python(installed.workdir / "other", base=venv_python)
    data = yaml.safe_load(installed.profile.read_text())
    installed.profile.write_text(yaml.safe_dump({**data, "python": str(other)}))
    try:
        job = _job(installed, slurm_stack, "otherversion")
        before = len(slurm_stack.jobcomp_records("alpha"))
        done = runner.invoke(app, ["submit", str(job)])
    finally:
        installed.profile.write_text(yaml.safe_dump(data, sort_keys=False))
    assert done.exit_code == 2, done.output
    assert refusal(job, other, "test-alpha") in " ".join(done.output.split()), done.output
    assert not [n for n in _queued(slurm_stack) if n.startswith("xffl-otherversion")]
    assert len(slurm_stack.jobcomp_records("alpha")) == before


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (the tests run as root, as the stack needs): a full disk for real."""
    mount = tmp_path / "full"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=700", "tmpfs", str(mount)],
                   check=True, timeout=30)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False, timeout=30)


def _shim(path: Path, venv_step: str) -> Path:
    """A site python3 that answers like the real one, but whose ``-m venv`` does
    ``venv_step`` (shell) instead."""
    real = path.parent / "real"
    path.write_text(f"#!/bin/sh\ncase \"$*\" in *'-m venv'*) {venv_step} ;; esac\n"
                    f"exec {real}/python3 \"$@\"\n")
    path.chmod(0o755)
    return path


def _line(path: Path, key: str) -> int:
    """The line of ``key:`` in the ``install:`` section of a profile file."""
    lines = path.read_text().splitlines()
    start = lines.index("install:")
    return next(n for n, t in enumerate(lines[start:], start + 1)
                if t.strip().startswith(f"{key}:"))


@pytest.mark.parametrize("case", ["no-python", "no-venv", "disk-full", "quota", "no-index"])
def test_a_bad_answer_is_one_line_with_the_fix(case: str, tmp_path: Path,
                                               slurm_stack: StackInfo,
                                               request: pytest.FixtureRequest) -> None:
    workdir = Path(slurm_stack.clusters["alpha"].work_dir) / f"bad-{uuid.uuid4().hex}"
    python = torch_module(tmp_path / "real")
    (tmp_path / "site_profiles").mkdir()
    fields: dict[str, object] = {"install": {"python": str(python)}}
    if case == "no-python":  # the login shell's PATH has no python3
        (tmp_path / "empty-bin").mkdir()
        fields = {"setup": [f"export PATH={tmp_path / 'empty-bin'}"],
                  "install": {"python": "python3"}}
    elif case == "no-venv":  # Debian's python3 without python3-venv, in its own words
        fields["install"] = {"python": str(_shim(tmp_path / "python3", (
            "echo 'The virtual environment was not created successfully because ensurepip "
            "is not available.  On Debian/Ubuntu systems, you need to install the "
            "python3-venv package' >&2; exit 1")))}
    elif case == "disk-full":
        workdir = request.getfixturevalue("tiny_disk") / "work"
    elif case == "quota":  # what Python prints when the quota stops a write
        fields["install"] = {"python": str(_shim(tmp_path / "python3", (
            f"exec {tmp_path / 'real' / 'python3'} -c 'import errno, os; raise OSError("
            "errno.EDQUOT, os.strerror(errno.EDQUOT), \"pyvenv.cfg\")'")))}
    elif case == "no-index":
        with socket.socket() as sock:  # a port nothing listens on
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        fields["install"] = {"python": str(python), "index_url": f"http://127.0.0.1:{port}/"}
    path = install_profile(tmp_path / "site_profiles", slurm_stack, workdir, **fields)
    code, output, _ = _install(tmp_path)
    text = " ".join(output.split())
    assert "Traceback" not in output, output
    field = f"{path}:{_line(path, 'python')}: site profile field install.python:"
    if case == "no-python":
        expected = (2, f"{field} site 'test-alpha' has no python3 (")
    elif case == "no-venv":
        expected = (2, f"{field} {tmp_path / 'python3'} at site 'test-alpha' cannot make a "
                    "venv (The virtual environment was not created successfully because "
                    "ensurepip is not available.")
    elif case == "disk-full":
        expected = (1, f"site 'test-alpha': the disk of {workdir} is full (creating the venv: ")
    elif case == "quota":
        expected = (1, f"site 'test-alpha': your quota on {workdir} is used up (creating the "
                    "venv: OSError: [Errno 122] Disk quota exceeded")
    else:
        expected = (2, f"{path}:{_line(path, 'index_url')}: the index "
                    f"http://127.0.0.1:{port}/ is unreachable from site 'test-alpha' (")
    assert code == expected[0] and expected[1] in text, output
    assert output.count("error:") == 1, output  # one line, no traceback
    venvs = workdir / "xffl-venvs"
    assert not (venvs / "current").exists()  # nothing half-installed is current
    assert not venvs.is_dir() or list(venvs.iterdir()) == [], list(venvs.iterdir())
    assert yaml.safe_load(path.read_text())["python"] == "/not/installed/yet/bin/python"
