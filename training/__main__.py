"""Per-rank entry point: ``python -m xffl.training --job JOB.json --round R --model DIR --out DIR``.

Run it once per rank under torchrun or srun (or alone for a single process). It sets up the
process group from the launcher's variables, generates the synthetic dataset on first use
(local rank 0 writes, the others wait), trains one round and prints the update's summary as
one JSON line on rank 0. Exit codes follow the CLI contract (0 ok, 1 failed, 2 bad input).
"""

from __future__ import annotations

from xffl.core.startup import collect_less

collect_less()  # before the imports below (torch, transformers): see xffl.core.startup

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from xffl.aggregator.exchange import Manifest
from xffl.core.errors import ExitCode, InvalidInput, RunFailed, XfflError
from xffl.training import distributed as xdist
from xffl.training.config import TrainJob
from xffl.training.data import ensure_synthetic
from xffl.training.distributed import DistEnv
from xffl.training.feedback import state_dir_from_env
from xffl.training.forked import option_value
from xffl.training.model import warm_imports as model_warm_imports
from xffl.training.streamed import tensor_update_round
from xffl.training.trainer import train_round


def build_parser() -> argparse.ArgumentParser:
    """The command-line options of the per-rank trainer."""
    parser = argparse.ArgumentParser(
        prog="python -m xffl.training",
        description="Train one federated round at this site (run once per rank).",
        epilog="example: torchrun --standalone --nproc-per-node 2 -m xffl.training "
        "--job job.json --round 1 --model rounds/0/global --out rounds/1/site-a",
    )
    parser.add_argument("--job", required=True, type=Path, help="TrainJob JSON file")
    parser.add_argument("--round", required=True, type=int,
                        help="round number this update belongs to")
    parser.add_argument("--model", required=True, type=Path, help="global checkpoint directory")
    parser.add_argument("--data", type=Path, default=None,
                        help="token-shard directory (default: the job's data.path, relative "
                        "to the working directory)")
    parser.add_argument("--out", required=True, type=Path, help="update checkpoint directory")
    parser.add_argument("--base", type=Path, default=None,
                        help="a LoRA job's frozen base model (--model is then the adapter)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="collective timeout in seconds (default $XFFL_DIST_TIMEOUT or 1800)")
    return parser


def load_job(path: Path) -> TrainJob:
    """Parse a TrainJob JSON file; InvalidInput naming the file and field on error."""
    try:
        return TrainJob.model_validate_json(Path(path).read_bytes())
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot read the job file ({exc.strerror or exc}).") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise InvalidInput(f"{path}: {loc}: {first['msg']}.") from exc


def prepare_data(job: TrainJob, data_dir: Path, local_rank: int) -> None:
    """Generate the synthetic corpus once per node (local rank 0) while the other ranks wait."""
    failure: XfflError | None = None
    if job.data.synthetic is not None and local_rank == 0:
        try:
            ensure_synthetic(data_dir, job.data.synthetic, job.data.synthetic_sequences,
                             job.training.seq_len)
        except XfflError as exc:
            failure = exc
    if not xdist.all_ok(failure is None):
        raise failure or InvalidInput("preparing the dataset failed on another rank.")


def update_round(job: TrainJob, args: argparse.Namespace, is_main: bool) -> Manifest | None:
    """``training.update_fn``: rank 0 writes the update tensor by tensor, the others wait."""
    failure: XfflError | None = None
    manifest = None
    if is_main:
        try:
            manifest = tensor_update_round(job, args.round, args.model, args.out)
        except XfflError as exc:
            failure = exc
    if not xdist.all_ok(failure is None):
        raise failure or RunFailed("training.update_fn failed on rank 0.")
    return manifest


def run_rank(prog: str, timeout_s: float | None, body: Callable[[DistEnv], int]) -> int:
    """Set up the process group, run ``body`` on this rank, tear down; the exit code.

    An xffl error is one line on stderr naming the rank, with its exit code (CLI contract).
    """
    try:
        env = xdist.setup(timeout_s=timeout_s)
    except (RuntimeError, ValueError) as exc:
        print(f"{prog}: cannot set up the process group ({exc}); check MASTER_ADDR/"
              "MASTER_PORT and that every rank started.", file=sys.stderr, flush=True)
        return ExitCode.RUN_FAILED
    try:
        return body(env)
    except XfflError as exc:
        print(f"xffl.training (rank {env.rank}): {exc.message}", file=sys.stderr, flush=True)
        return exc.exit_code
    finally:
        xdist.teardown()


def run(args: argparse.Namespace) -> int:
    """Set up, train one round, tear down; return the exit code."""
    return run_rank("xffl.training", args.timeout, lambda env: train(args, env))


def train(args: argparse.Namespace, env: DistEnv) -> int:
    """Train one round on this rank (under a process group); rank 0 prints the summary."""
    job = load_job(args.job)
    if args.round < 0:
        raise InvalidInput(f"--round must not be negative, got {args.round}.")
    if job.training.update_fn is not None:
        manifest = update_round(job, args, env.is_main)
    else:
        data_dir = args.data if args.data is not None else Path(job.data.path)
        prepare_data(job, data_dir, env.local_rank)
        manifest = train_round(job, args.round, args.model, data_dir, args.out,
                               base_dir=args.base, state_dir=state_dir_from_env())
    if env.is_main and manifest is not None:
        summary = {"site": job.site, "round": args.round, "out": str(args.out),
                   "digest": manifest.digest(), "num_samples": manifest.num_samples,
                   "num_tokens": manifest.num_tokens, **manifest.metrics}
        print(json.dumps(summary), flush=True)
    return ExitCode.OK


def warm_imports(argv: list[str]) -> None:
    """Import what the ranks of this round will run (the forked launcher, before forking)."""
    base = option_value(argv, "--base")
    model = base or option_value(argv, "--model")
    if model is not None:
        model_warm_imports(Path(model))
    if base is not None:  # a LoRA round: every rank wraps the base with peft (0.4 CPU-s each)
        import peft  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and run one round."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
