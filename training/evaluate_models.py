"""Per-rank cross-site evaluation: the loss of several models on this site's held-out data.

``python -m xffl.training.evaluate_models --job JOB.json --model global=DIR --model a=DIR ...
--out evaluation.json``, started by the launcher (``python -m xffl.training.launch --module
xffl.training.evaluate_models ...``) under torchrun, srun or as one process, with the site's
ranks. Every model is loaded into its slices over the job's (dp, tp) mesh (FSDP2, one
tensor at a time: no rank holds the whole model) and evaluated on the site's held-out
sequences (the job's ``data.validation`` and ``evaluation`` budget, as in every round);
rank 0 writes only the numbers::

    {"format": 1, "site": SITE, "samples": N, "tokens": T, "losses": {NAME: LOSS, ...}}

(``tokens``: the held-out targets in the loss, the site's weight in a federated mean.)

Nothing but that file leaves the site: the data and the held-out split stay where they are.
"""

from __future__ import annotations

from xffl.core.startup import collect_less

collect_less()  # before the imports below (torch, transformers): see xffl.core.startup

import argparse
import math
import sys
from pathlib import Path

import torch

from xffl.aggregator.exchange import verify_checkpoint
from xffl.core.errors import ExitCode, InvalidInput, RunFailed, XfflError
from xffl.core.failpoints import failpoint
from xffl.core.files import write_json
from xffl.training import distributed as xdist
from xffl.training.__main__ import load_job, prepare_data, run_rank
from xffl.training.checkpoint import load_model, read_config
from xffl.training.config import TrainJob
from xffl.training.data import site_splits
from xffl.training.distributed import DistEnv
from xffl.training.evaluate import eval_count, evaluate_net
from xffl.training.forked import option_value
from xffl.training.model import ModelConfig
from xffl.training.model import warm_imports as model_warm_imports
from xffl.training.parallelize import ParallelModel, check_tensor_parallel, parallelize
from xffl.training.sharded_load import load_parallel

RESULT_FORMAT = 1


def model_pairs(values: list[str]) -> dict[str, Path]:
    """``NAME=DIR`` options as NAME -> DIR (ValueError on a malformed or repeated name)."""
    models: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--model {value!r}: write NAME=DIR")
        if name in models:
            raise ValueError(f"--model {name} given twice")
        models[name] = Path(path)
    return models


def build_parser() -> argparse.ArgumentParser:
    """The command-line options of one evaluating rank."""
    parser = argparse.ArgumentParser(
        prog="python -m xffl.training.evaluate_models",
        description="Evaluate models on this site's held-out data (run once per rank).",
        epilog="example: python -m xffl.training.evaluate_models --job job.json "
        "--model global=rounds/3/global --model alpha=rounds/3/updates/alpha "
        "--out evaluation.json",
    )
    parser.add_argument("--job", required=True, type=Path, help="TrainJob JSON file")
    parser.add_argument("--model", action="append", default=[], metavar="NAME=DIR",
                        help="a checkpoint to evaluate, under a name (repeat)")
    parser.add_argument("--data", type=Path, default=None,
                        help="token-shard directory (default: the job's data.path)")
    parser.add_argument("--out", required=True, type=Path, help="the JSON file rank 0 writes")
    parser.add_argument("--timeout", type=float, default=None,
                        help="collective timeout in seconds (default $XFFL_DIST_TIMEOUT or 1800)")
    return parser


def _verify_on_main(model_dir: Path, is_main: bool) -> None:
    """Rank 0 checks the checkpoint's checksums (it crossed a network); every rank learns."""
    failure: XfflError | None = None
    if is_main:
        try:
            verify_checkpoint(model_dir)
        except XfflError as exc:
            failure = exc
    if not xdist.all_ok(failure is None):
        raise failure or RunFailed(f"{model_dir}: checkpoint verification failed on rank 0.")


def eval_model(job: TrainJob, model_dir: Path, config: ModelConfig,
               device: torch.device) -> ParallelModel:
    """A checkpoint on the job's (dp, tp) mesh, to evaluate.

    With several ranks a transformers model is loaded sharded (FSDP2 over dp, whatever the
    job's data_parallel: nothing is trained, so nothing is replicated for speed): built on
    the meta device, each rank reads only its slices (:mod:`sharded_load`), never the whole
    model. One rank, or a ``model.entry_point`` model, loads it whole.
    """
    spec = job.training
    if xdist.world_size() > 1 and job.model.entry_point is None:
        return load_parallel(model_dir, config, spec.tensor_parallel, device, "fsdp",
                             precision=spec.precision)
    return parallelize(load_model(model_dir, job.model.entry_point).to(device),
                       spec.tensor_parallel, device, spec.data_parallel,
                       precision=spec.precision, shard_group=spec.shard_group)


def evaluate_models(job: TrainJob, models: dict[str, Path], data_dir: Path,
                    is_main: bool) -> tuple[int, int, dict[str, float]]:
    """(held-out sequences, their targets in the loss, NAME -> mean token loss) of every
    model (collective)."""
    spec = job.training
    if job.data.validation is None:
        raise InvalidInput(f"site {job.site} has no held-out data; add data.validation "
                           "({fraction: 0.1} or {path: DIR}) to the site in the job spec.")
    _, held_out = site_splits(data_dir, job.data, spec.seq_len)
    assert held_out is not None
    count = eval_count(held_out, job.evaluation, spec)
    if count < 1:
        raise InvalidInput(f"site {job.site}: no held-out sequence of {spec.seq_len + 1} "
                           "tokens to evaluate on.")
    device = xdist.device_for(xdist.detect_env())
    batch_size = job.evaluation.batch(spec)
    losses: dict[str, float] = {}
    tokens = 0  # the same for every model: it depends on the data alone
    for name, model_dir in models.items():
        _verify_on_main(model_dir, is_main)
        config = read_config(model_dir)
        if spec.seq_len > config.max_position_embeddings or held_out.vocab_size > \
                config.vocab_size:
            raise InvalidInput(f"model {name}: its config does not fit this site's held-out "
                               f"sequences (seq_len {spec.seq_len}, vocabulary "
                               f"{held_out.vocab_size}).")
        check_tensor_parallel(config, spec.tensor_parallel, xdist.world_size())
        pm = eval_model(job, model_dir, config, device)
        result = evaluate_net(pm.net, held_out, count, batch_size, device, spec.precision,
                              pm.dp_rank, pm.dp_size, spec.loss_chunk)
        losses[name], tokens = result.loss, result.tokens
        del pm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return count, tokens, losses


def run(args: argparse.Namespace) -> int:
    """Set up the process group, evaluate, write the result on rank 0; the exit code."""
    return run_rank("xffl.training.evaluate_models", args.timeout,
                    lambda env: evaluate(args, env))


def evaluate(args: argparse.Namespace, env: DistEnv) -> int:
    """Evaluate every model on this rank (under a process group); rank 0 writes the file."""
    job = load_job(args.job)
    failpoint(f"evaluate-models-{job.site}")  # a test's site whose evaluation dies here
    try:
        models = model_pairs(args.model)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc
    if not models:
        raise InvalidInput("give at least one --model NAME=DIR.")
    data_dir = args.data if args.data is not None else Path(job.data.path)
    prepare_data(job, data_dir, env.local_rank)
    samples, tokens, losses = evaluate_models(job, models, data_dir, env.is_main)
    if env.is_main:
        bad = sorted(n for n, v in losses.items() if not math.isfinite(v))
        if bad:
            raise RunFailed(f"site {job.site}: the loss of {', '.join(bad)} is not finite.")
        write_json(args.out, {"format": RESULT_FORMAT, "site": job.site,
                              "samples": samples, "tokens": tokens, "losses": losses})
        print(f"xffl.training.evaluate_models: site {job.site}: {len(losses)} model(s) on "
              f"{samples} held-out sequences", flush=True)
    return ExitCode.OK


def warm_imports(argv: list[str]) -> None:
    """Import what the evaluating ranks will run (the forked launcher, before forking)."""
    named = option_value(argv, "--model")
    if named is not None and "=" in named:
        model_warm_imports(Path(named.split("=", 1)[1]))


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and evaluate."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
