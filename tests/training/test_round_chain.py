"""Rounds longer than one job (training.checkpoint.chain): SIGUSR1 to the launcher (what the
batch shell forwards of SLURM's ``--signal``) makes both gloo ranks stop at the same step,
checkpoint it and end the job with exit 75; the next launch continues the round there and
writes bitwise the one-job round's update. Real launcher, forked torchrun ranks, no SLURM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.training.test_round_checkpoint import (
    EVERY,
    STEPS,
    make_job,
    reference,
    run_round,
    site,  # noqa: F401 (the module fixture)
    tensor_digests,
)
from xffl.aggregator.exchange import verify_checkpoint
from xffl.training.chain import CONTINUE_LINE, JOBS_FILE
from xffl.training.config import RoundCheckpointSpec, TrainJob
from xffl.training.round_spec import CONTINUE_EXIT
from xffl.training.round_state import COMPLETE, ROOT

_CONTINUES = re.compile(re.escape(CONTINUE_LINE).replace(r"\{round\}", "1").replace(
    r"\{step\}", "([0-9]+)").replace(r"\{steps\}", str(STEPS)))


def chained(job: TrainJob) -> TrainJob:
    """The job with ``training.checkpoint.chain`` on."""
    return job.model_copy(update={"training": job.training.model_copy(update={
        "checkpoint": RoundCheckpointSpec(every=EVERY, keep=2, chain=True)})})


def signalled_round(where: Path, job: TrainJob, model: Path, state: Path,
                    out: Path) -> tuple[int, str]:
    """One launch that gets SIGUSR1 once the step-10 checkpoint is complete (its progress
    line read from the launcher's stderr: an event, no sleep); exit code and stderr."""
    job_file = where / "job-chain.json"
    job_file.write_text(job.model_dump_json())
    env = {k: v for k, v in os.environ.items() if k != "XFFL_FAILPOINT"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "xffl.training.launch", "--ranks", "2", "--launcher",
         "torchrun", "--keep", str(state), "--", "--job", str(job_file), "--round", "1",
         "--model", str(model), "--out", str(out)],
        env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stderr is not None
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if f"checkpoint complete: round 1 step {EVERY} " in line:
                os.kill(proc.pid, signal.SIGUSR1)  # the launcher only, as the shell does
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return rc, "".join(lines)


@pytest.mark.slow
def test_signalled_job_continues_in_the_next_bitwise(tmp_path: Path,
                                                     site: tuple[Path, Path]) -> None:  # noqa: F811
    """SIGUSR1 after the step-10 checkpoint: both ranks stop at one step K (> 10), its
    checkpoint is complete, the launcher exits 75 and writes no update; the next launch
    continues at step K (not at 10: the stop saved its own step) and its update is bitwise
    the one-job round's (sha256 of every tensor, the per-step losses); the state folder lists
    the round's two jobs with their steps. No tolerance: same operations, same bits."""
    ref_manifest, ref = reference(tmp_path, site, "fsdp")
    model, data = site
    job, state, out = chained(make_job(data, "fsdp", True)), tmp_path / "state", tmp_path / "out"
    rc, err = signalled_round(tmp_path, job, model, state, out)
    assert rc == CONTINUE_EXIT, err
    match = _CONTINUES.search(err)
    assert match is not None, err
    k = int(match.group(1))
    assert EVERY < k < STEPS, err
    (folder,) = list((state / ROOT).iterdir())
    assert (folder / f"step-{k:06d}" / COMPLETE).is_file(), (k, sorted(folder.iterdir()))
    assert f"checkpoint complete: round 1 step {k} " in err  # printed before the job ended
    assert not (out / "model.safetensors").exists()
    rc, err2 = run_round(tmp_path, job, model, state, out)
    assert rc == 0, err2
    assert f"continuing round 1 at step {k} from checkpoint" in err2, err2
    update = verify_checkpoint(out)
    assert update.extra["checkpoints"]["resumed_at"] == k
    assert update.extra["losses"] == ref_manifest.extra["losses"]
    assert tensor_digests(out) == tensor_digests(ref)
    jobs = json.loads((state / JOBS_FILE).read_text())["jobs"]
    assert [(j["step_from"], j["step_to"], j["ended"]) for j in jobs] == \
        [(0, k, "continued"), (k, STEPS, "completed")]
