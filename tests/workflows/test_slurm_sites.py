"""Two SLURM facilities over SSH (the real test stack): 2 rounds of a LoRA job (peft, frozen
base from ``model.init``, ``aggregation.lora: freeze_a``), srun -n 2 DDP at alpha and one
rank at beta, as one StreamFlow workflow; its provenance as an RO-Crate; the hand-run batch
script (a whole-model job, as the other SLURM runs of tests/workflows/test_failure_slurm.py
are)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.cli.schemas import check
from tests.conftest import QUICKSTART
from tests.stack.profiles import write_profile
from tests.stack.stack import StackInfo
from tests.workflows import lora_checks
from xffl.aggregator.exchange import verify_checkpoint
from xffl.cli.app import app
from xffl.jobs.registry.store import Registry
from xffl.training.checkpoint import init_global
from xffl.training.config import ModelSpec

runner = CliRunner()


def _slurm_jobs_recorded(slurm_stack: StackInfo, before: dict[str, list[dict[str, str]]],
                         run_id: str, run_dir: Path,
                         rounds: tuple[int, ...]) -> dict[tuple[int, str], str]:
    """SLURM's records, the registry's and each update's agree on one job per round and site;
    their ids by (round, site)."""
    # SLURM's own records: one COMPLETED job per round and cluster, named after the run, the
    # site and the round
    job_ids: dict[tuple[int, str], str] = {}
    for name in ("alpha", "beta"):
        new = slurm_stack.jobcomp_records(name)[len(before[name]):]
        for rnd in rounds:
            ours = [r for r in new if r.get("Name") == f"xffl-{run_id}-{name}-r{rnd}"]
            assert len(ours) == 1, new
            assert ours[0]["JobState"] == "COMPLETED"
            assert ours[0]["ProcCnt"] == {"alpha": "2", "beta": "1"}[name]
            assert ours[0]["TimeLimit"] == {"alpha": "10", "beta": "7"}[name]  # minutes
            job_ids[(rnd, name)] = ours[0]["JobId"]
        assert not [r for r in new if r.get("Name") == f"xffl-{run_id}-{name}"], new

    # every round's job was recorded as it came back, not only when status asked SLURM:
    # the registry (and `xffl status --no-live`, in the test) names the very jobs of SLURM's
    # records
    recorded = {(j["round"], j["site"]): j for j in Registry().slurm_jobs(run_id)}
    assert {k: j["job_id"] for k, j in recorded.items()} == job_ids
    for (rnd, site), job in recorded.items():
        assert job["state"] == "COMPLETED" and job["name"] == f"xffl-{run_id}-{site}-r{rnd}"
        assert job["nodes"] == slurm_stack.clusters[site].node and job["run_s"] > 0
        record = json.loads((run_dir / "rounds" / str(rnd) / "updates" / site /
                             "slurm_job.json").read_text())
        assert record["job_id"] == job_ids[(rnd, site)] and record["exit_code"] == 0
    return job_ids


def _time_breakdown(run_id: str, run_dir: Path, shown: dict[str, Any]) -> None:
    """Every part of every site round measured, copies both ways, the bytes sent back."""
    # the time breakdown: every part measured; StreamFlow's copies over SSH were timed both
    # ways each round, so the transfer part of every site round is > 0
    moved = Registry().transfers(run_id)
    for site in ("alpha", "beta"):
        assert {t.direction for t in moved if t.site == site} == {"in", "out"}
    for rnd in shown["rounds"]:
        for row in rnd["sites"]:
            assert row["queue_wait_s"] is not None and row["startup_s"] > 0, row
            assert row["transfer_s"] > 0 and row["other_s"] >= 0, row
            # the bytes that came back over SSH: the update as the coordinator keeps it
            update = run_dir / "rounds" / str(rnd["round"]) / "updates" / row["site"]
            assert row["sent_bytes"] == sum(f.stat().st_size for f in update.iterdir()), row


def _logs_of_a_slurm_run(run_id: str) -> None:
    """`xffl logs` reads a site's round from its SLURM job, with rank 0's step lines."""
    # `xffl logs` of a completed SLURM run: a site's round from its SLURM job, the run's log
    result = runner.invoke(app, ["logs", run_id, "--site", "beta", "--round", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["source"] == "slurm" and data["round"] == 1
    records = [json.loads(ln) for ln in data["lines"] if ln.startswith("{")]
    assert any(r.get("site") == "beta" and "num_samples" in r for r in records), data
    # rank 0's step lines (the first and the last step at least) in the job's output
    steps = [ln.split() for ln in data["lines"] if ln.startswith("step ")]
    assert len(steps) >= 2 and steps[0][1].startswith("1/") and steps[-1][2] == "loss", data
    result = runner.invoke(app, ["logs", run_id])
    assert result.exit_code == 0 and "streamflow.log" in result.stdout
    result = runner.invoke(app, ["logs", run_id, "--site", "alpha", "--round", "4"])
    assert result.exit_code == 2  # no such round


def _crate_names_globals_and_jobs(run_id: str, run_dir: Path, rounds: tuple[int, ...],
                                  job_ids: dict[tuple[int, str], str], tmp_path: Path) -> None:
    """The run's RO-Crate names every global and each site's SLURM job, one step per round."""
    # provenance: a Workflow Run RO-Crate that names every global and each site's SLURM job
    from rocrate.rocrate import ROCrate

    crate_file = tmp_path / "run.crate.zip"
    made = runner.invoke(app, ["provenance", run_id, "-o", str(crate_file), "--json"])
    assert made.exit_code == 0, made.output
    check("provenance", json.loads(made.stdout))
    crate = ROCrate(str(crate_file))
    registry_rounds = {r.round: r for r in Registry().rounds(run_id)}
    for rnd in rounds:
        glob = crate.dereference(f"#xffl-global-r{rnd}")
        assert glob["https://xffl.dev/terms#sha256"] == registry_rounds[rnd].global_digest
        for site in ("alpha", "beta"):
            update = crate.dereference(f"#xffl-update-r{rnd}-{site}")
            (job,) = update["identifier"]
            assert job["value"] == job_ids[(rnd, site)]
            assert update["https://xffl.dev/terms#sha256"] == verify_checkpoint(
                run_dir / "rounds" / str(rnd) / "updates" / site).digest()
    steps = [e.get("name") for e in crate.get_entities() if "CreateAction" in str(e.type)]
    for step in ("train_alpha", "train_beta", "admit_alpha", "aggregate"):
        assert sum(n.endswith(f"#{step}") for n in steps) == len(rounds), (step, steps)


@pytest.mark.slow
def test_two_slurm_facilities_lora_rounds(tmp_path: Path,
                                           slurm_stack,  # type: ignore[no-untyped-def]
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)  # asyncssh reads ~/.ssh/known_hosts
    profiles = tmp_path / "site_profiles"
    profiles.mkdir()
    base0 = tmp_path / "base0"  # a round-0 checkpoint of an earlier run, as model.init
    init_global("earlier", ModelSpec(preset="tiny"), 7, base0)
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    spec.update(name="slurm2", rounds=len(lora_checks.ROUNDS),
                model={"preset": "tiny", "init": str(base0)},
                aggregation={"strategy": "fedavg", "lora": "freeze_a"})
    spec["training"].update(steps=12, lr=0.01, prox_mu=0.0, lora=lora_checks.LORA)
    for site in spec["sites"]:
        cluster = slurm_stack.clusters[site["name"]]
        site["profile"] = write_profile(profiles, cluster, slurm_stack)
        site["data"].update(path=str(tmp_path / "data" / site["name"]), synthetic_sequences=256)
    # unequal sites (230 and 144 training sequences): equal ones would hide an unweighted mean
    spec["sites"][1]["data"]["synthetic_sequences"] = 160
    spec["sites"][1]["slurm"] = {"time": "00:07:00"}  # beta overrides its profile's 00:10:00
    spec["sites"][1]["ranks"] = 1
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    before = {n: slurm_stack.jobcomp_records(n) for n in ("alpha", "beta")}
    works = {n: Path(slurm_stack.clusters[n].work_dir) for n in ("alpha", "beta")}
    earlier = {n: set(works[n].glob("**/base")) for n in works}  # the stack's other runs

    result = runner.invoke(app, ["submit", str(job), "--wait", "--json", "--timeout", "400"])
    assert result.exit_code == 0, result.output
    status = check("status", json.loads(result.stdout))  # with its SLURM jobs
    run_id, run_dir = status["run_id"], Path(status["run_dir"])
    assert status["state"] == "completed"
    rounds = lora_checks.ROUNDS

    # LoRA (tests/workflows/lora_checks.py): the base crossed once and is untouched, only
    # adapters travelled, losses fell, the globals are the sample-weighted means of the
    # updates that came back over SSH, freeze_a's products are exact, and the final adapter
    # reads the same in transformers + peft and merged by `xffl export --merge`
    lora_checks.base_sent_once(status, base0, {
        n: sorted(set(works[n].glob("**/base")) - earlier[n]) for n in works})
    lora_checks.adapters_only(status)
    lora_checks.globals_are_weighted_means(run_dir)
    lora_checks.freeze_a_is_exact(run_dir)
    lora_checks.world_reads(run_id, base0, run_dir / "rounds" / str(rounds[-1]) / "global",
                            tmp_path)

    # the run is one StreamFlow workflow, named after it (StreamFlow's own listing)
    listing = subprocess.run([str(Path(sys.executable).with_name("streamflow")), "list", "-f",
                              "streamflow.yml"], cwd=run_dir, capture_output=True, text=True,
                             timeout=120, check=True).stdout.split("\n")
    names = [ln.split()[0] for ln in listing[1:] if ln.strip()]
    assert names == [run_id], listing

    job_ids = _slurm_jobs_recorded(slurm_stack, before, run_id, run_dir, rounds)
    shown = runner.invoke(app, ["status", run_id, "--json", "--no-live"])
    assert shown.exit_code == 0, shown.output
    assert {(j["round"], j["site"]): j["job_id"] for j in json.loads(shown.stdout)["slurm"]} \
        == job_ids
    _time_breakdown(run_id, run_dir, json.loads(shown.stdout))
    _logs_of_a_slurm_run(run_id)
    _crate_names_globals_and_jobs(run_id, run_dir, rounds, job_ids, tmp_path)
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
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    spec.update(name="byhand", rounds=1)
    spec["training"]["steps"] = 2
    spec["sites"] = spec["sites"][:1]
    spec["sites"][0]["ranks"] = 1  # srun -n 2 DDP under SLURM: the rounds test above
    spec["sites"][0]["profile"] = write_profile(profiles, cluster, slurm_stack)
    spec["sites"][0]["data"]["path"] = str(tmp_path / "data" / "alpha")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    plan = tmp_path / "plan"
    result = runner.invoke(app, ["render", str(job), "-o", str(plan), "--json"])
    assert result.exit_code == 0, result.output
    run_id = json.loads(result.stdout)["run_id"]
    script = plan / "sbatch" / "alpha.sh"
    text = script.read_text()
    assert "#SBATCH --ntasks=1" in text and f"#SBATCH --partition={cluster.partition}" in text
    assert "--launcher srun" in text and str(plan) not in text  # facility paths only
    assert f"#SBATCH --job-name=xffl-{run_id}-alpha" in text
    # submitted by hand, as a user would, from the plan folder on the login node of alpha
    out = slurm_stack.ssh("alpha", f"cd {plan} && sbatch --parsable sbatch/alpha.sh",
                          timeout=60)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().split(";")[0]
    record = slurm_stack.wait_job("alpha", job_id, timeout=180)
    update = verify_checkpoint(plan / "updates" / "alpha-r1")
    assert update.kind == "update" and update.site == "alpha" and update.round == 1
    assert update.parent == verify_checkpoint(plan / "rounds" / "0" / "global").digest()
    # the launcher renamed the job after its round: SLURM's own record says so
    assert record["Name"] == f"xffl-{run_id}-alpha-r1" and record["JobState"] == "COMPLETED"
    job = json.loads((plan / "updates" / "alpha-r1" / "slurm_job.json").read_text())
    assert (job["job_id"], job["renamed_from"], job["job_name"]) == (
        job_id, f"xffl-{run_id}-alpha", f"xffl-{run_id}-alpha-r1")
