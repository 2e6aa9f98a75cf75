"""`xffl validate`'s memory and placement checks: the large templates fit the bundled
facilities, an 8B full fine-tune under DDP on 40 GB cards is refused with its fix, ranks per
node are checked against the node's GPUs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART, REPO
from xffl.cli.app import app
from xffl.jobs.spec.load import LoadedJob
from xffl.jobs.spec.memory_check import check_sites
from xffl.jobs.spec.schema import JobSpec
from xffl.site_profiles.lookup import bundled_dir, load_profile_file
from xffl.training.memory_model import FIT_SHARE, GIB

runner = CliRunner()

TEMPLATES = [("llama2-7b-two-facilities.yaml", "llama2-7b"),
             ("llama3.1-8b-two-facilities.yaml", "llama3.1-8b"),
             ("llama3.1-8b-lora.yaml", "llama3.1-8b")]


def _template(name: str, preset: str, training: dict[str, Any]) -> LoadedJob:
    """A large template as written (its base model's folder replaced by the preset of the
    same architecture), with the bundled profiles of its facilities."""
    path = REPO / "examples" / name
    data = yaml.safe_load(path.read_text())
    data["model"] = {"preset": preset}
    data["training"].update(training)
    spec = JobSpec.model_validate(data)
    profiles = {s.name: load_profile_file(bundled_dir() / f"{s.profile}.yaml")
                for s in spec.sites}
    return LoadedJob(path=path, spec=spec, profiles=profiles)


@pytest.mark.parametrize(("name", "preset"), TEMPLATES)
def test_large_templates_fit_the_bundled_facilities(name: str, preset: str) -> None:
    """Leonardo (4 x 64 GiB) and Karolina (8 x 40 GiB): every site's estimate leaves at
    least 10 % of the card free, in the templates' layout: torchtitan's for 7-8B models,
    FSDP2 over all of a site's GPUs without tensor parallelism."""
    job = _template(name, preset, {})
    assert (job.spec.training.tensor_parallel, job.spec.training.data_parallel) == (1, "fsdp")
    checks = check_sites(job)
    assert checks.errors == [] and checks.warnings == []
    for row in checks.rows:
        assert row.gpu_memory_gib is not None and row.estimate_gib is not None
        assert row.fits and row.estimate_gib <= FIT_SHARE * row.gpu_memory_gib, row


def test_8b_full_fine_tune_under_ddp_on_40gb_cards_is_refused_with_its_fix() -> None:
    """16 B per parameter replicated (plus DDP's buckets) is about 180 GiB per GPU for 8B;
    the fix found is FSDP2, which shards it over Karolina's 8 GPUs."""
    loaded = _template("llama3.1-8b-two-facilities.yaml", "llama3.1-8b",
                       {"tensor_parallel": 1, "data_parallel": "ddp"})
    checks = check_sites(loaded)
    karolina = next(r for r in checks.rows if r.site == "karolina")
    assert karolina.fits is False and karolina.estimate_gib is not None
    # 8.03e9 parameters x (4 weights + 4 grads + 8 Adam + 4 buckets) B, before activations
    assert karolina.estimate_gib > 8.03e9 * 20 / GIB
    assert karolina.fix is not None and karolina.fix.startswith("data_parallel: fsdp")
    assert any("'karolina'" in e and "40 GiB" in e and "use data_parallel: fsdp" in e
               for e in checks.errors)


def _gpu_job(tmp_path: Path, training: dict[str, Any], ranks: int,
             slurm: dict[str, Any]) -> Path:
    """The quickstart with site alpha on a filled-in SLURM GPU profile."""
    profile = {"name": "gpus", "connector": {"type": "ssh", "host": "login.example.org",
                                             "user": "me"},
               "slurm": {"time": "01:00:00", **slurm}, "launcher": "srun",
               "gpu_memory_gib": 40}
    (tmp_path / "site_profiles").mkdir()
    (tmp_path / "site_profiles" / "gpus.yaml").write_text(yaml.safe_dump(profile))
    data = yaml.safe_load(QUICKSTART.read_text())
    data["training"].update(training)
    data["sites"][0].update(profile="gpus", ranks=ranks)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data, sort_keys=False))
    return job


def test_validate_refuses_the_ddp_8b_job_in_one_sentence(tmp_path: Path, xffl_home: Path) -> None:
    job = _gpu_job(tmp_path, {"batch_size": 2, "seq_len": 2048, "data_parallel": "ddp",
                              "activation_checkpointing": True},
                   8, {"nodes": 1, "gpus_per_node": 8})
    text = job.read_text().replace("preset: tiny", "preset: llama3.1-8b")
    job.write_text(text)
    result = runner.invoke(app, ["validate", str(job), "--json"])
    assert result.exit_code == 2, result.output
    error = json.loads(result.stdout)["error"]
    assert len(error["lines"]) == 1
    assert error["message"].startswith(f"{job}: job spec field sites[0]: site 'alpha' (gpus)")
    assert "use data_parallel: fsdp" in error["message"]


def test_validate_prints_the_estimate_per_site(tmp_path: Path, xffl_home: Path) -> None:
    job = _gpu_job(tmp_path, {}, 4, {"nodes": 1, "gpus_per_node": 4})
    result = runner.invoke(app, ["validate", str(job), "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["site"]: r for r in json.loads(result.stdout)["sites"]}
    assert rows["alpha"]["gpu_memory_gib"] == 40 and rows["alpha"]["fits"] is True
    assert rows["alpha"]["gpus_per_node"] == 4 and rows["alpha"]["layout"] == "ddp dp 4 x tp 1"
    # the CPU site: its fp32 estimate, no GPU check
    assert rows["beta"]["gpu_memory_gib"] is None and rows["beta"]["fits"] is None
    table = runner.invoke(app, ["validate", str(job)])
    assert table.exit_code == 0
    assert any(line.split("\t")[:2] == ["alpha", "gpus"] and line.endswith("\t40\tyes")
               for line in table.stdout.splitlines()), table.stdout


def test_more_ranks_on_a_node_than_gpus_is_refused(tmp_path: Path, xffl_home: Path) -> None:
    job = _gpu_job(tmp_path, {}, 8, {"nodes": 1, "gpus_per_node": 4})
    result = runner.invoke(app, ["validate", str(job)])
    assert result.exit_code == 2
    assert ("8 ranks on 1 node(s), 8 a node, but a node has 4 GPUs, so two ranks would share "
            "a GPU (NCCL refuses); use ranks: 4 or slurm nodes: 2.") in result.stderr
    (tmp_path / "two").mkdir()
    fixed = _gpu_job(tmp_path / "two", {}, 8, {"nodes": 2, "gpus_per_node": 4})
    assert runner.invoke(app, ["validate", str(fixed)]).exit_code == 0


def test_a_tensor_parallel_group_across_nodes_is_warned_about(tmp_path: Path,
                                                             xffl_home: Path) -> None:
    job = _gpu_job(tmp_path, {"tensor_parallel": 2}, 2, {"nodes": 2, "gpus_per_node": 1})
    result = runner.invoke(app, ["validate", str(job), "--json"])
    assert result.exit_code == 0, result.output
    [warning] = json.loads(result.stdout)["warnings"]
    assert "tensor_parallel 2 does not divide the 1 GPUs (1 ranks) of a node" in warning


def _hsdp_job(tmp_path: Path, shard_group: int, tp: int = 1) -> Path:
    """:func:`_gpu_job` under HSDP, site alpha on 2 nodes of 2 GPUs, every site 4 ranks (a
    shard_group divides every site's ranks)."""
    job = _gpu_job(tmp_path, {"data_parallel": "hsdp", "shard_group": shard_group,
                              "tensor_parallel": tp}, 4, {"nodes": 2, "gpus_per_node": 2})
    data = yaml.safe_load(job.read_text())
    for site in data["sites"]:
        site["ranks"] = 4
    job.write_text(yaml.safe_dump(data, sort_keys=False))
    return job


def test_an_hsdp_shard_group_across_nodes_is_named(tmp_path: Path, xffl_home: Path) -> None:
    """HSDP: a shard group spanning nodes is allowed (exit 0) but named; one that divides a
    node's ranks is not; the layout column shows the (replicate x shard) mesh."""
    job = _hsdp_job(tmp_path, 4)
    result = runner.invoke(app, ["validate", str(job), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    [warning] = report["warnings"]
    assert ("a shard group of 4 ranks spans 2 of its 2 nodes (2 ranks a node), so its "
            "all-gathers and reduce-scatters cross the network every step (allowed)") in warning
    assert report["sites"][0]["layout"] == "hsdp 1 x 4"
    (tmp_path / "in-node").mkdir()
    inside = _hsdp_job(tmp_path / "in-node", 2)
    result = runner.invoke(app, ["validate", str(inside), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["warnings"] == [] and report["sites"][0]["layout"] == "hsdp 2 x 2"


def test_an_hsdp_group_with_tensor_parallel_counts_its_tp_ranks(tmp_path: Path,
                                                               xffl_home: Path) -> None:
    """HSDP x tp: a shard group is shard_group x tensor_parallel consecutive ranks, so
    shard_group 2 at tp 2 spans both nodes of 2 GPUs (named); shard_group 1 stays in one."""
    result = runner.invoke(app, ["validate", str(_hsdp_job(tmp_path, 2, 2)), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    [warning] = report["warnings"]
    assert "a shard group of 4 ranks spans 2 of its 2 nodes (2 ranks a node)" in warning
    assert report["sites"][0]["layout"] == "hsdp 1 x 2 x tp 2"
    (tmp_path / "in-node").mkdir()
    inside = _hsdp_job(tmp_path / "in-node", 1, 2)
    result = runner.invoke(app, ["validate", str(inside), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["warnings"] == [] and report["sites"][0]["layout"] == "hsdp 2 x 1 x tp 2"
