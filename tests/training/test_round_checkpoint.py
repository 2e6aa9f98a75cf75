"""Checkpoints inside a round (training.checkpoint): a killed 2-rank gloo round, run again,
continues from its newest complete checkpoint and writes bitwise the uninterrupted update;
checkpoints of another round, another global model, or cut off during their save are refused;
a round longer than one job (``chain``) stops at SIGUSR1 and continues in the next job. The
tests share the uninterrupted rounds (one per mode) and the killed round of each mode.

Every round here is the real launcher (``python -m xffl.training.launch``, forked torchrun
ranks on gloo) in a session of its own; its torchrun engine, and so its ranks, are forked from
the tests' warm rank server (tests/workflows/warm_ranks.py: no import of torch per launch), in
a process group of their own, so that a ``...@group`` failpoint SIGKILLs the engine and both
ranks at once, as ``scancel`` or a node failure would; the launcher sees its ranks killed and
fails the round (it writes nothing a rerun reads).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.workflows.warm_ranks import warm_env
from xffl.aggregator.exchange import Manifest, verify_checkpoint
from xffl.training.chain_files import CONTINUE_EXIT, CONTINUE_LINE, JOBS_FILE, ROOT
from xffl.training.checkpoint import init_global
from xffl.training.config import (
    DataSpec,
    ModelSpec,
    RoundCheckpointSpec,
    TrainingSpec,
    TrainJob,
)
from xffl.training.round_state import COMPLETE

STEPS, EVERY = 12, 3
KILL = 8  # the killed rounds die after this step: the step-3 and step-6 checkpoints are kept
HOLD = 4  # the signalled job's rank 0 holds after this step until the stop is asked (at most)
MODEL = ModelSpec(preset="tiny-test", overrides={"attention_dropout": 0.1})
_CONTINUES = re.compile(re.escape(CONTINUE_LINE).replace(r"\{round\}", "1").replace(
    r"\{step\}", "([0-9]+)").replace(r"\{steps\}", str(STEPS)))


def make_job(data: Path, mode: str, checkpoint: bool) -> TrainJob:
    """12 steps of the tiny-test model with attention dropout (the ranks' RNG matters), 2
    micro-batches a step, cosine schedule with warm-up: every piece a continued round must
    restore moves the result if it is not restored."""
    return TrainJob(
        run_id="run-ckpt", site="site-a", rounds=2, model=MODEL,
        training=TrainingSpec(steps=STEPS, batch_size=2, grad_accum=2, seq_len=16, lr=3e-3,
                              seed=5, schedule="cosine", warmup_steps=5, data_parallel=mode,
                              checkpoint=RoundCheckpointSpec(every=EVERY, keep=2)
                              if checkpoint else None),
        data=DataSpec(path=str(data), synthetic="alpha", synthetic_sequences=48),
    )


def run_round(where: Path, job: TrainJob, model: Path, state: Path, out: Path,
              failpoint: str | None = None) -> tuple[int, str]:
    """One site round through the launcher (2 ranks); its exit code and stderr."""
    job_file = where / f"job-{out.name}.json"
    job_file.write_text(job.model_dump_json())
    env = {k: v for k, v in warm_env().items() if k != "XFFL_FAILPOINT"}
    if failpoint is not None:
        env["XFFL_FAILPOINT"] = failpoint
    proc = subprocess.run(
        [sys.executable, "-m", "xffl.training.launch", "--ranks", "2", "--launcher",
         "torchrun", "--keep", str(state), "--", "--job", str(job_file), "--round", "1",
         "--model", str(model), "--out", str(out)],
        env=env, capture_output=True, text=True, start_new_session=True, timeout=600)
    return proc.returncode, proc.stderr


def tensor_digests(update: Path) -> dict[str, str]:
    """sha256 of every tensor's bytes in an update, by name."""
    with safe_open(str(update / "model.safetensors"), "pt") as fh:
        return {name: hashlib.sha256(fh.get_tensor(name).numpy().tobytes()).hexdigest()
                for name in fh.keys()}  # noqa: SIM118 (safe_open is no mapping)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The round-0 global model and the site's synthetic data folder (made by the ranks)."""
    where = tmp_path_factory.mktemp("site")
    init_global("run-ckpt", MODEL, 0, where / "global0")
    return where / "global0", where / "data"


_REFERENCES: dict[str, tuple[Manifest, Path]] = {}


def reference(where: Path, site: tuple[Path, Path], mode: str) -> tuple[Manifest, Path]:
    """The uninterrupted round, without checkpoints (what a job wrote before they existed);
    once per module and mode."""
    if mode not in _REFERENCES:
        model, data = site
        folder = site[0].parent / f"ref-{mode}"
        folder.mkdir()
        rc, err = run_round(folder, make_job(data, mode, False), model, folder / "state",
                            folder / "ref")
        assert rc == 0, err
        _REFERENCES[mode] = verify_checkpoint(folder / "ref"), folder / "ref"
    return _REFERENCES[mode]


_KILLED: dict[str, tuple[int, str, Path, Path]] = {}


def killed(site: tuple[Path, Path], mode: str) -> tuple[int, str, Path, Path]:
    """The checkpointed round killed (SIGKILL of both ranks and their engine) after step 8:
    its exit code, stderr, the state it left and a copy of that state's step-6 checkpoint
    (the complete checkpoint test_foreign_and_half_written_checkpoints_are_refused plants
    as other rounds' and globals'); once per module and mode."""
    if mode not in _KILLED:
        model, data = site
        folder = site[0].parent / f"killed-{mode}"
        folder.mkdir()
        rc, err = run_round(folder, make_job(data, mode, True), model, folder / "state",
                            folder / "out", failpoint=f"round-step-{KILL}@group")
        donor = folder / "donor" / f"step-{2 * EVERY:06d}"
        if rc != 0 and (folder / "state" / ROOT).is_dir():
            shutil.copytree(next((folder / "state" / ROOT).iterdir()) / donor.name, donor)
        _KILLED[mode] = rc, err, folder / "state", donor
    return _KILLED[mode]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_killed_round_continues_bitwise(tmp_path: Path, site: tuple[Path, Path],
                                        mode: str) -> None:
    """Killed (SIGKILL of both ranks and their engine) after step 8, the round run again
    starts at step 6 and its update is bitwise the uninterrupted round's: the same tensors
    (sha256 of each), the same per-step losses. No tolerance: on CPU the same operations on
    the same values in the same order give the same bits, so any state not restored (data
    position, RNG, AdamW moments and step, the schedule's position) shows as a difference."""
    ref_manifest, ref = reference(tmp_path, site, mode)
    model, data = site
    job = make_job(data, mode, True)
    rc, err, state, _ = killed(site, mode)
    assert rc != 0, err
    folders = list((state / ROOT).iterdir())
    assert len(folders) == 1 and folders[0].name.startswith("run-ckpt-r1-")
    assert sorted(p.name for p in folders[0].iterdir()) == ["step-000003", "step-000006"]
    assert (folders[0] / "step-000006" / COMPLETE).is_file()
    assert os.stat(folders[0]).st_mode & 0o077 == 0  # the site user's alone
    rc, err = run_round(tmp_path, job, model, state, tmp_path / "out")
    assert rc == 0, err
    assert f"continuing round 1 at step 6 from checkpoint {folders[0] / 'step-000006'}" \
        in err
    update = verify_checkpoint(tmp_path / "out")
    assert update.extra["checkpoints"]["resumed_at"] == 6
    assert update.extra["checkpoints"]["saved"] == 1  # step 9 (none at the last step)
    assert update.extra["losses"] == ref_manifest.extra["losses"]
    assert update.num_tokens == ref_manifest.num_tokens
    assert tensor_digests(tmp_path / "out") == tensor_digests(ref)
    assert not (state / ROOT).exists()  # removed once the update was kept


def _plant(source: Path, state: Path, folder: str, **marker: object) -> Path:
    """A copy of a complete checkpoint as another round's or global's would be."""
    target = state / ROOT / folder / source.name
    shutil.copytree(source, target)
    data = json.loads((target / COMPLETE).read_text())
    (target / COMPLETE).write_text(json.dumps({**data, **marker}))
    return target


@pytest.mark.slow
def test_foreign_and_half_written_checkpoints_are_refused(
        tmp_path: Path, site: tuple[Path, Path]) -> None:
    """A checkpoint whose job was killed during its save (dcp's files written, the marker
    not), and complete ones of round 2 and of another global model: each is refused with
    its reason, and the job starts the round over (bitwise the uninterrupted update)."""
    mode = "fsdp"
    ref_manifest, ref = reference(tmp_path, site, mode)
    model, data = site
    job, state = make_job(data, mode, True), tmp_path / "state"
    rc, err = run_round(tmp_path, job, model, state, tmp_path / "out",
                        failpoint="round-checkpoint-marker@group")
    assert rc != 0, err
    (ours,) = list((state / ROOT).iterdir())
    half = ours / f"step-{EVERY:06d}"
    assert (half / ".metadata").is_file() and not (half / COMPLETE).exists()
    # complete checkpoints to copy: the same job's step 6, killed at step 8 (the round
    # test_killed_round_continues_bitwise continues)
    donor = killed(site, mode)[3]
    assert (donor / COMPLETE).is_file(), killed(site, mode)[1]
    other_round = _plant(donor, state, ours.name.replace("-r1-", "-r2-"), round=2)
    other_global = _plant(donor, state, "run-ckpt-r1-0123456789abcdef", parent="0" * 64)
    rc, err = run_round(tmp_path, job, model, state, tmp_path / "out")
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if "not continuing from checkpoint" in ln]
    assert any(str(half) in ln and "incomplete" in ln for ln in lines), err
    assert any(str(other_round) in ln and "of round 2, not 1" in ln for ln in lines), err
    assert any(str(other_global) in ln and "of another global model" in ln
               for ln in lines), err
    assert "round 1 starts from the global model" in err
    update = verify_checkpoint(tmp_path / "out")
    assert update.extra["checkpoints"]["resumed_at"] == 0
    assert update.extra["losses"] == ref_manifest.extra["losses"]
    assert tensor_digests(tmp_path / "out") == tensor_digests(ref)
    # the round's update is kept: no checkpoint of it (or of others) is needed any more
    assert not (state / ROOT).exists() and (state / "r1").is_dir()


def test_one_process_round_keeps_the_newest_and_continues(tmp_path: Path) -> None:
    """One rank (no process group: dcp without collectives): checkpoints after steps 1..5 of
    6 with keep 2 leave steps 4 and 5; the same round run again continues at step 5, takes
    the last step alone, and writes the same tensors and losses."""
    from xffl.training.data import ensure_synthetic
    from xffl.training.trainer import train_round

    data = tmp_path / "data"
    job = make_job(data, "ddp", True)
    job = job.model_copy(update={"training": job.training.model_copy(update={
        "steps": 6, "checkpoint": RoundCheckpointSpec(every=1, keep=2)})})
    ensure_synthetic(data, "alpha", 48, job.training.seq_len)
    model = tmp_path / "global0"
    init_global("run-ckpt", MODEL, 0, model)
    state = tmp_path / "state"
    first = train_round(job, 1, model, data, tmp_path / "first", state_dir=state)
    (folder,) = list((state / ROOT).iterdir())
    assert sorted(p.name for p in folder.iterdir()) == ["step-000004", "step-000005"]
    assert all((p / COMPLETE).is_file() for p in folder.iterdir())
    again = train_round(job, 1, model, data, tmp_path / "again", state_dir=state)
    assert again.extra["checkpoints"] == {**again.extra["checkpoints"], "resumed_at": 5,
                                          "saved": 0}
    assert again.extra["losses"] == first.extra["losses"]
    assert tensor_digests(tmp_path / "again") == tensor_digests(tmp_path / "first")


def chained(job: TrainJob) -> TrainJob:
    """The job with ``training.checkpoint.chain`` on."""
    return job.model_copy(update={"training": job.training.model_copy(update={
        "checkpoint": RoundCheckpointSpec(every=EVERY, keep=2, chain=True)})})


def signalled_round(where: Path, job: TrainJob, model: Path, state: Path,
                    out: Path) -> tuple[int, str]:
    """One launch that gets SIGUSR1 once the step-3 checkpoint is complete (its progress
    line read from the launcher's stderr: an event, no sleep); its rank 0 holds after step
    HOLD until the stop is asked (the ``chain-wait-K`` failpoint: the request lands before
    the round's last step however slow the machine); exit code and stderr."""
    job_file = where / "job-chain.json"
    job_file.write_text(job.model_dump_json())
    env = {**warm_env(), "XFFL_FAILPOINT": f"chain-wait-{HOLD}"}
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
                                                     site: tuple[Path, Path]) -> None:
    """SIGUSR1 after the step-3 checkpoint: both ranks stop at one step K (3 < K <= HOLD), its
    checkpoint is complete, the launcher exits 75 and writes no update; the next launch
    continues at step K (not at 3: the stop saved its own step) and its update is bitwise
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
    assert EVERY < k <= HOLD, err
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
