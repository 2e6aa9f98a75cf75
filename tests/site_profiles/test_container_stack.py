"""A SLURM site whose ranks run inside a real Charliecloud container, on the test stack.

One real run (a module fixture): the image is built the way ``xffl profiles image`` says, its
install steps (:func:`xffl.site_profiles.image.install_steps`, the Apptainer definition's
``%post``) run in it with ``ch-run -w`` and no package index; then a 1-round job trains at
alpha with ``srun ... ch-run IMAGE -- python -m xffl.training``. Its update is bitwise the
one the same job's trainer writes here without a container; the batch script SLURM ran
holds the container line; the ranks ran in the image (a file only the image has, a user
namespace, the image's own Python and xffl).

The "base" image stands in for NGC PyTorch, which no test can pull: this machine's
interpreter and a venv in the image whose torch, transformers, ... are the host venv's
packages, bound read-only at /base/site-packages (torch is already there, as in NGC's image).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from tests.stack.stack import StackInfo
from xffl.aggregator.exchange import verify_checkpoint
from xffl.cli.app import app
from xffl.site_profiles.image import install_steps

pytestmark = [pytest.mark.slow, pytest.mark.stack]
runner = CliRunner()

IMAGE_PYTHON = "/opt/venv/bin/python"
IMAGE_MARKER = "/xffl-image-only"  # a file that exists inside the image, nowhere else
BASE_SITE = "/base/site-packages"
ROUNDS = 1  # a second round would run the same container path again, from another global
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/bin", "/sbin")  # /lib -> usr/lib: linked as here
# each process started by the image's Python writes what it sees to $XFFL_PROBE_DIR/<pid>.json
PROBE = ("import os, sys, json; d = os.environ.get('XFFL_PROBE_DIR'); d and open(f'{d}/'"
         "f'{os.getpid()}.json', 'w').write(json.dumps({'prefix': sys.prefix, 'marker': "
         f"os.path.exists('{IMAGE_MARKER}'), 'uid_map': open('/proc/self/uid_map').read()}}))\n")


def _host_binds() -> list[str]:
    """What the base image takes from this machine: the system, the interpreter, the venv's
    packages (torch & co., standing in for NGC's)."""
    system = [d for d in SYSTEM_DIRS if Path(d).is_dir() and not Path(d).is_symlink()]
    return [*system, sys.base_prefix, f"{sysconfig.get_paths()['purelib']}:{BASE_SITE}"]


def _ch_run(image: Path, binds: list[str], argv: list[str], **env: str) -> None:
    words = ["ch-run", "-w", *(f"--bind={b}" for b in binds), str(image), "--", *argv]
    proc = subprocess.run(words, env={**os.environ, "USER": os.environ.get("USER", "root"),
                                      **env}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (shlex.join(words), proc.stdout[-2000:], proc.stderr[-2000:])


def _build_image(image: Path, files: Path, dests: list[str]) -> None:
    """The base (an interpreter and a venv seeing the host's packages), then xffl's install
    steps as the Apptainer definition runs them, with no index reachable (PIP_NO_INDEX)."""
    for d in ("etc", "tmp", "proc", "dev", "sys", "opt/xffl", "home", BASE_SITE[1:],
              *(b.split(":")[-1][1:] for b in _host_binds()), *(d[1:] for d in dests)):
        (image / d).mkdir(parents=True, exist_ok=True)
    for d in SYSTEM_DIRS:
        if Path(d).is_symlink():
            (image / d[1:]).symlink_to(os.readlink(d))
    for f in ("passwd", "group", "hosts", "resolv.conf"):
        (image / "etc" / f).touch()
    (image / IMAGE_MARKER[1:]).touch()
    binds = _host_binds()
    base_python = str(Path(sys.base_prefix) / "bin" / "python3")
    _ch_run(image, binds, [base_python, "-m", "venv", "/opt/venv"])
    site = next((image / "opt/venv/lib").glob("python3*/site-packages"))
    (site / "base.pth").write_text(f"{BASE_SITE}\n")
    # the definition's %files: the wheel and requirements.txt that `xffl profiles image` wrote
    wheel = next(files.glob("xffl-*.whl")).name
    for name in (wheel, "requirements.txt"):
        shutil.copyfile(files / name, image / "opt/xffl" / name)
    for step in install_steps(IMAGE_PYTHON, "/opt/xffl", wheel):
        _ch_run(image, binds, ["/bin/sh", "-ec", step], PIP_NO_INDEX="1",
                PIP_DISABLE_PIP_VERSION_CHECK="1")
    (site / "xffl_probe.pth").write_text(PROBE)


@dataclass(frozen=True)
class ContainerRun:
    """The run whose site alpha trained inside the container, and what it left."""

    run_dir: Path
    job_ids: list[str]
    scripts: list[str]  # the batch scripts SLURM ran, as `scontrol write batch_script` gives
    probes: list[dict[str, str]]
    profile: Path
    data: Path
    image: Path
    plan_script: str


@pytest.fixture(scope="module")
def container_run(slurm_stack: StackInfo, tmp_path_factory: pytest.TempPathFactory,
                  ) -> Iterator[ContainerRun]:
    """Build the image, write the profile, run the 1-round job (alpha in the container)."""
    tmp = tmp_path_factory.mktemp("container")
    cluster = slurm_stack.clusters["alpha"]
    data = tmp / "data" / "alpha"
    data.mkdir(parents=True)
    probe = Path(cluster.work_dir) / f"probe-{uuid.uuid4().hex[:8]}"
    probe.mkdir()
    image = tmp / "image"
    profiles = tmp / "site_profiles"
    profiles.mkdir()
    profile = {
        "name": "test-alpha-ch", "description": "alpha, its ranks in a Charliecloud image",
        "connector": {"type": "ssh", "host": "127.0.0.1", "port": cluster.ssh_port,
                      "user": slurm_stack.user, "key_file": slurm_stack.ssh_key,
                      "known_hosts": slurm_stack.known_hosts},
        "slurm": {"partition": cluster.partition, "time": "00:10:00", "polling_interval": 1},
        "launcher": "srun", "python": sys.executable, "workdir": cluster.work_dir,
        "env": {"OMP_NUM_THREADS": "1", "XFFL_PROBE_DIR": str(probe)},
        "container": {"runtime": "charliecloud", "image": str(image), "gpus": "none",
                      "python": IMAGE_PYTHON, "binds": _host_binds()},
    }
    (profiles / "test-alpha-ch.yaml").write_text(yaml.safe_dump(profile))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XFFL_HOME", str(tmp / "xffl-home"))
        mp.setenv("XDG_CONFIG_HOME", str(tmp / "config"))
        mp.setenv("HOME", slurm_stack.ssh_home)  # asyncssh reads ~/.ssh/known_hosts
        mp.chdir(tmp)
        files = tmp / "image-files"
        made = runner.invoke(app, ["profiles", "image", "test-alpha-ch", "-o", str(files)])
        assert made.exit_code == 0, made.output
        _build_image(image, files, [cluster.work_dir, str(data)])
        spec = yaml.safe_load(QUICKSTART.read_text())
        spec["evaluation"] = {"final": False}
        spec.update(name="container", rounds=ROUNDS)
        spec["training"]["steps"] = 4
        spec["sites"] = spec["sites"][:1]
        spec["sites"][0].update(profile="test-alpha-ch", ranks=2)
        spec["sites"][0]["data"].update(path=str(data), synthetic_sequences=128)
        job = tmp / "job.yaml"
        job.write_text(yaml.safe_dump(spec, sort_keys=False))
        result = runner.invoke(app, ["submit", str(job), "--wait", "--json", "--timeout", "400"])
        assert result.exit_code == 0, result.output
        status = json.loads(result.stdout)
        assert status["state"] == "completed", status
    run_dir = Path(status["run_dir"])
    job_ids = [json.loads((run_dir / "rounds" / str(r) / "updates" / "alpha" /
                           "slurm_job.json").read_text())["job_id"] for r in range(1, ROUNDS + 1)]
    scripts = []
    for job_id in job_ids:
        shown = subprocess.run(["scontrol", "write", "batch_script", job_id, "-"],
                               env=slurm_stack.slurm_env("alpha"), capture_output=True,
                               text=True, timeout=30)
        assert shown.returncode == 0, shown.stderr
        scripts.append(shown.stdout)
    probes = [json.loads(p.read_text()) for p in probe.glob("*.json")]
    yield ContainerRun(run_dir=run_dir, job_ids=job_ids, scripts=scripts, probes=probes,
                       profile=profiles / "test-alpha-ch.yaml", data=data, image=image,
                       plan_script=(run_dir / "sbatch" / "alpha.sh").read_text())
    shutil.rmtree(probe, ignore_errors=True)


def test_the_batch_script_slurm_ran_holds_the_container_line(
        container_run: ContainerRun) -> None:
    """Every round's job, read back from SLURM: the container line, the launcher under srun."""
    for script in container_run.scripts:
        line = next(ln for ln in script.splitlines() if ln.startswith("export XFFL_RANK_PYTHON="))
        words = shlex.split(*shlex.split(line.split("=", 1)[1]))
        # the stack's workdir is under /tmp: ch-run reaches it through TMPDIR=/tmp
        assert words[:4] == ["env", "TMPDIR=/tmp", "ch-run", "--cd={cwd}"] and words[-3:] == [
            str(container_run.image), "--", IMAGE_PYTHON], words
        assert "#   srun --ntasks=2 --kill-on-bad-exit=1 env TMPDIR=/tmp ch-run '--cd={cwd}' " \
            f"--bind=/usr --bind={sys.base_prefix} " in script
        assert "--launcher srun" in script
    assert "export XFFL_RANK_PYTHON=" in container_run.plan_script  # `xffl render`'s too


def test_the_ranks_ran_inside_the_image(container_run: ContainerRun) -> None:
    """Every rank of every round saw the image's file, a user namespace and the image's
    Python; the xffl they imported is the wheel installed in the image."""
    assert len(container_run.probes) >= 2 * ROUNDS, container_run.probes
    for probe in container_run.probes:
        assert probe["marker"] and probe["prefix"] == "/opt/venv", probe
        # ch-run maps one user into a new user namespace; the host's map is the whole range
        assert probe["uid_map"].split()[2] == "1", probe
    assert not Path(IMAGE_MARKER).exists()
    installed = list((container_run.image / "opt/venv/lib").glob(
        "python3*/site-packages/xffl-*.dist-info"))
    assert len(installed) == 1, installed
    assert (installed[0].parent / "xffl" / "training" / "launch.py").is_file()


def test_the_updates_are_bitwise_those_without_a_container(container_run: ContainerRun,
                                                           tmp_path: Path) -> None:
    """The same job's trainer, here without a container (2 ranks, from the same global of
    each round): every tensor file of each update has the same sha256 (training on CPU with
    gloo and one thread per rank is deterministic; any difference is the container's)."""
    run_dir = container_run.run_dir
    for rnd in range(1, ROUNDS + 1):
        out = tmp_path / f"r{rnd}"
        env = {k: v for k, v in os.environ.items() if k != "XFFL_RANK_PYTHON"}
        proc = subprocess.run(
            [sys.executable, "-m", "xffl.training.launch", "--ranks", "2", "--launcher",
             "torchrun", "--", "--job", str(run_dir / "jobs" / "alpha.json"), "--round",
             str(rnd), "--model", str(run_dir / "rounds" / str(rnd - 1) / "global"),
             "--data", str(container_run.data), "--out", str(out)],
            env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ours = verify_checkpoint(out).files
        theirs = verify_checkpoint(run_dir / "rounds" / str(rnd) / "updates" / "alpha").files
        tensors = {n for n in theirs if n.endswith(".safetensors")}
        assert tensors and tensors == {n for n in ours if n.endswith(".safetensors")}
        assert {n: ours[n] for n in tensors} == {n: theirs[n] for n in tensors}, rnd


def test_profiles_check_finds_the_image_and_names_a_missing_one(
        container_run: ContainerRun) -> None:
    """`xffl profiles check`'s row over the site's SSH login: the image and ch-run are there;
    an image path that does not exist at the site is one row naming it and the fix."""
    from xffl.site_profiles.checks import check_site
    from xffl.site_profiles.lookup import load_profile_file

    profile = load_profile_file(container_run.profile)
    rows = {row: (ok, detail) for row, ok, detail in check_site("alpha", profile).rows}
    ok, detail = rows["container image"]
    assert ok and detail.startswith(f"{container_run.image} (ch-run: /"), detail
    assert profile.container is not None
    gone = profile.model_copy(update={"container": profile.container.model_copy(
        update={"image": f"{container_run.image}-gone"})})
    rows = {row: (ok, detail) for row, ok, detail in check_site("alpha", gone).rows}
    assert rows["container image"] == (False, (
        f"{container_run.image}-gone does not exist at the site; build it (`xffl profiles image "
        "test-alpha-ch` writes its definition) and put it there, or fix container.image"))


def test_submit_refuses_an_image_missing_at_the_site(container_run: ContainerRun,
                                                     slurm_stack: StackInfo,
                                                     tmp_path: Path) -> None:
    """A profile whose image is not at the facility: `xffl submit` asks the site over SSH
    and refuses, exit 2, one line naming the profile's file and line, before any SLURM job."""
    folder = tmp_path / "site_profiles"
    folder.mkdir()
    text = container_run.profile.read_text().replace("name: test-alpha-ch",
                                                     "name: test-alpha-gone")
    gone = f"{container_run.image}-gone"
    text = text.replace(f"image: {container_run.image}\n", f"image: {gone}\n")
    (folder / "test-alpha-gone.yaml").write_text(text)
    line = next(n for n, t in enumerate(text.splitlines(), 1) if t.strip().startswith("image:"))
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}
    spec.update(name="gone", rounds=1)
    spec["sites"] = spec["sites"][:1]
    spec["sites"][0].update(profile="test-alpha-gone")
    spec["sites"][0]["data"].update(path=str(container_run.data))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    before = len(slurm_stack.jobcomp_records("alpha"))
    result = runner.invoke(app, ["submit", str(job)])
    assert result.exit_code == 2, result.output
    (said,) = [x for x in result.stderr.splitlines() if x.strip()]
    assert said == (
        f"error: {job}: site 'alpha': its container image {gone} does not exist there "
        f"({folder / 'test-alpha-gone.yaml'}:{line}: container.image); build it (`xffl "
        "profiles image test-alpha-gone` writes its definition) and put it there, or fix the "
        "path."), said
    assert len(slurm_stack.jobcomp_records("alpha")) == before
