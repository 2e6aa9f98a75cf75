"""Per-site SLURM overrides in the job spec: the keys and types of the profile's slurm section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import QUICKSTART
from xffl.core.errors import InvalidInput
from xffl.core.names import slurm_job_name, slurm_job_round
from xffl.jobs.spec.load import load_job
from xffl.site_profiles.schema import SlurmOverride, SlurmSpec

SLURM_PROFILE = {
    "name": "cluster",
    "connector": {"type": "ssh", "host": "login.example.org", "user": "me"},
    "slurm": {"partition": "batch", "account": "acct1", "time": "01:00:00",
              "polling_interval": 2},
    "launcher": "srun",
}


def job_with_overrides(tmp_path: Path, overrides: dict[str, Any] | None,
                       profile: str = "cluster") -> Path:
    """The quickstart with site alpha on an ssh+SLURM profile and ``overrides`` as its slurm."""
    (tmp_path / "site_profiles").mkdir(exist_ok=True)
    (tmp_path / "site_profiles" / "cluster.yaml").write_text(yaml.safe_dump(SLURM_PROFILE))
    data = yaml.safe_load(QUICKSTART.read_text())
    data["sites"][0]["profile"] = profile
    if overrides is not None:
        data["sites"][0]["slurm"] = overrides
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data, sort_keys=False))
    return job


def _line_of(job: Path, text: str) -> int:
    return next(i for i, ln in enumerate(job.read_text().splitlines(), 1) if text in ln)


def test_override_keys_and_constraints_are_slurmspecs() -> None:
    assert list(SlurmOverride.model_fields) == list(SlurmSpec.model_fields)
    for name, field in SlurmSpec.model_fields.items():
        assert SlurmOverride.model_fields[name].metadata == field.metadata, name


def test_overrides_merge_over_the_profile(tmp_path: Path) -> None:
    job = job_with_overrides(tmp_path, {"partition": "gpu", "nodes": 2, "account": None,
                                        "extra": ["--exclusive"]})
    loaded = load_job(job)
    slurm = loaded.site_profile("alpha").slurm
    assert slurm is not None
    assert (slurm.partition, slurm.nodes, slurm.account, slurm.extra) == (
        "gpu", 2, None, ["--exclusive"])
    assert (slurm.time, slurm.polling_interval) == ("01:00:00", 2)  # kept from the profile
    assert loaded.profiles["alpha"].slurm == SlurmSpec.model_validate(SLURM_PROFILE["slurm"])
    assert loaded.site_profile("beta") is loaded.profiles["beta"]  # no overrides: as is


def test_unknown_override_key_suggests(tmp_path: Path) -> None:
    job = job_with_overrides(tmp_path, {"partion": "gpu"})
    with pytest.raises(InvalidInput) as info:
        load_job(job)
    assert info.value.lines == [
        f"{job}:{_line_of(job, 'partion')}: job spec field sites[0].slurm.partion: unknown key "
        "'partion'; did you mean 'partition'?"]


@pytest.mark.parametrize(("key", "value", "says"), [
    ("nodes", "two", "valid integer"),
    ("nodes", 0, "greater than or equal to 1"),
    ("time", None, "cannot be null here; leave the key out"),
    ("polling_interval", -1, "greater than 0"),
    ("partition", "gpu\"; rm -rf ~", "would break the batch script"),
    ("extra", ["--exclusive\n--mem=0"], "one #SBATCH option per list item"),
])
def test_override_values_are_typed_like_the_profile(tmp_path: Path, key: str, value: Any,
                                                    says: str) -> None:
    job = job_with_overrides(tmp_path, {key: value})
    with pytest.raises(InvalidInput) as info:
        load_job(job)
    assert len(info.value.lines) == 1
    line = info.value.lines[0]
    assert line.startswith(f"{job}:") and f"job spec field sites[0].slurm.{key}" in line
    assert says in line


def test_override_on_a_profile_without_slurm_is_refused(tmp_path: Path) -> None:
    job = job_with_overrides(tmp_path, {"partition": "gpu"}, profile="local")
    with pytest.raises(InvalidInput) as info:
        load_job(job)
    assert info.value.lines == [
        f"{job}:{_line_of(job, 'slurm:')}: job spec field sites[0].slurm: site 'alpha' "
        "overrides SLURM settings, but its profile 'local' has no slurm section (it runs "
        "locally, without a batch job); remove the slurm key or use a SLURM profile."]


def test_site_names_cannot_look_like_a_round(tmp_path: Path) -> None:
    data = yaml.safe_load(QUICKSTART.read_text())
    data["sites"][1]["name"] = "beta-r2"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(InvalidInput) as info:
        load_job(job)
    assert "sites[1].name: 'beta-r2' ends like a round number" in info.value.lines[0]


def test_job_names_and_their_rounds() -> None:
    assert slurm_job_name("run-1", "alpha") == "xffl-run-1-alpha"
    assert slurm_job_name("run-1", "alpha", 12) == "xffl-run-1-alpha-r12"
    assert slurm_job_round("xffl-run-1-alpha-r12", "run-1", "alpha") == 12
    assert slurm_job_round("xffl-run-1-alpha", "run-1", "alpha") == 0
    for other in ("xffl-run-1-alpha-2", "xffl-run-1-alphabet-r1", "xffl-run-1-alpha-r",
                  "xffl-run-1-alpha-r1x", "xffl-run-1-alpha-r\u0661", "xffl-run-10-alpha-r1"):
        assert slurm_job_round(other, "run-1", "alpha") is None, other


def test_overrides_survive_job_json(tmp_path: Path) -> None:
    """The runner reads the spec back from job.json: only the keys set are written."""
    from xffl.jobs.spec.schema import JobSpec

    spec = load_job(job_with_overrides(tmp_path, {"partition": "gpu", "account": None})).spec
    text = spec.model_dump_json()
    assert '"slurm":{"partition":"gpu","account":null}' in text
    again = JobSpec.model_validate_json(text)
    assert again == spec and again.sites[0].slurm is not None
    assert again.sites[0].slurm.model_fields_set == {"partition", "account"}
