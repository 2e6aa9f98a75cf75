"""Start the per-rank trainer under torchrun, srun or as one process, and judge the outcome.

``python -m xffl.training.launch --ranks 2 --launcher torchrun -- --job J --round 1 ...``

gloo processes very rarely abort at exit after writing correct output ("terminate called
without an active exception"). When the ranks exit non-zero but the output directory holds a
checkpoint that is new and passes verification, the round counts as done (exit 0, with a
warning on stderr); otherwise the launcher's failure code is returned.

With ``--keep DIR`` a site's round is idempotent: the launcher keeps the update it wrote in
``DIR/r<round>`` (hard links, the previous round's removed), and when the same round is run
again from the same global model (a retry after the transfer failed, ``xffl resume`` after
the coordinator stopped), it hands that update back instead of training again. The ranks get
``DIR`` as the site's state folder too (``XFFL_SITE_STATE``): a quantized exchange keeps its
error feedback there (:mod:`xffl.training.feedback`), beside the kept update, never in it,
and ``training.checkpoint`` its checkpoints inside the round (:mod:`xffl.training.round_state`:
a rerun of a round cut short continues from them; removed once the round's update is kept).

A chained round (``training.checkpoint.chain``, :mod:`xffl.training.chain`): SIGUSR1 asks
the ranks to checkpoint and end the job; the launcher then exits 75 (``CONTINUE_EXIT``: no
update, the next job continues the round) and keeps the list of the round's jobs, which the
job that finishes the round writes into ``slurm_job.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from xffl.aggregator.names import MANIFEST_FILE
from xffl.core.errors import XfflError
from xffl.core.files import link_files
from xffl.core.resources import usable_cpus
from xffl.core.startup import collect_less
from xffl.training import slurm_job
from xffl.training.chain_files import (
    CONTINUE_EXIT,
    ROOT,
    SITE_STATE_ENV,
    clear,
    read_end,
    record_job,
    request_stop,
)
from xffl.training.forked import option_value
from xffl.training.progress import STEP_LOG_ENV, STEP_LOG_FILE
from xffl.training.threads import OMP_ENV, rank_threads, ranks_per_node

Launcher = Literal["torchrun", "srun", "none"]
# the epoch time the launcher started, handed to the ranks: they report their start-up time
LAUNCHED_AT_ENV = "XFFL_LAUNCHED_AT"
TRAINER_MODULE = "xffl.training"
EVALUATE_MODULE = "xffl.training.evaluate_models"  # cross-site evaluation (xffl evaluate)
FORKED_MODULE = "xffl.training.forked"
# the words that run the ranks' Python when it is not the launcher's: a site's container line
# (``ch-run --cd={cwd} --bind=... IMAGE -- python3``), exported by the batch script; the
# launcher's working folder replaces {cwd}
RANK_PYTHON_ENV = "XFFL_RANK_PYTHON"
CWD_WORD = "{cwd}"
#: the file the launcher writes its process id to, for the batch shell's USR1 trap (chain)
PID_FILE_ENV = "XFFL_LAUNCHER_PID_FILE"
FORK_ENV = "XFFL_FORK_RANKS"  # "0": exec every rank as torchrun does, even on a CPU machine
# device files of GPUs a rank could use: NVIDIA, AMD (ROCm's kfd), Intel and other DRM render
ACCELERATOR_DEVICES = ("nvidia[0-9]*", "kfd", "dri/renderD*", "accel/*")


def build_command(ranks: int, launcher: Launcher, trainer_args: Sequence[str],
                  module: str = TRAINER_MODULE, python: str | Sequence[str] | None = None,
                  fork: bool = False) -> list[str]:
    """The argv that starts ``ranks`` trainer processes with the chosen launcher.

    One rank under torchrun needs no rendezvous: it runs as one process (what torchrun would
    start, without torchrun's own interpreter and its second import of torch). With ``fork``
    (CPU machines, :func:`forkable`), torchrun's ranks are forked from one interpreter that
    imported the module once (:mod:`xffl.training.forked`) instead of exec'd one by one.
    ``python`` may be several words, a container's line that ends with the image's Python:
    the ranks (and torchrun, which starts them) then run inside the container.
    """
    py = [python or sys.executable] if python is None or isinstance(python, str) \
        else list(python)
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    if launcher == "torchrun" and ranks == 1:
        launcher = "none"
    if launcher == "torchrun" and fork:
        return [*py, "-m", FORKED_MODULE, "--nproc-per-node", str(ranks), "-m", module,
                *trainer_args]
    if launcher == "torchrun":
        return [*py, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", str(ranks), "-m", module, *trainer_args]
    if launcher == "srun":
        return ["srun", f"--ntasks={ranks}", "--kill-on-bad-exit=1", *py, "-m", module,
                *trainer_args]
    if launcher == "none":
        if ranks != 1:
            raise ValueError(f"launcher 'none' runs one process; got ranks={ranks}")
        return [*py, "-m", module, *trainer_args]
    known = ", ".join(get_args(Launcher))
    raise ValueError(f"unknown launcher {launcher!r}; choose one of {known}")


def rank_python_words(env: Mapping[str, str]) -> list[str] | None:
    """The ranks' Python as ``XFFL_RANK_PYTHON`` in ``env`` names it (words, a container's
    line; the working-folder word filled in), or None for this interpreter's."""
    return [w.replace(CWD_WORD, os.getcwd())
            for w in shlex.split(env.get(RANK_PYTHON_ENV, ""))] or None


def forkable(env: Mapping[str, str], devices: Path = Path("/dev")) -> bool:
    """Whether torchrun's ranks may be forked here: no accelerator a rank could compute on.

    A CUDA (or ROCm, XPU) context does not survive ``fork``, so any GPU device file keeps
    torchrun's exec'd ranks; ``XFFL_FORK_RANKS=0`` (a site profile's ``env``) does too.
    """
    if env.get(FORK_ENV, "").strip() == "0":
        return False
    return not any(any(devices.glob(pattern)) for pattern in ACCELERATOR_DEVICES)


def _manifest_fingerprint(out_dir: Path) -> str | None:
    """sha256 of out_dir's manifest.json (cheap: tells a freshly written checkpoint)."""
    try:
        return hashlib.sha256((Path(out_dir) / MANIFEST_FILE).read_bytes()).hexdigest()
    except OSError:
        return None


def _exit_code(rc: int) -> int:
    """Map a killed child's negative return code to the shell's 128 + signal."""
    return 128 - rc if rc < 0 else rc


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


def reuse_kept(keep: Path, rnd: int, model: Path, out_dir: Path) -> bool:
    """Put the update kept for round ``rnd`` from the global ``model`` into ``out_dir``.

    True when there was one (verified: checksums, round, parent digest); False otherwise.
    """
    from xffl.aggregator.exchange import read_manifest, verify_checkpoint

    kept = Path(keep) / f"r{rnd}"
    if not (kept / MANIFEST_FILE).is_file():
        return False
    try:
        manifest = verify_checkpoint(kept)
        parent = read_manifest(model).digest()
    except XfflError:
        return False
    if manifest.round != rnd or manifest.parent != parent:
        return False
    shutil.rmtree(out_dir, ignore_errors=True)
    link_files(kept, Path(out_dir), [MANIFEST_FILE, *manifest.files])
    return True


def keep_update(out_dir: Path, keep: Path, rnd: int) -> None:
    """Keep the update in ``out_dir`` as ``keep/r<rnd>`` (replacing older rounds' updates)."""
    from xffl.aggregator.exchange import read_manifest

    manifest = read_manifest(out_dir)
    keep = Path(keep)
    staging = keep / f".r{rnd}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    link_files(Path(out_dir), staging, [MANIFEST_FILE, *manifest.files])
    final = keep / f"r{rnd}"
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    for other in keep.iterdir():
        if other.name != final.name and other.name.startswith("r"):
            shutil.rmtree(other, ignore_errors=True)


def drop_round_checkpoints(keep: Path) -> None:
    """Remove the checkpoints inside the round (training.checkpoint) once its update is kept:
    a rerun hands the kept update back and never continues from them."""
    shutil.rmtree(Path(keep) / ROOT, ignore_errors=True)


def launch(ranks: int, launcher: Launcher, trainer_args: Sequence[str], out_dir: Path, *,
           module: str = TRAINER_MODULE, env: Mapping[str, str] | None = None,
           slurm_job_name: str | None = None, keep: Path | None = None) -> int:
    """Run the trainer ranks, streaming their output; 0 when a verified checkpoint was written.

    Inside a SLURM job the job is named ``slurm_job_name`` first and its record is written
    beside the checkpoint at the end (:mod:`xffl.training.slurm_job`). With ``keep``, a round
    already trained from the same global model is handed back, not trained again.
    """
    launched_at = time.time()
    job = slurm_job.start(slurm_job_name, env)
    rnd, model = option_value(trainer_args, "--round"), option_value(trainer_args, "--model")
    if keep is not None and rnd is not None and model is not None and rnd.isdigit() \
            and reuse_kept(keep, int(rnd), Path(model), out_dir):
        print(f"xffl.training.launch: reusing the update this site trained for round {rnd} "
              f"from the same global model ({keep}/r{rnd}); not training again.",
              file=sys.stderr, flush=True)
        rc = 0
    else:
        _listen(keep)
        rc = _run_ranks(ranks, launcher, trainer_args, out_dir, module=module,
                        env={**(os.environ if env is None else env),
                             LAUNCHED_AT_ENV: repr(launched_at),
                             **({} if keep is None else {
                                 SITE_STATE_ENV: str(Path(keep).absolute())})})
        if rc == 0 and keep is not None and rnd is not None and rnd.isdigit():
            try:
                keep_update(out_dir, keep, int(rnd))
                drop_round_checkpoints(keep)
            except (OSError, XfflError) as exc:  # the round is done; only a rerun would train
                print(f"xffl.training.launch: warning: could not keep the update in {keep} "
                      f"({exc}); a rerun of this round would train again.",
                      file=sys.stderr, flush=True)
    jobs = _chain_jobs(keep, rnd, job) if module == TRAINER_MODULE else None
    slurm_job.finish(job, out_dir, rc, round_jobs=jobs if rc == 0 else None)
    return rc


def _listen(keep: Path | None) -> None:
    """Pass SIGUSR1 (SLURM's ``--signal``, forwarded by the batch shell) on to the ranks of
    a chained round as a request in the state folder (:mod:`xffl.training.chain`)."""
    if keep is None:
        return
    def on_usr1(signum: int, frame: object) -> None:
        print("xffl.training.launch: SIGUSR1: asking the ranks to checkpoint and end this job "
              "(training.checkpoint.chain).", file=sys.stderr, flush=True)
        request_stop(keep)

    Path(keep).mkdir(parents=True, exist_ok=True)
    clear(keep)
    signal.signal(signal.SIGUSR1, on_usr1)
    pid_file = os.environ.get(PID_FILE_ENV)
    if pid_file:  # where the batch shell's trap finds whom to signal
        try:
            Path(pid_file).write_text(f"{os.getpid()}\n")
        except OSError as exc:
            print(f"xffl.training.launch: warning: cannot write {pid_file} ({exc}); SLURM's "
                  "signal will not reach this job.", file=sys.stderr, flush=True)


def _chain_jobs(keep: Path | None, rnd: str | None,
                job: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """A chained round: this job added to the round's list of jobs; the list (None: no
    chained round)."""
    if keep is None or rnd is None or not rnd.isdigit():
        return None
    end = read_end(keep, int(rnd))
    if end is None:
        return None
    try:
        return record_job(keep, end, job, time.time())
    except OSError as exc:
        print(f"xffl.training.launch: warning: could not record this job in {keep} ({exc}).",
              file=sys.stderr, flush=True)
        return None


def _continues(state: Path, rnd: str | None) -> bool:
    """Whether rank 0 ended this job to continue the round in the next (chain)."""
    end = read_end(state, int(rnd)) if rnd is not None and rnd.isdigit() else None
    return end is not None and end.get("continues") is True


def _run_ranks(ranks: int, launcher: Launcher, trainer_args: Sequence[str], out_dir: Path, *,
               module: str, env: Mapping[str, str] | None) -> int:
    """Start the ranks and judge the outcome (see the module doc)."""
    child_env = dict(os.environ if env is None else env)
    command = build_command(ranks, launcher, trainer_args, module=module,
                            python=rank_python_words(child_env),
                            fork=forkable(child_env))
    threads = rank_threads(child_env, ranks_per_node(ranks, child_env, launcher), usable_cpus())
    if threads is not None:
        child_env[OMP_ENV] = str(threads)
    if module == TRAINER_MODULE:  # rank 0's step lines, also beside the update as it goes
        child_env[STEP_LOG_ENV] = str(Path(out_dir).absolute().parent / STEP_LOG_FILE)
    before = _manifest_fingerprint(out_dir)
    existed = Path(out_dir).exists()
    try:
        rc = subprocess.call(command, env=child_env)
    except FileNotFoundError as exc:
        print(f"xffl.training.launch: cannot start {command[0]!r} ({exc.strerror}).",
              file=sys.stderr, flush=True)
        return 127
    if rc == 0:
        return 0
    after = _manifest_fingerprint(out_dir)
    if after is not None and after != before:
        from xffl.aggregator.exchange import verify_checkpoint

        try:
            verify_checkpoint(Path(out_dir))
        except XfflError:
            pass
        else:
            print(
                f"xffl.training.launch: warning: the ranks ended with {_describe(rc)}, but "
                f"{out_dir} holds a new checkpoint that passes verification; treating the "
                "round as complete (a known, rare gloo abort at process exit).",
                file=sys.stderr, flush=True,
            )
            return 0
    if module != TRAINER_MODULE:  # an evaluation: its result is one new file
        if not existed and Path(out_dir).is_file():
            print(f"xffl.training.launch: warning: the ranks ended with {_describe(rc)} after "
                  f"writing {out_dir}; keeping it (the reader checks it).", file=sys.stderr,
                  flush=True)
            return 0
        print(f"xffl.training.launch: {module} failed ({_describe(rc)}).", file=sys.stderr,
              flush=True)
        return _exit_code(rc) or 1
    state = child_env.get(SITE_STATE_ENV)
    if state and _continues(Path(state), option_value(trainer_args, "--round")):
        print(f"xffl.training.launch: the ranks checkpointed and ended this job ({_describe(rc)})"
              f"; the round continues in the next job (exit {CONTINUE_EXIT}).",
              file=sys.stderr, flush=True)
        return CONTINUE_EXIT
    print(f"xffl.training.launch: training failed ({_describe(rc)}); no new valid checkpoint "
          f"in {out_dir}.", file=sys.stderr, flush=True)
    return _exit_code(rc) or 1


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: options before ``--`` are the launcher's, after it the trainer's."""
    collect_less()  # before the imports it makes (see xffl.core.startup)
    os.umask(0o077)  # the update and the kept copy at the site are the site user's alone
    args_list = list(sys.argv[1:] if argv is None else argv)
    split = args_list.index("--") if "--" in args_list else len(args_list)
    own, trainer_args = args_list[:split], args_list[split + 1:]
    parser = argparse.ArgumentParser(
        prog="python -m xffl.training.launch",
        description="Start the per-rank trainer with torchrun, srun or as one process.",
        epilog="example: python -m xffl.training.launch --ranks 2 --launcher torchrun -- "
        "--job job.json --round 1 --model rounds/0/global --out rounds/1/site-a",
    )
    parser.add_argument("--ranks", type=int, default=1, help="processes to start")
    parser.add_argument("--launcher", choices=get_args(Launcher), default="torchrun")
    parser.add_argument("--out", type=Path, default=None,
                        help="checkpoint directory to check (default: the trainer's --out)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="folder that keeps the site's last update: a round run again from "
                        "the same global model hands it back instead of training again")
    parser.add_argument("--module", choices=(TRAINER_MODULE, EVALUATE_MODULE),
                        default=TRAINER_MODULE, help="the per-rank module the ranks run")
    parser.add_argument("--slurm-job-name", default=None,
                        help="inside a SLURM job: the name the job should carry (renamed with "
                        "scontrol if it differs); its record goes to OUT/slurm_job.json")
    args = parser.parse_args(own)
    out_arg = option_value(trainer_args, "--out")
    out_dir = args.out or (Path(out_arg) if out_arg is not None else None)
    if out_dir is None:
        parser.error("the trainer arguments after -- need --out DIR (or pass --out here)")
    try:
        return launch(args.ranks, args.launcher, trainer_args, out_dir, module=args.module,
                      slurm_job_name=args.slurm_job_name, keep=args.keep)
    except ValueError as exc:
        parser.error(str(exc))
    return 2


if __name__ == "__main__":
    sys.exit(main())
