"""`xffl simulate`: virtual sites trained by the real trainer, folded into a running FedAvg."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from tests.cli.schemas import check
from tests.conftest import QUICKSTART
from xffl.aggregator.decode import Decoding
from xffl.aggregator.exchange import verify_checkpoint
from xffl.aggregator.exchange_spec import ExchangeSpec
from xffl.aggregator.fedavg import aggregate
from xffl.aggregator.shards import open_model
from xffl.cli.app import app
from xffl.core.errors import ExitCode
from xffl.core.startup import YOUNG
from xffl.jobs.spec.load import load_job
from xffl.training.data import ensure_synthetic, load_tokens
from xffl.workflows.simulate import _Pool
from xffl.workflows.simulate_sites import check_templates, ensure_partition, virtual_site

runner = CliRunner()


def _job(tmp_path: Path, **changes: Any) -> Path:
    """The quickstart with the smallest model and a few steps (plus ``changes``)."""
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["model"]["preset"] = "tiny-test"
    spec["training"].update(steps=2, batch_size=4, seq_len=32)
    for site in spec["sites"]:
        site["data"]["synthetic_sequences"] = 64 if site["name"] == "alpha" else 48
    spec.update(changes)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


def _tensors(directory: Path) -> dict[str, np.ndarray]:
    with open_model(directory) as reader:
        return {n: np.asarray(reader.read(n)) for n in reader.names()}


def _one_error_line(result: Any) -> str:
    assert "Traceback" not in result.output + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.parametrize("exchange", ["weights/fp32", "delta/bf16", "delta/nf4"])
def test_simulate_three_sites_equals_fedavg_of_their_updates(tmp_path: Path,
                                                             exchange: str) -> None:
    """Three virtual sites (two of template alpha, 64 sequences each, one of beta, 48: unequal
    weights), two of them training at once, over two rounds."""
    out = tmp_path / "sim"
    update, dtype = exchange.split("/")
    job = _job(tmp_path, exchange={"update": update, "dtype": dtype})
    result = runner.invoke(app, ["simulate", str(job), "--sites", "3", "--parallel",
                                 "2", "--rounds", "2", "-o", str(out), "--keep-updates",
                                 "--json"])
    assert result.exit_code == 0, result.output + result.stderr
    summary = check("simulate", json.loads(result.stdout))
    assert summary == json.loads((out / "simulate.json").read_text())
    assert summary["state"] == "completed" and summary["num_sites"] == 3
    assert summary["parallel"] == 2 and summary["threads_per_worker"] >= 1
    assert [r["round"] for r in summary["rounds"]] == [1, 2]
    names = {"alpha-0", "beta-1", "alpha-2"}
    previous = verify_checkpoint(out / "rounds" / "0" / "global")
    for r in summary["rounds"]:
        rnd = r["round"]
        glob = verify_checkpoint(out / "rounds" / str(rnd) / "global")
        assert glob.kind == "global" and glob.round == rnd and glob.parent == previous.digest()
        assert r["num_sites"] == 3 and r["digest"] == glob.digest()
        assert r["num_samples"] == glob.num_samples == 2 * 64 + 48
        updates = sorted((out / "rounds" / str(rnd) / "updates").iterdir())
        manifests = [verify_checkpoint(u) for u in updates]
        assert {m.site for m in manifests} == names
        assert all(m.parent == previous.digest() for m in manifests)
        losses = [m.metrics["loss"] for m in manifests]
        # float64 means of the same 3 positive losses, summed in arrival and in name order:
        # each sum errs by <= 2 * 2^-53 of itself, each division by 2^-53, so they differ by
        # <= 6 * 2^-53 = 6.7e-16 relative: rel 1e-15 (a site left out is off by > 1e-3)
        assert r["mean_loss"] == pytest.approx(sum(losses) / 3, rel=1e-15, abs=0)
        # the global manifest's own loss, read back (JSON round-trips floats exactly)
        assert r["global_loss"] == glob.metrics["loss"]
        assert r["peak_rss_bytes"] > 0 and r["wall_s"] > 0
        if exchange == "delta/bf16":  # the sites sent bf16 changes from the previous global
            assert {t.dtype for m in manifests for t in m.tensors} == {"BF16"}
        codec = ExchangeSpec.parse(exchange).codec
        if codec is not None:  # nf4 codes and their fp32 block scales, nothing else
            assert {t.dtype for m in manifests for t in m.tensors} == {"U8", "F32"}
            assert all(t.dtype == "U8" or t.name.endswith(".absmax")
                       for m in manifests for t in m.tensors)
        decoding = None if exchange == "weights/fp32" else Decoding(
            out / "rounds" / str(rnd - 1) / "global", delta=True, codec=codec)
        ref = aggregate(updates, tmp_path / f"ref-{rnd}", weighting="samples",
                        decoding=decoding)
        assert ref.num_samples == glob.num_samples
        got = _tensors(out / "rounds" / str(rnd) / "global")
        want = _tensors(tmp_path / f"ref-{rnd}")
        assert sorted(got) == sorted(want)
        for name, x in got.items():
            # Both are sum_i w_i x_i / sum_i w_i in float64 (only the order of the 3 additions
            # differs: <= 6 * 2^-53 * max|x_i| apart) rounded once to fp32, so they are equal
            # or adjacent fp32 values: <= 1 ulp of max|want| apart. A site left out or weighed
            # wrongly moves the average by ~1e-4 (the updates differ by ~lr * steps).
            tol = float(np.spacing(np.float32(np.abs(want[name]).max())))
            assert float(np.abs(x.astype(np.float64) - want[name]).max()) <= tol, name
        previous = glob
    for name in names if ExchangeSpec.parse(exchange).codec else ():
        # error feedback (on for nf4): round 2's residual, and round 1's it carried, stay at
        # the site
        kept = sorted(p.name for p in (out / "site-state" / name / "error-feedback").iterdir())
        assert kept == ["r1.safetensors", "r2.safetensors"]
    # every virtual site has its own data: alpha-0 and alpha-2 speak different dialects
    a0 = (out / "data" / "site-0" / "train.bin").read_bytes()
    a2 = (out / "data" / "site-2" / "train.bin").read_bytes()
    assert len(a0) == len(a2) and a0 != a2


def test_simulate_deletes_updates_and_defaults_its_folder(tmp_path: Path,
                                                          xffl_home: Path) -> None:
    result = runner.invoke(app, ["simulate", str(_job(tmp_path)), "--sites", "3",
                                 "--rounds", "1", "--parallel", "2"])
    assert result.exit_code == 0, result.output + result.stderr
    (sim,) = (xffl_home / "simulations").iterdir()
    assert sim.name.startswith("quickstart-")
    assert "3/3" in result.stderr and "final global model" in result.stdout
    summary = json.loads((sim / "simulate.json").read_text())
    assert summary["rounds"][0]["num_sites"] == 3
    assert not (sim / "rounds" / "1" / "updates").exists()  # folded, then deleted
    verify_checkpoint(sim / "rounds" / "1" / "global")


def test_simulate_runs_a_server_optimizer_from_the_running_mean(tmp_path: Path) -> None:
    job = _job(tmp_path, aggregation={"strategy": "fedadam", "weighting": "samples"})
    out = tmp_path / "sim"
    result = runner.invoke(app, ["simulate", str(job), "--sites", "2", "--rounds", "1",
                                 "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output + result.stderr
    glob = verify_checkpoint(out / "rounds" / "1" / "global")
    assert glob.extra["aggregation"] == "fedadam" and "server_m.safetensors" in glob.files
    assert glob.num_samples == 64 + 48
    assert not (out / "rounds" / "1" / ".mean").exists()


def test_bad_job_spec_exits_2_with_one_line(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(QUICKSTART.read_text().replace("rounds: 3", "rounds: three"))
    result = runner.invoke(app, ["simulate", str(job), "--sites", "4"])
    assert result.exit_code == ExitCode.INVALID_INPUT
    assert "rounds" in _one_error_line(result)


@pytest.mark.parametrize(("args", "match"), [
    (["--sites", "0"], "--sites must be at least 1"),
    (["--sites", "2", "--parallel", "0"], "--parallel must be at least 1"),
    (["--sites", "2", "--rounds", "0"], "--rounds must be at least 1"),
])
def test_bad_options_exit_2(tmp_path: Path, xffl_home: Path, args: list[str],
                            match: str) -> None:
    result = runner.invoke(app, ["simulate", str(_job(tmp_path)), *args])
    assert result.exit_code == ExitCode.INVALID_INPUT
    assert match in _one_error_line(result)
    assert not (xffl_home / "simulations").exists()


def test_unsupported_strategy_and_used_folder_exit_2(tmp_path: Path) -> None:
    job = _job(tmp_path, aggregation={"strategy": "fedmedian"})
    result = runner.invoke(app, ["simulate", str(job), "--sites", "2"])
    assert result.exit_code == ExitCode.INVALID_INPUT
    assert ("running aggregate; use one of fedavg, fedavgm, fedadam, fedyogi, fedadagrad"
            in _one_error_line(result))
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("")
    result = runner.invoke(app, ["simulate", str(_job(tmp_path)), "--sites", "2", "-o",
                                 str(used)])
    assert result.exit_code == ExitCode.INVALID_INPUT
    assert "not an empty folder" in _one_error_line(result)
    lora = _job(tmp_path, training={"lora": {"r": 4}})
    result = runner.invoke(app, ["simulate", str(lora), "--sites", "2"])
    assert result.exit_code == ExitCode.INVALID_INPUT
    assert "training.lora: xffl simulate trains whole models" in _one_error_line(result)


def test_a_round_past_its_timeout_exits_4(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    result = runner.invoke(app, ["simulate", str(_job(tmp_path)), "--sites", "2", "-o",
                                 str(out), "--timeout", "0.01"])
    assert result.exit_code == ExitCode.TIMEOUT
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "did not finish within 0.01 s" in errors[0]
    assert result.stderr.strip().splitlines()[-1] == errors[0]
    assert json.loads((out / "simulate.json").read_text())["state"] == "failed"


def test_a_real_dataset_is_split_between_the_virtual_sites(tmp_path: Path) -> None:
    data = ensure_synthetic(tmp_path / "corpus", "gamma", 10, 32)
    spec = yaml.safe_load(_job(tmp_path).read_text())
    spec["sites"] = [{"name": "solo", "profile": "local", "data": {"path": str(data)}}]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    loaded = load_job(tmp_path / "job.yaml")
    sites = [virtual_site(loaded, i, 3, tmp_path / "sim", "run", 1) for i in range(3)]
    assert [s.name for s in sites] == ["solo-0", "solo-1", "solo-2"]
    assert [(s.part, s.parts) for s in sites] == [(0, 3), (1, 3), (2, 3)]
    parts = []
    for s in sites:
        assert s.source is not None
        ensure_partition(s.source, s.data_dir, s.part, s.parts, 32)
        parts.append(np.asarray(load_tokens(s.data_dir)))
    assert [len(p) // 33 for p in parts] == [3, 3, 4]
    np.testing.assert_array_equal(np.concatenate(parts), np.asarray(load_tokens(data)))
    check_templates(loaded, 10)
    with pytest.raises(Exception, match="fewer than the 11 virtual sites"):
        check_templates(loaded, 11)


def test_the_workers_fork_server_starts_as_every_xffl_process() -> None:
    """multiprocessing's fork server runs no main of xffl's; the first module it preloads calls
    collect_less() (xffl.core.startup), so it imports torch and the trainer with the raised
    threshold, which the workers forked from it inherit: a worker reports it."""
    pool = _Pool(1, 1)
    try:
        assert pool.executor.submit(gc.get_threshold).result(timeout=120)[0] == YOUNG
    finally:
        pool.close(kill=False)
