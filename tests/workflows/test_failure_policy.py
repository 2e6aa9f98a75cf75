"""Failure policy on real runs (local sites): quorum and resume; `xffl logs` of the failed run.

A site's data whose meta.json promises a flags.bin that is not there (a prepare that did not
finish; `xffl submit` checks the tokens, not the flags) is a real failure of that site's
training job (the trainer exits 2); preparing the data again with `xffl data prepare` is the
fix a user would make before `xffl resume`. The SIGKILL and cron-tick cases run on the SLURM stack
(tests/workflows/test_failure_slurm.py, which also retries a real site job under
`failure.retries`; every attempt's reason in one line: tests/workflows/steps/test_attempts.py
and extensions/test_plugin.py); a round that goes on without a failed site under
`failure.min_sites` 1 is tests/workflows/test_other_format_round.py's, and a round's global
without its failed site test_failure_slurm.py's (its timed-out site gamma).

`xffl logs` of the failed run (issue 44 item 6), read before it is resumed: the cause first,
per site, as `xffl status` has it; StreamFlow's and the supervisor's tracebacks (StreamFlow
logs its own as it shuts down) hidden unless --debug; `logs -f` exits 1 after a failed run.
The run is made once, in :func:`quorum_run`, which records what each command printed before
the resume changes the run; `logs` of a completed run and the traceback filter on its own are
tests/cli/test_logs_cause.py's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.cli.schemas import check
from tests.conftest import QUICKSTART
from tests.workflows.runs import admitted, reused
from tests.workflows.site_data import write_shards
from tests.workflows.warm_ranks import warm_profile
from xffl.aggregator.exchange import verify_checkpoint
from xffl.cli.app import app
from xffl.core.layout import RunLayout
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
        site["profile"] = "warm-local"  # ranks forked from one warm interpreter (_submit)
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
    warm_profile(tmp_path / "site_profiles")  # tests/workflows/warm_ranks.py
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


@dataclass(frozen=True)
class QuorumRun:
    """The run of :func:`quorum_run`: what each command printed, in this order."""

    home: Path  # its XFFL_HOME
    failed_code: int
    failed: dict  # `xffl submit --wait --json` of the run that failed in round 1
    global_1_made: bool  # whether round 1's global existed after the failure
    raw_log: str  # streamflow.log + supervisor.log after the failure
    logs: dict[str, tuple[int, str]]  # `xffl logs ...` after the failure: exit code, stdout
    resumed_code: int  # `xffl resume --wait --json`, beta's data prepared again
    resumed_output: str


def _logs(*argv: str) -> tuple[int, str]:
    result = runner.invoke(app, ["logs", *argv])
    return result.exit_code, result.stdout


@pytest.fixture(scope="module")
def quorum_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuorumRun]:
    """DiLoCo over nf4 deltas with error feedback, beta's data broken: the run fails in round
    1 (no retry: beta's data would fail it again; a real site job's retry is
    test_failure_slurm's, every attempt's reason in one line test_attempts' and test_plugin's);
    `xffl logs` of it; beta's data prepared again; `xffl resume --wait`."""
    where = tmp_path_factory.mktemp("quorum")
    home = where / "xffl-home"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XFFL_HOME", str(home))
        env.setenv("XDG_CONFIG_HOME", str(where / "config"))
        spec = _broken_beta(_spec("quorum", retries=0), home)
        spec.update(exchange={"update": "delta", "dtype": "nf4"},
                    aggregation={"strategy": "diloco"})
        failed_code, failed = _submit(where, spec, "--wait")
        layout = RunLayout(Path(failed["run_dir"]))
        global_1_made = layout.global_dir(1).exists()
        raw = layout.streamflow_log.read_text() + layout.supervisor_log.read_text()
        run_id = failed["run_id"]
        logs = {"plain": _logs(run_id), "debug": _logs(run_id, "--debug", "-n", "100000"),
                "json": _logs("last", "--json"), "beta": _logs("--site", "beta", "--json"),
                "alpha": _logs("--site", "alpha", "--json"), "follow": _logs(run_id, "-f"),
                "follow-beta": _logs(run_id, "-f", "--site", "beta")}
        _prepare_beta(home)
        # `xffl resume --wait` follows the run to its end, as `xffl submit --wait` does
        resumed = runner.invoke(app, ["resume", run_id[:12], "--wait", "--timeout", "300",
                                      "--json"])
    yield QuorumRun(home, failed_code, failed, global_1_made, raw, logs, resumed.exit_code,
                    resumed.output)


@pytest.fixture
def in_quorum_run(quorum_run: QuorumRun, monkeypatch: pytest.MonkeyPatch) -> QuorumRun:
    """The run, XFFL_HOME pointing at its data directory."""
    monkeypatch.setenv("XFFL_HOME", str(quorum_run.home))
    return quorum_run


@pytest.mark.slow
def test_quorum_failure_then_resume(in_quorum_run: QuorumRun) -> None:
    """Also DiLoCo over nf4 deltas with error feedback: resumed, the kept update and the
    site's residual carry on, and only codes and scales travel."""
    run, status = in_quorum_run, in_quorum_run.failed
    assert run.failed_code == 1 and status["state"] == "failed"
    assert "1 valid update(s), the job needs 2 (failure.min_sites)" in status["message"]
    assert "xffl resume" in status["message"]
    (r1,) = status["rounds"]
    sites = {s["site"]: s for s in r1["sites"]}
    assert r1["state"] == "failed" and sites["alpha"]["state"] == "completed"
    assert sites["beta"]["state"] == "failed" and sites["beta"]["attempts"] == 1
    assert sites["beta"]["reason"].startswith("attempt 1: ")
    # the reason is the trainer's own sentence, as StreamFlow reported the step's failure
    assert f"{BETA_DATA}/flags.bin: meta.json promises 4096 flags" in sites["beta"]["reason"]
    assert not run.global_1_made

    assert run.resumed_code == 0, run.resumed_output
    resumed = check("status", json.loads(run.resumed_output))
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
        feedback = run.home / "sites" / site / "kept" / status["run_id"] / "error-feedback"
        assert sorted(p.name for p in feedback.iterdir()) == ["r1.safetensors", "r2.safetensors"]
    for site in admitted_sites(resumed, 2):  # an eighth of the bytes, plus headers
        assert site["sent_bytes"] < 0.2 * site["received_bytes"], site
    again = runner.invoke(app, ["resume", status["run_id"]])
    assert again.exit_code == 2 and "nothing to resume" in again.stderr


def _beta_reason(status: dict) -> str:
    (rnd,) = status["rounds"]
    (beta,) = [s for s in rnd["sites"] if s["site"] == "beta"]
    assert beta["state"] == "failed" and "meta.json promises 4096 flags" in beta["reason"]
    return str(beta["reason"])


@pytest.mark.slow
def test_logs_of_a_failed_run_start_with_its_cause_and_hide_tracebacks(quorum_run: QuorumRun
                                                                       ) -> None:
    status, raw = quorum_run.failed, quorum_run.raw_log
    assert raw.count("Traceback (most recent call last):") >= 2  # what the user was shown
    code, out = quorum_run.logs["plain"]
    assert code == 0, out
    lines = out.splitlines()
    assert lines[:3] == ["== cause ==", f"run {status['run_id']} failed: {status['message']}",
                         f"round 1, site beta: failed: {_beta_reason(status)}"]
    assert "Traceback" not in out and '  File "' not in out
    assert "(traceback hidden: --debug shows it)" in out
    # --debug, anywhere: every line of the logs' tails, the tracebacks with them
    code, debug = quorum_run.logs["debug"]
    assert code == 0 and debug.splitlines()[:3] == lines[:3]
    assert debug.count("Traceback (most recent call last):") == \
        raw.count("Traceback (most recent call last):")


@pytest.mark.slow
def test_logs_json_and_one_site(quorum_run: QuorumRun) -> None:
    data = check("logs", json.loads(quorum_run.logs["json"][1]))
    assert data["cause"][1] == f"round 1, site beta: failed: {_beta_reason(quorum_run.failed)}"
    assert not any("Traceback" in line for line in data["streamflow_log"] + data["runner_log"])
    beta = check("logs", json.loads(quorum_run.logs["beta"][1]))
    alpha = check("logs", json.loads(quorum_run.logs["alpha"][1]))
    assert beta["cause"] == data["cause"] and alpha["cause"] == data["cause"][:1]


@pytest.mark.slow
def test_logs_follow_exits_1_after_a_failed_run(quorum_run: QuorumRun) -> None:
    """As `xffl watch`: a script's `xffl logs -f RUN && next-step` must not go on (0 after a
    completed run: tests/cli/test_logs_cause.py)."""
    code, out = quorum_run.logs["follow"]
    assert code == 1, out
    assert f"round 1, site beta: failed: {_beta_reason(quorum_run.failed)}" in out
    assert quorum_run.logs["follow-beta"][0] == 1
