"""A chained round's batch script (training.checkpoint.chain): it asks SLURM for
``--signal=B:USR1@<margin>`` and hands the signal its shell gets to the launcher (bash runs a
trap only between commands: the round runs in the background while the shell waits); the
margin follows from one checkpoint's declared cost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from tests.workflows.warm_ranks import warm_env
from xffl.site_profiles.schema import SiteProfile
from xffl.training.chain_files import CONTINUE_EXIT
from xffl.training.round_spec import (
    CHAIN_SAFETY_SECONDS,
    SIGNAL_MAX_SECONDS,
    chain_margin,
    checkpoint_seconds,
)
from xffl.workflows.plan.deployments import batch_script

PROFILE = SiteProfile.model_validate({
    "name": "leo", "connector": {"type": "ssh", "host": "login.example.org"},
    "launcher": "torchrun", "slurm": {"partition": "boost", "time": "00:10:00"},
    "workdir": "/scratch/me/{site}"})

# the round's command StreamFlow would put in: a stand-in launcher that writes its process id
# where the launcher writes it, says so, and ends with the continue code on SIGUSR1
STAND_IN = (
    "import os, signal, sys\n"
    "open(os.environ['XFFL_LAUNCHER_PID_FILE'], 'w').write(str(os.getpid()))\n"
    f"signal.signal(signal.SIGUSR1, lambda *a: (print('launcher: USR1', flush=True), "
    f"sys.exit({CONTINUE_EXIT})))\n"
    "print('launcher: ready', flush=True)\n"
    "signal.pause()\n")


def test_margin_is_twice_the_checkpoint_plus_slurms_early_signal() -> None:
    """Twice the cost (the step in flight, the save) plus the 60 s SLURM may signal early,
    rounded up; capped at SLURM's 16-bit field. An 8B model's checkpoint (96 GB at 0.4 GB/s,
    241 s) gives 2 * 241 + 60 = 542 s."""
    assert chain_margin(0.0) == CHAIN_SAFETY_SECONDS
    assert chain_margin(10.2) == 21 + CHAIN_SAFETY_SECONDS
    eight_b = checkpoint_seconds(8_000_000_000)
    assert eight_b == pytest.approx(241.0)
    assert chain_margin(eight_b) == 542
    assert chain_margin(1e9) == SIGNAL_MAX_SECONDS
    assert chain_margin(float("nan")) == CHAIN_SAFETY_SECONDS


def test_script_without_chain_has_no_signal_and_execs() -> None:
    """One job per round (the default): no --signal, no trap, the launcher exec'd."""
    text = batch_script("r1", "leo", PROFILE, 2, "/data", by_hand=True)
    assert "--signal" not in text and "trap" not in text
    assert "\nexec " in text


def test_hand_run_script_signals_and_backgrounds_the_launcher() -> None:
    """The hand-run script: the --signal line, and the launcher in the background (not
    exec'd: the shell must stay to pass the signal on)."""
    text = batch_script("r1", "leo", PROFILE, 2, "/data", by_hand=True, chain_margin=542)
    assert "#SBATCH --signal=B:USR1@542" in text.splitlines()
    assert "\nexec " not in text and '--out "$OUT" &\n' in text


def test_batch_shell_forwards_usr1_to_the_launcher(tmp_path: Path) -> None:
    """The StreamFlow template, rendered with a stand-in round command and run by bash:
    SIGUSR1 to the shell (what SLURM's --signal=B: does) reaches the launcher, and the
    script ends with the launcher's exit code (75), not killed by the signal."""
    template = batch_script("r1", "leo", PROFILE, 2, "/data", by_hand=False, chain_margin=90)
    assert "#SBATCH --signal=B:USR1@90" in template.splitlines()
    command = f"{sys.executable} -c {__import__('shlex').quote(STAND_IN)}"
    script = tmp_path / "job.sh"
    script.write_text(jinja2.Template(template).render(streamflow_command=command))
    env = {**os.environ, "TMPDIR": str(tmp_path), "SLURM_JOB_ID": "4242"}
    proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "launcher: ready"
        os.kill(proc.pid, signal.SIGUSR1)  # the batch shell only, as SLURM's B: does
        rest, _ = proc.communicate(timeout=60)  # a signal not passed on never ends it
        assert proc.returncode == CONTINUE_EXIT, rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "launcher: USR1" in rest
    assert (tmp_path / "xffl-launcher-4242.pid").is_file()


def test_hand_run_script_keeps_the_round_in_kept_site() -> None:
    """A chained round run by hand keeps its checkpoints where the next sbatch of the same
    round finds them (``--keep``, default ``kept/<site>`` under the submit folder, or
    $XFFL_KEEP); one job per round needs no state folder."""
    text = batch_script("r1", "leo", PROFILE, 2, "/data", by_hand=True, chain_margin=542)
    assert "KEEP=${XFFL_KEEP:-kept/leo}" in text.splitlines()
    assert '  --keep "$KEEP" --slurm-job-name xffl-r1-leo-r"$ROUND" -- \\' in text.splitlines()
    assert "--keep" not in batch_script("r1", "leo", PROFILE, 2, "/data", by_hand=True)


@pytest.mark.slow
def test_a_chained_round_run_by_hand_continues_in_the_next_job(tmp_path: Path) -> None:
    """`xffl render` of a chained job, `sbatch/alpha.sh` run from the plan folder as sbatch
    would (bash; the profile's launcher is none, so no SLURM here). The first job is held
    after step 4 (a failpoint: the signal lands at a known step), gets SIGUSR1 as SLURM's
    --signal=B: sends it, checkpoints and ends with 75; the same command again continues the
    round at step 4 from kept/alpha and writes the update."""
    import json

    import yaml
    from typer.testing import CliRunner

    from tests.conftest import QUICKSTART
    from xffl.aggregator.exchange import verify_checkpoint
    from xffl.cli.app import app

    profiles = tmp_path / "site_profiles"
    profiles.mkdir()
    (profiles / "cluster.yaml").write_text(yaml.safe_dump({
        "name": "cluster", "connector": {"type": "ssh", "host": "login.example.org"},
        "slurm": {"partition": "batch", "time": "00:30:00"}, "launcher": "none",
        "python": sys.executable, "workdir": str(tmp_path / "work")}))
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec.update(name="byhand-chain", rounds=1, evaluation={"final": False})
    spec["training"].update(steps=8, checkpoint={"every": 4, "chain": True})
    spec["sites"] = spec["sites"][:1]
    spec["sites"][0].update(profile="cluster", ranks=1)
    spec["sites"][0]["data"]["path"] = str(tmp_path / "data" / "alpha")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    plan = tmp_path / "plan"
    done = CliRunner().invoke(app, ["render", str(job), "-o", str(plan), "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["run_id"]

    # warm ranks (tests/workflows/warm_ranks.py): the script by hand is under test, not the
    # ranks' imports
    env = warm_env({k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_"))})
    env["TMPDIR"] = str(tmp_path)
    first = subprocess.Popen(["bash", "sbatch/alpha.sh"], cwd=plan, text=True,
                             env={**env, "XFFL_FAILPOINT": "chain-wait-4"}, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert first.stderr is not None
    try:
        for line in first.stderr:  # bounded: the process ends, or the failpoint holds it
            if "failpoint chain-wait-4" in line:
                break
        else:
            raise AssertionError(f"the job ended before step 4 (exit {first.wait(60)})")
        os.kill(first.pid, signal.SIGUSR1)  # the batch shell only, as SLURM's B: does
        said = first.stderr.read()
        assert first.wait(timeout=120) == CONTINUE_EXIT, said[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert "round 1 continues in the next job at step 4 of 8" in said
    assert (plan / "kept" / "alpha").is_dir() and not (plan / "updates" / "alpha-r1").exists()

    second = subprocess.run(["bash", "sbatch/alpha.sh"], cwd=plan, env=env, text=True,
                            capture_output=True, timeout=300, check=False)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "continuing round 1 at step 4 from checkpoint" in second.stderr, second.stderr[-3000:]
    update = verify_checkpoint(plan / "updates" / "alpha-r1")
    assert (update.site, update.round) == ("alpha", 1)
    assert update.extra["checkpoints"]["resumed_at"] == 4, update.extra
