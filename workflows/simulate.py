"""``xffl simulate``: N virtual sites on this machine, trained K at a time, folded as they finish.

Every round the global model is written, the virtual sites (:mod:`xffl.workflows.
simulate_sites`) are trained in a pool of K worker processes (started once for the whole
simulation, each with ``cores // K`` torch threads) by the trainer real sites run, and the
parent verifies each finished update (:func:`xffl.aggregator.verify.check_update`), folds it
into a :class:`xffl.aggregator.running.RunningAggregate` and deletes it at once. At most
2K updates exist at a time, so neither the parent's memory nor the disk grows with N
(FedML Parrot's approach). The next global is then written in the exchange format
(manifest + checksums) at ``DIR/rounds/<r>/global``; ``DIR/simulate.json`` holds the
numbers of every round. fedavg is computed by the running aggregate itself; the server
optimizers (fedavgm, fedadam, fedyogi, fedadagrad, diloco) take one step from the running FedAvg;
fedmedian and fedtrimmedavg need every update at once and are refused.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from xffl.aggregator import metrics as metric
from xffl.aggregator import registry
from xffl.aggregator.decode import Decoding, encoded_index
from xffl.aggregator.exchange import Manifest, verify_checkpoint
from xffl.aggregator.inputs import own_config, update_weight
from xffl.aggregator.running import RunningAggregate
from xffl.aggregator.engine import run_strategy
from xffl.aggregator.verify import check_update
from xffl.core.errors import InvalidInput, RunFailed, TimedOut, XfflError
from xffl.core.paths import xffl_home
from xffl.core.resources import peak_rss_bytes, usable_cpus
from xffl.core.sizes import parse_size
from xffl.jobs.spec.load import LoadedJob
from xffl.workflows.simulate_sites import (
    Outcome,
    VirtualSite,
    check_templates,
    init_worker,
    make_initial,
    run_site,
    virtual_site,
)

RESULT_FILE = "simulate.json"
DEFAULT_TIMEOUT = 3600.0
SITE_RULE = ("virtual site i uses spec site i % len(sites) as template, is named "
             "<template>-<i>, trains as one process on DIR/data/site-<i>: a dialect <L>-<i> "
             "of a synthetic template's language L, else part i // len(sites) of the "
             "template's dataset")

#: progress(round, sites done, sites in the round); round 0 is the initial model.
Progress = Callable[[int, int, int], None]
T = TypeVar("T")


@dataclass(frozen=True)
class SimulateOptions:
    """What ``xffl simulate`` was asked for."""

    sites: int
    parallel: int | None = None  # default: one worker per core, at most one per site
    out: Path | None = None  # default: $XFFL_HOME/simulations/<job name>-<timestamp>
    rounds: int | None = None  # default: the job's rounds
    timeout: float | None = None  # seconds per round; default failure.round_timeout or 1 h
    keep_updates: bool = False  # keep DIR/rounds/<r>/updates/<site> instead of deleting


def default_dir(name: str) -> Path:
    """``$XFFL_HOME/simulations/<name>-<timestamp>`` (a suffix when that already exists)."""
    base = xffl_home() / "simulations" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def check_request(loaded: LoadedJob, opts: SimulateOptions) -> None:
    """InvalidInput, before anything is written, for a request simulate cannot honour."""
    spec = loaded.spec
    where = f"{loaded.path}: job spec field"
    if opts.sites < 1:
        raise InvalidInput(f"--sites must be at least 1, got {opts.sites}.")
    if opts.parallel is not None and opts.parallel < 1:
        raise InvalidInput(f"--parallel must be at least 1, got {opts.parallel}.")
    if opts.rounds is not None and opts.rounds < 1:
        raise InvalidInput(f"--rounds must be at least 1, got {opts.rounds}.")
    if opts.timeout is not None and not (opts.timeout > 0 and math.isfinite(opts.timeout)):
        raise InvalidInput(f"--timeout must be a positive number of seconds, got {opts.timeout}.")
    if registry.get(spec.aggregation.strategy).robust:
        averaging = [n for n in registry.names() if not registry.get(n).robust]
        raise InvalidInput(
            f"{where} aggregation.strategy: {spec.aggregation.strategy} needs every update at "
            "once, but xffl simulate folds each update into a running aggregate; use one of "
            f"{', '.join(averaging)}.")
    if spec.training.tensor_parallel > 1:
        raise InvalidInput(f"{where} training.tensor_parallel: xffl simulate trains each "
                           "virtual site in one process; set it to 1 to simulate this job.")
    if spec.training.lora is not None:
        raise InvalidInput(f"{where} training.lora: xffl simulate trains whole models; "
                           "submit a LoRA job (xffl submit), or remove training.lora to "
                           "simulate the job.")
    if opts.out is not None and opts.out.exists() and (
            not opts.out.is_dir() or any(opts.out.iterdir())):
        raise InvalidInput(f"{opts.out} already exists and is not an empty folder; give -o a "
                           "new or empty folder.")
    check_templates(loaded, opts.sites)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


# what every worker needs, imported once by the fork server the workers are forked from (about
# 2.5 CPU-s: each of K spawned workers used to pay it), after xffl.core.startup_preload
PRELOAD = ["xffl.core.startup_preload", "torch", "torch._dynamo", "xffl.workflows.simulate_sites",
           "xffl.training.trainer", "xffl.training.streamed"]


class _Pool:
    """K worker processes whose every wait is bounded; killed on any failure.

    They are forked from a fork server (``forkserver``), not from this process: a fork copies
    torch's thread pools in an unusable state once the parent has used them, and ``spawn``
    imports torch and the trainer again in every worker.
    """

    def __init__(self, workers: int, threads: int) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        self.executor = ProcessPoolExecutor(
            max_workers=workers, mp_context=context, initializer=init_worker,
            initargs=(threads,))

    def result(self, fut: Future[T], what: str) -> T:
        """The task's result; RunFailed when its worker process died."""
        try:
            return fut.result(timeout=0)
        except BrokenProcessPool as exc:
            raise RunFailed(f"a simulation worker process died while {what} (out of memory?); "
                            "try a smaller --parallel.") from exc

    def close(self, kill: bool) -> None:
        """Shut the pool down; ``kill`` terminates workers still busy instead of waiting."""
        processes = dict(getattr(self.executor, "_processes", None) or {})
        if kill:
            for proc in processes.values():
                proc.terminate()
        self.executor.shutdown(wait=not kill, cancel_futures=True)
        for proc in processes.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)


def _raise_outcome(outcome: Outcome, what: str) -> None:
    if outcome.ok:
        return
    message = f"{what}: {outcome.error}"
    if outcome.code == int(InvalidInput.exit_code):
        raise InvalidInput(message)
    raise RunFailed(message)


class Simulation:
    """One simulation: its folder, options, worker pool, and the numbers of every round."""

    def __init__(self, loaded: LoadedJob, opts: SimulateOptions,
                 progress: Progress | None = None) -> None:
        """Check the request (InvalidInput) and fix the folder, rounds, workers and threads."""
        check_request(loaded, opts)
        spec = loaded.spec
        self.loaded, self.opts = loaded, opts
        self.progress = progress or (lambda r, d, n: None)
        self.root = Path(opts.out).resolve() if opts.out is not None else default_dir(spec.name)
        self.run_id = self.root.name
        self.rounds = opts.rounds or spec.rounds
        self.workers = min(opts.parallel or usable_cpus(), opts.sites)
        self.threads = max(1, usable_cpus() // self.workers)
        self.timeout = opts.timeout or spec.failure.round_timeout or DEFAULT_TIMEOUT
        self.max_shard = parse_size(spec.aggregation.max_shard_size)
        self.summary: dict[str, Any] = {
            "job": str(loaded.path), "name": spec.name, "run_id": self.run_id,
            "run_dir": str(self.root), "state": "running", "num_sites": opts.sites,
            "parallel": self.workers, "threads_per_worker": self.threads,
            "rounds_planned": self.rounds, "strategy": spec.aggregation.strategy,
            "weighting": spec.aggregation.weighting, "site_rule": SITE_RULE,
            "init_s": None, "wall_s": None, "peak_rss_bytes": None,
            "final_global": None, "rounds": [],
        }

    def site(self, index: int) -> VirtualSite:
        """Virtual site ``index`` of this simulation."""
        return virtual_site(self.loaded, index, self.opts.sites, self.root, self.run_id,
                            self.rounds)

    def _save(self) -> None:
        self.summary["peak_rss_bytes"] = peak_rss_bytes()
        _write_json(self.root / RESULT_FILE, self.summary)

    def run(self) -> dict[str, Any]:
        """Run every round; return (and leave in DIR/simulate.json) the summary."""
        t0 = time.perf_counter()
        self.root.mkdir(parents=True, exist_ok=True)
        self._save()
        pool = _Pool(self.workers, self.threads)
        ok = False
        try:
            previous = self._initial(pool)
            self.summary["init_s"] = round(time.perf_counter() - t0, 4)
            for rnd in range(1, self.rounds + 1):
                previous = self._round(pool, rnd, previous)
                self.summary["final_global"] = str(previous)
                self._save()
            ok = True
        except BaseException as exc:
            self.summary["error"] = exc.message if isinstance(exc, XfflError) else repr(exc)
            raise
        finally:
            pool.close(kill=not ok)
            self.summary["wall_s"] = round(time.perf_counter() - t0, 4)
            self.summary["state"] = "completed" if ok else "failed"
            self._save()
        return self.summary

    def _wait(self, pending: set[Future[Outcome]], deadline: float,
              what: str) -> set[Future[Outcome]]:
        remaining = deadline - time.monotonic()
        done, _ = wait(pending, timeout=max(0.0, remaining), return_when=FIRST_COMPLETED)
        if not done:
            raise TimedOut(f"{what} did not finish within {self.timeout:g} s; raise --timeout "
                           "(or failure.round_timeout), or lower the training budget.")
        return done

    def _initial(self, pool: _Pool) -> Path:
        """Round 0: the seeded initial model, written by a worker (torch stays out of here)."""
        target = self.root / "rounds" / "0" / "global"
        spec = self.loaded.spec
        self.progress(0, 0, 1)
        fut = pool.executor.submit(make_initial, self.run_id, spec.model, spec.training.seed,
                                   str(target), self.max_shard)
        (done,) = self._wait({fut}, time.monotonic() + self.timeout, "the initial model")
        _raise_outcome(pool.result(done, "writing the initial model"), "the initial model")
        self.progress(0, 1, 1)
        return target

    def _round(self, pool: _Pool, rnd: int, previous: Path) -> Path:
        """Train every virtual site from ``previous``, fold the updates, write the next global."""
        t0 = time.perf_counter()
        n, spec = self.opts.sites, self.loaded.spec
        prev = verify_checkpoint(previous)
        agg = RunningAggregate(prev.tensors, own_config(previous))
        exchange = spec.exchange  # each update is sent back as the job's exchange says
        reference = prev.tensors if exchange.plain else encoded_index(
            prev.tensors, exchange.safetensors_dtype, exchange.codec)
        decoding = None if exchange.plain else Decoding(
            previous, delta=exchange.update == "delta", codec=exchange.codec)
        updates = self.root / "rounds" / str(rnd) / "updates"
        deadline = time.monotonic() + self.timeout
        pending: dict[Future[Outcome], tuple[VirtualSite, Path]] = {}
        next_index, loss_sum, loss_count, train_sum = 0, 0.0, 0, 0.0
        self.progress(rnd, 0, n)
        while next_index < n or pending:
            while next_index < n and len(pending) < 2 * self.workers:
                site = self.site(next_index)
                out = updates / site.name
                fut = pool.executor.submit(run_site, site, rnd, str(previous), str(out))
                pending[fut] = (site, out)
                next_index += 1
            for fut in self._wait(set(pending), deadline,
                                  f"round {rnd}: {n - agg.count} of {n} virtual sites"):
                site, out = pending.pop(fut)
                what = f"round {rnd}, site {site.name}"
                _raise_outcome(pool.result(fut, f"training {what}"), what)
                manifest = check_update(out, expected_round=rnd, expected_parent=prev.digest(),
                                        reference_index=reference,
                                        expected_run_id=self.run_id)
                agg.add(out, update_weight(manifest, spec.aggregation.weighting), manifest,
                        decoding)
                if not self.opts.keep_updates:
                    shutil.rmtree(out)
                if metric.LOSS in manifest.metrics:
                    loss_sum += manifest.metrics[metric.LOSS]
                    loss_count += 1
                train_sum += manifest.metrics.get(metric.TRAIN_SECONDS, 0.0)
                self.progress(rnd, agg.count, n)
        if not self.opts.keep_updates:
            shutil.rmtree(updates, ignore_errors=True)
        target = self.root / "rounds" / str(rnd) / "global"
        result = self._write_global(agg, rnd, previous, prev, target)
        self.summary["rounds"].append({
            "round": rnd, "num_sites": agg.count, "wall_s": round(time.perf_counter() - t0, 4),
            "mean_loss": loss_sum / loss_count if loss_count else None,
            "global_loss": result.metrics.get(metric.LOSS), "num_samples": result.num_samples,
            "train_s_mean": train_sum / agg.count, "peak_rss_bytes": peak_rss_bytes(),
            "global": str(target), "digest": result.digest(),
        })
        return target

    def _write_global(self, agg: RunningAggregate, rnd: int, previous: Path, prev: Manifest,
                      target: Path) -> Manifest:
        """fedavg straight from the running sums; a server optimizer steps from their mean."""
        aggregation = self.loaded.spec.aggregation
        extra = {"simulated": True, "virtual_sites": agg.count,
                 "weighting": aggregation.weighting}
        if aggregation.strategy == "fedavg":
            return agg.write(target, run_id=self.run_id, round=rnd, parent=prev.digest(),
                             extra=extra, max_shard_size=self.max_shard)
        mean = target.parent / ".mean"
        agg.write(mean, kind="update", site=f"mean-of-{agg.count}", run_id=self.run_id,
                  round=rnd, parent=prev.digest(), extra=extra)
        try:
            return run_strategy(
                aggregation.strategy, [mean], previous, target, weighting="uniform",
                params=aggregation.params, run_id=self.run_id, round=rnd,
                parent_digest=prev.digest(), max_shard_size=self.max_shard)
        finally:
            shutil.rmtree(mean, ignore_errors=True)


def simulate(loaded: LoadedJob, opts: SimulateOptions,
             progress: Progress | None = None) -> dict[str, Any]:
    """Run a simulation of ``loaded`` as ``opts`` asks; return its summary (simulate.json)."""
    return Simulation(loaded, opts, progress).run()
