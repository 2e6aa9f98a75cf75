"""A profile's container: the rank command it makes, the batch script that shows it, the image
definition `xffl profiles image` writes (and the one in docs/containers.md)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.cli.schemas import check
from tests.conftest import REPO
from xffl.cli.app import app
from xffl.site_profiles.container import binds, rank_python
from xffl.site_profiles.image import install_steps
from xffl.site_profiles.pins import pinned_requirements
from xffl.site_profiles.schema import SiteProfile
from xffl.training.launch import build_command
from xffl.workflows.plan.deployments import batch_script

runner = CliRunner()
SSH = {"type": "ssh", "host": "login.example.org"}


def _profile(container: dict[str, Any] | None, **more: Any) -> SiteProfile:
    return SiteProfile.model_validate({
        "name": "leo", "connector": SSH, "launcher": "srun",
        "slurm": {"partition": "boost", "gpus_per_node": 4}, "workdir": "/scratch/me/{site}",
        **({"container": container} if container else {}), **more})


def test_apptainer_ranks_run_exec_nv_with_the_workdir_and_data_bound() -> None:
    profile = _profile({"runtime": "apptainer", "image": "/img/xffl.sif",
                        "binds": ["/leonardo_work/shared:/models"]})
    assert profile.container is not None
    bound = binds(profile.container, "/scratch/me/leo", "/data/corpus")
    assert bound == ["/scratch/me/leo", "/data/corpus", "/leonardo_work/shared:/models"]
    # data under the workdir is bound with it
    assert binds(profile.container, "/scratch/me/leo", "/scratch/me/leo/data") == [
        "/scratch/me/leo", "/leonardo_work/shared:/models"]
    words = rank_python(profile.container, bound)
    assert words == ["apptainer", "exec", "--nv", "--bind", "/scratch/me/leo", "--bind",
                     "/data/corpus", "--bind", "/leonardo_work/shared:/models",
                     "/img/xffl.sif", "python3"]
    assert build_command(4, "srun", ["--round", "1"], python=words) == [
        "srun", "--ntasks=4", "--kill-on-bad-exit=1", *words, "-m", "xffl.training",
        "--round", "1"]
    # torchrun (one node) runs inside the container, and starts the ranks there
    assert build_command(2, "torchrun", ["--round", "1"], python=words)[:len(words) + 2] == [
        *words, "-m", "torch.distributed.run"]


def test_rocm_singularity_and_charliecloud_lines() -> None:
    rocm = _profile({"runtime": "singularity", "image": "/i.sif", "gpus": "rocm"}).container
    assert rocm is not None and rank_python(rocm, ["/w"])[:3] == ["singularity", "exec",
                                                                  "--rocm"]
    ch = SiteProfile.model_validate({
        "name": "c", "connector": SSH, "slurm": {}, "container": {
            "runtime": "charliecloud", "image": "/img/dir", "gpus": "none",
            "python": "/opt/venv/bin/python"}}).container
    assert ch is not None
    assert rank_python(ch, ["/w"]) == ["ch-run", "--cd={cwd}", "--bind=/w", "/img/dir", "--",
                                       "/opt/venv/bin/python"]
    # ch-run binds $TMPDIR at /tmp: folders below /tmp are reached through the host's /tmp
    assert rank_python(ch, ["/w", "/tmp/x", "/tmp/y:/y"]) == [
        "env", "TMPDIR=/tmp", "ch-run", "--cd={cwd}", "--bind=/w", "--bind=/tmp/y:/y",
        "/img/dir", "--", "/opt/venv/bin/python"]


def test_the_batch_script_shows_and_exports_the_container_line() -> None:
    profile = _profile({"runtime": "apptainer", "image": "/img/xffl.sif"})
    for by_hand in (True, False):
        text = batch_script("r1", "leo", profile, 4, "/data/corpus", by_hand=by_hand)
        (line,) = [ln for ln in text.splitlines() if ln.startswith("export XFFL_RANK_PYTHON=")]
        assert shlex.split(*shlex.split(line.split("=", 1)[1])) == [
            "apptainer", "exec", "--nv", "--bind", "/scratch/me/leo", "--bind", "/data/corpus",
            "/img/xffl.sif", "python3"]
        assert ("#   srun --ntasks=4 --kill-on-bad-exit=1 apptainer exec --nv --bind "
                "/scratch/me/leo --bind /data/corpus /img/xffl.sif python3 -m xffl.training "
                "...") in text
    assert "XFFL_RANK_PYTHON" not in batch_script("r1", "leo", _profile(None), 4, "/d",
                                                  by_hand=True)


@pytest.mark.parametrize(("container", "more", "message"), [
    ({"runtime": "charliecloud", "image": "/i"}, {},
     "charliecloud cannot pass GPUs into the container at run time"),
    ({"runtime": "apptainer", "image": "/i", "gpus": "none"}, {},
     "slurm.gpus_per_node asks for GPUs, but gpus: none keeps them out"),
    ({"runtime": "apptainer", "image": "relative.sif"}, {}, "is not an absolute path"),
    ({"runtime": "apptainer", "image": "/i", "python": "python3; rm -rf ~"}, {},
     "neither an absolute path nor a plain command name"),
    ({"runtime": "apptainer", "image": "/i", "binds": ["/a:/b:/c"]}, {}, "is not SRC or SRC:DST"),
    ({"runtime": "apptainer", "image": "/i{% if 1 %}"}, {}, "Jinja2 statement"),
    ({"runtime": "apptainer", "image": "/i", "base": "nvcr.io/x y"}, {},
     "is not an image reference"),
])
def test_bad_containers_are_refused(container: dict[str, Any], more: dict[str, Any],
                                    message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _profile(container, **more)


def test_a_container_needs_slurm() -> None:
    with pytest.raises(ValueError, match="a container needs the profile's slurm section"):
        SiteProfile.model_validate({"name": "x", "connector": SSH, "container": {
            "runtime": "apptainer", "image": "/i.sif"}})


def test_pins_leave_torch_to_the_base_image() -> None:
    pins = pinned_requirements()
    names = {p.split("==")[0].lower() for p in pins}
    assert {"transformers", "safetensors", "pydantic", "peft"} <= names
    assert not names & {"torch", "streamflow", "cwltool"}
    assert not any(n.startswith("nvidia-") for n in names)
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[^=\s]+", p) for p in pins), pins


def _docs_block() -> str:
    """The definition in docs/containers.md (the fenced block after its marker line)."""
    text = (REPO / "docs" / "containers.md").read_text()
    found = re.search(r"<!-- xffl profiles image leonardo -->\n```text\n(.*?)```", text, re.S)
    assert found, "docs/containers.md lost the Leonardo definition block"
    return found.group(1)


def test_the_leonardo_definition_in_the_docs_is_what_the_command_writes(
        tmp_path: Path) -> None:
    """`xffl profiles image leonardo` (a real wheel build) writes xffl.def, the wheel and the
    pins; its %post is install_steps' lines (the ones the stack test runs in Charliecloud),
    and docs/containers.md shows exactly this file."""
    out = tmp_path / "leonardo-image"
    egg_info = (REPO / "xffl.egg-info").exists()
    result = runner.invoke(app, ["profiles", "image", "leonardo", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    shown = check("profiles-image", json.loads(result.stdout))
    assert shown["build"][-1] == "apptainer build xffl-leonardo.sif xffl.def"
    (wheel,) = out.glob("xffl-*.whl")
    definition = (out / "xffl.def").read_text()
    post = definition.split("%post\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [ln.strip() for ln in post if ln.strip().startswith("python3 ")] == install_steps(
        "python3", "/opt/xffl", wheel.name)
    assert "From: nvcr.io/nvidia/pytorch:" in definition
    pins = (out / "requirements.txt").read_text().splitlines()
    assert pins[1:] == list(pinned_requirements())
    assert _docs_block() == definition
    assert (REPO / "xffl.egg-info").exists() == egg_info  # the build left the tree as it was
