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

from xffl.site_profiles.schema import SiteProfile
from xffl.training.round_spec import (
    CHAIN_SAFETY_SECONDS,
    CONTINUE_EXIT,
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
