"""Two SLURM facilities over SSH (the real test stack): 2 rounds, srun -n 2 DDP at each site."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from tests.stack.profiles import write_profile
from xffl.aggregator.exchange import MODEL_FILE, verify_checkpoint
from xffl.cli.app import app

runner = CliRunner()


@pytest.mark.slow
def test_two_slurm_facilities_two_rounds(tmp_path: Path, slurm_stack,  # type: ignore[no-untyped-def]
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)  # asyncssh reads ~/.ssh/known_hosts
    profiles = tmp_path / "site_profiles"
    profiles.mkdir()
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec.update(name="slurm2", rounds=2)
    spec["training"]["steps"] = 6
    for site in spec["sites"]:
        cluster = slurm_stack.clusters[site["name"]]
        site["profile"] = write_profile(profiles, cluster, slurm_stack)
        site["data"]["path"] = str(tmp_path / "data" / site["name"])
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    before = {n: slurm_stack.jobcomp_records(n) for n in ("alpha", "beta")}

    result = runner.invoke(app, ["submit", str(job), "--wait", "--json", "--timeout", "400"])
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    run_id, run_dir = status["id"], Path(status["run_dir"])
    assert status["state"] == "completed"

    # SLURM's own records: 2 COMPLETED jobs per cluster, named after the run and the site
    for name in ("alpha", "beta"):
        new = slurm_stack.jobcomp_records(name)[len(before[name]):]
        ours = [r for r in new if r.get("Name") == f"xffl-{run_id}-{name}"]
        assert len(ours) == 2, new
        assert all(r["JobState"] == "COMPLETED" and r["ProcCnt"] == "2" for r in ours)

    # the globals are the sample-weighted averages of the updates that came back over SSH
    for rnd in (1, 2):
        round_dir = run_dir / "rounds" / str(rnd)
        verify_checkpoint(round_dir / "global")
        ups = {s: verify_checkpoint(round_dir / "updates" / s) for s in ("alpha", "beta")}
        tensors = {s: load_file(str(round_dir / "updates" / s / MODEL_FILE)) for s in ups}
        total = sum(u.num_samples for u in ups.values())
        for name, got in load_file(str(round_dir / "global" / MODEL_FILE)).items():
            expected = sum(ups[s].num_samples * tensors[s][name].astype(np.float64)
                           for s in ups) / total
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7, err_msg=name)
    # no key material in the run directory
    assert not any("PRIVATE KEY" in p.read_text(errors="ignore")
                   for p in run_dir.rglob("*") if p.is_file() and p.stat().st_size < 1 << 20)


@pytest.mark.slow
def test_rendered_batch_script_runs_by_hand(tmp_path: Path, slurm_stack,  # type: ignore[no-untyped-def]
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    profiles = tmp_path / "site_profiles"
    profiles.mkdir()
    cluster = slurm_stack.clusters["alpha"]
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec.update(name="byhand", rounds=1)
    spec["training"]["steps"] = 4
    spec["sites"] = spec["sites"][:1]
    spec["sites"][0]["profile"] = write_profile(profiles, cluster, slurm_stack)
    spec["sites"][0]["data"]["path"] = str(tmp_path / "data" / "alpha")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    plan = tmp_path / "plan"
    result = runner.invoke(app, ["render", str(job), "-o", str(plan)])
    assert result.exit_code == 0, result.output
    script = plan / "sbatch" / "alpha.sh"
    text = script.read_text()
    assert "#SBATCH --ntasks=2" in text and f"#SBATCH --partition={cluster.partition}" in text
    assert "--launcher srun" in text
    # submitted by hand, as a user would, on the login node of cluster alpha
    out = slurm_stack.ssh("alpha", f"sbatch --wait --parsable {script}", timeout=120)
    assert out.returncode == 0, out.stderr
    update = verify_checkpoint(plan / "manual" / "alpha")
    assert update.kind == "update" and update.site == "alpha" and update.round == 1
    assert update.parent == verify_checkpoint(plan / "rounds" / "0" / "global").digest()
