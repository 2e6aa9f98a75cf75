"""Start the per-rank trainer under torchrun, srun or as one process, and judge the outcome.

``python -m xffl.training.launch --ranks 2 --launcher torchrun -- --job J --round 1 ...``

gloo processes very rarely abort at exit after writing correct output ("terminate called
without an active exception", STACK.md). When the ranks exit non-zero but the output
directory holds a checkpoint that is new and passes verification, the round counts as done
(exit 0, with a warning on stderr); otherwise the launcher's failure code is returned.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, get_args

from xffl.aggregator.exchange import MANIFEST_FILE, verify_checkpoint
from xffl.core.errors import XfflError
from xffl.training import slurm_job

Launcher = Literal["torchrun", "srun", "none"]
TRAINER_MODULE = "xffl.training"


def build_command(ranks: int, launcher: Launcher, trainer_args: Sequence[str],
                  module: str = TRAINER_MODULE, python: str | None = None) -> list[str]:
    """The argv that starts ``ranks`` trainer processes with the chosen launcher."""
    py = python or sys.executable
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    if launcher == "torchrun":
        return [py, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", str(ranks), "-m", module, *trainer_args]
    if launcher == "srun":
        return ["srun", f"--ntasks={ranks}", "--kill-on-bad-exit=1", py, "-m", module,
                *trainer_args]
    if launcher == "none":
        if ranks != 1:
            raise ValueError(f"launcher 'none' runs one process; got ranks={ranks}")
        return [py, "-m", module, *trainer_args]
    known = ", ".join(get_args(Launcher))
    raise ValueError(f"unknown launcher {launcher!r}; choose one of {known}")


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


def launch(ranks: int, launcher: Launcher, trainer_args: Sequence[str], out_dir: Path, *,
           module: str = TRAINER_MODULE, env: Mapping[str, str] | None = None,
           slurm_job_name: str | None = None) -> int:
    """Run the trainer ranks, streaming their output; 0 when a verified checkpoint was written.

    Inside a SLURM job the job is named ``slurm_job_name`` first and its record is written
    beside the checkpoint at the end (:mod:`xffl.training.slurm_job`).
    """
    job = slurm_job.start(slurm_job_name, env)
    rc = _run_ranks(ranks, launcher, trainer_args, out_dir, module=module, env=env)
    slurm_job.finish(job, out_dir, rc)
    return rc


def _run_ranks(ranks: int, launcher: Launcher, trainer_args: Sequence[str], out_dir: Path, *,
               module: str, env: Mapping[str, str] | None) -> int:
    """Start the ranks and judge the outcome (see the module doc)."""
    command = build_command(ranks, launcher, trainer_args, module=module)
    child_env = dict(os.environ if env is None else env)
    if ranks > 1:
        child_env.setdefault("OMP_NUM_THREADS", "1")
    before = _manifest_fingerprint(out_dir)
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
    print(f"xffl.training.launch: training failed ({_describe(rc)}); no new valid checkpoint "
          f"in {out_dir}.", file=sys.stderr, flush=True)
    return _exit_code(rc) or 1


def _out_from_args(trainer_args: Sequence[str]) -> Path | None:
    """The value of ``--out`` among the trainer's arguments, if present."""
    for i, arg in enumerate(trainer_args):
        if arg == "--out" and i + 1 < len(trainer_args):
            return Path(trainer_args[i + 1])
        if arg.startswith("--out="):
            return Path(arg.split("=", 1)[1])
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: options before ``--`` are the launcher's, after it the trainer's."""
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
    parser.add_argument("--slurm-job-name", default=None,
                        help="inside a SLURM job: the name the job should carry (renamed with "
                        "scontrol if it differs); its record goes to OUT/slurm_job.json")
    args = parser.parse_args(own)
    out_dir = args.out or _out_from_args(trainer_args)
    if out_dir is None:
        parser.error("the trainer arguments after -- need --out DIR (or pass --out here)")
    try:
        return launch(args.ranks, args.launcher, trainer_args, out_dir,
                      slurm_job_name=args.slurm_job_name)
    except ValueError as exc:
        parser.error(str(exc))
    return 2


if __name__ == "__main__":
    sys.exit(main())
