"""Failure policy on real runs (local sites): quorum and resume.

A site's data whose meta.json promises a flags.bin that is not there (a prepare that did not
finish; `xffl submit` checks the tokens, not the flags) is a real failure of that site's
training job (the trainer exits 2); preparing the data again with `xffl data prepare` is the
fix a user would make before `xffl resume`. The SIGKILL and cron-tick cases run on the SLURM stack
(tests/workflows/test_failure_slurm.py, which also retries a real site job under
`failure.retries`; every attempt's reason in one line: tests/workflows/steps/test_attempts.py
and extensions/test_plugin.py); a round that goes on without a failed site under
`failure.min_sites` 1 is tests/workflows/test_other_format_round.py's, and a round's global
without its failed site test_failure_slurm.py's (its timed-out site gamma).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.cli.schemas import check
from tests.conftest import QUICKSTART
from tests.workflows.runs import admitted, reused
from tests.workflows.site_data import write_shards
from xffl.aggregator.exchange import verify_checkpoint
from xffl.cli.app import app
from xffl.jobs.follow import wait_for_run
from xffl.jobs.registry.store import Registry

runner = CliRunner()
BETA_DATA = "prepared/beta"  # relative to the site's workdir; its flags missing at first


def _spec(name: str, rounds: int = 2, **failure: object) -> dict:
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    spec.update(name=name, rounds=rounds, failure=failure)
    spec["training"].update(steps=3, batch_size=4)
    for site in spec["sites"]:
        site["ranks"] = 1
        site["data"]["synthetic_sequences"] = 64
    return spec


def admitted_sites(status: dict, rnd: int) -> list[dict]:
    """Round ``rnd``'s site rows of a status."""
    (row,) = [r for r in status["rounds"] if r["round"] == rnd]
    return list(row["sites"])


def _broken_beta(spec: dict, xffl_home: Path) -> dict:
    folder = write_shards(xffl_home / "sites" / "beta" / BETA_DATA, 4096)
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "flags": "flags.bin"}))
    spec["sites"][1]["data"] = {"path": BETA_DATA}
    return spec


def _submit(tmp_path: Path, spec: dict, *extra: str) -> tuple[int, dict]:
    job = tmp_path / f"{spec['name']}.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = runner.invoke(app, ["submit", str(job), "--json", *extra])
    return result.exit_code, json.loads(result.stdout) if result.stdout.strip() else {}


def _status(run_id: str) -> dict:
    result = runner.invoke(app, ["status", run_id, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _prepare_beta(xffl_home: Path) -> None:
    text = xffl_home / "beta.txt"
    text.write_text("hjy-kuq vaz! wyx hez-qav!\n" * 400)
    out = xffl_home / "sites" / "beta" / BETA_DATA
    result = runner.invoke(app, ["data", "prepare", str(text), "-o", str(out), "--force"])
    assert result.exit_code == 0, result.output


@pytest.mark.slow
def test_quorum_failure_then_resume(tmp_path: Path, xffl_home: Path) -> None:
    """Also DiLoCo over nf4 deltas with error feedback: resumed, the kept update and the
    site's residual carry on, and only codes and scales travel."""
    # no retry: beta's data would fail it again (a retry's cost, a trainer's start-up, for
    # nothing this test reads; see the module's docstring for where retries are tested)
    spec = _broken_beta(_spec("quorum", retries=0), xffl_home)
    spec.update(exchange={"update": "delta", "dtype": "nf4"},
                aggregation={"strategy": "diloco"})
    code, status = _submit(tmp_path, spec, "--wait")
    assert code == 1 and status["state"] == "failed"
    assert "1 valid update(s), the job needs 2 (failure.min_sites)" in status["message"]
    assert "xffl resume" in status["message"]
    (r1,) = status["rounds"]
    sites = {s["site"]: s for s in r1["sites"]}
    assert r1["state"] == "failed" and sites["alpha"]["state"] == "completed"
    assert sites["beta"]["state"] == "failed" and sites["beta"]["attempts"] == 1
    assert sites["beta"]["reason"].startswith("attempt 1: ")
    # the reason is the trainer's own sentence, as StreamFlow reported the step's failure
    assert f"{BETA_DATA}/flags.bin: meta.json promises 4096 flags" in sites["beta"]["reason"]
    assert not (Path(status["run_dir"]) / "rounds" / "1" / "global").exists()

    _prepare_beta(xffl_home)
    # `xffl resume --wait` follows the run to its end, as `xffl submit --wait` does
    result = runner.invoke(app, ["resume", status["run_id"][:12], "--wait", "--timeout", "300",
                                 "--json"])
    assert result.exit_code == 0, result.output
    resumed = check("status", json.loads(result.stdout))
    assert resumed["state"] == "completed" and resumed["rounds_done"] == 2, resumed["message"]
    final = wait_for_run(Registry(), status["run_id"], 0)
    assert final.state == "completed" and final.rounds_done == 2, final.message
    # alpha's round-1 update came back again, the same bytes, without training again
    first, again = admitted(_status(status["run_id"]), 1, "alpha")
    assert first == again and reused(status["run_dir"], 1)
    run_dir = Path(status["run_dir"])
    g1 = verify_checkpoint(run_dir / "rounds" / "1" / "global")
    assert set(g1.extra["sites"]) == {"alpha", "beta"}
    g2 = verify_checkpoint(run_dir / "rounds" / "2" / "global")
    assert g2.extra["aggregation"] == "diloco" and "server_momentum.safetensors" in g2.files
    assert g2.extra["server_state"]["loaded_from"]  # round 1's momentum, read back
    for site in ("alpha", "beta"):
        update = run_dir / "rounds" / "2" / "updates" / site
        sent = verify_checkpoint(update)
        assert {t.dtype for t in sent.tensors} == {"U8", "F32"}  # nf4 codes, fp32 scales
        assert sorted(p.name for p in update.iterdir() if p.name != "slurm_job.json") == \
            sorted(["manifest.json", *sent.files])
        # the residual stays beside the site's kept update: round 2's and the one it carried
        feedback = xffl_home / "sites" / site / "kept" / status["run_id"] / "error-feedback"
        assert sorted(p.name for p in feedback.iterdir()) == ["r1.safetensors", "r2.safetensors"]
    for site in admitted_sites(resumed, 2):  # an eighth of the bytes, plus headers
        assert site["sent_bytes"] < 0.2 * site["received_bytes"], site
    again = runner.invoke(app, ["resume", status["run_id"]])
    assert again.exit_code == 2 and "nothing to resume" in again.stderr
