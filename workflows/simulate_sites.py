"""The virtual sites of ``xffl simulate``: derived from the job spec; their data; the worker.

Virtual site ``i`` (0-based) of N takes the spec's site ``i % len(sites)`` as its template.
It is named ``<template>-<i>``, trains with the job's training settings (the template's
``budget`` applied) as a single process (the template's ``ranks`` are not used), and reads
its own data in ``DIR/data/site-<i>``:

* a template with ``data.synthetic: L`` gives a *dialect* of language L named ``L-<i>``: the
  same language parameters (alphabet, syllables, lexicon size, Zipf exponent, sentence
  lengths), but its own lexicon and word chain, seeded from the dialect's name, and the
  template's ``synthetic_sequences`` sequences, so no two virtual sites hold the same text;
* any other template's dataset (``data.path``, resolved on this machine as the real site
  resolves it) is split into as many contiguous parts as there are virtual sites with that
  template, and the site gets part ``i // len(sites)``.

Data is written once, on first use, by the worker that trains the site. The worker entry
points (:func:`init_worker`, :func:`run_site`, :func:`make_initial`) run in the pool's
processes and exchange only small dataclasses with the parent, never tensors.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from xffl.aggregator.metrics import LOSS
from xffl.aggregator.reported import MAX_COUNT
from xffl.core.errors import ExitCode, InvalidInput, XfflError
from xffl.core.files import atomic_write
from xffl.jobs.spec.load import LoadedJob
from xffl.jobs.spec.schema import SiteSpec
from xffl.training.config import DataSpec, ModelSpec, TrainJob
from xffl.training.data import (
    FLAGS_FILE,
    META_FILE,
    TOKENS_FILE,
    load_flags,
    load_tokens,
    read_meta,
)


@dataclass(frozen=True)
class VirtualSite:
    """One virtual site: its TrainJob and where and how its data is made."""

    index: int
    name: str
    template: str
    job: TrainJob
    data_dir: Path
    language: str | None = None  # the dialect's name (synthetic templates)
    base_language: str | None = None  # the template's language
    sequences: int = 0
    source: Path | None = None  # the template's dataset (other templates)
    part: int = 0
    parts: int = 1


@dataclass(frozen=True)
class Outcome:
    """What a worker reports back: success, or the error's sentence and exit code."""

    ok: bool
    seconds: float
    digest: str | None = None
    loss: float | None = None
    error: str | None = None
    code: int = 0


def template_source(loaded: LoadedJob, site: SiteSpec) -> Path:
    """Where a template site's own dataset lies on this machine (relative paths: its workdir)."""
    from xffl.workflows.plan.deployments import site_data_path

    return Path(site_data_path(loaded.site_profile(site.name), site.name,
                               site.data.path)).expanduser()


def check_templates(loaded: LoadedJob, count: int) -> None:
    """InvalidInput unless every non-synthetic template's dataset is here and splits ``count``."""
    sites = loaded.spec.sites
    seq_len = loaded.spec.training.seq_len
    for t, site in enumerate(sites):
        if site.data.synthetic is not None or t >= count:
            continue
        source = template_source(loaded, site)
        try:
            n = read_meta(source)["num_tokens"] // (seq_len + 1)
        except InvalidInput as exc:
            raise InvalidInput(
                f"site {site.name}: its data {source} is not readable on this machine "
                f"({exc.message.rstrip('.')}); xffl simulate needs the template sites' data "
                "here, or data.synthetic.") from exc
        parts = len(range(t, count, len(sites)))
        if n < parts:
            raise InvalidInput(
                f"site {site.name}: {source} holds {n} sequences of {seq_len + 1} tokens, "
                f"fewer than the {parts} virtual sites that split it; use fewer --sites.")


def virtual_site(loaded: LoadedJob, index: int, count: int, root: Path, run_id: str,
                 rounds: int) -> VirtualSite:
    """Virtual site ``index`` of ``count`` (the module's rule), its data under ``root/data``."""
    spec = loaded.spec
    template = spec.sites[index % len(spec.sites)]
    name = f"{template.name}-{index}"
    data_dir = Path(root) / "data" / f"site-{index}"
    training = template.budget.apply(spec.training) if template.budget else spec.training
    # the data is the coordinator's own (generated or split here): each virtual site is
    # weighed by its part's size, declared so its trainer reports it (not the samples read)
    declared = template.data.synthetic_sequences if template.data.synthetic is not None else \
        template.data.max_samples or MAX_COUNT
    job = TrainJob(run_id=run_id, site=name, rounds=rounds, model=spec.model, training=training,
                   data=DataSpec(path=str(data_dir), max_samples=declared),
                   exchange=spec.exchange)
    if template.data.synthetic is not None:
        return VirtualSite(index, name, template.name, job, data_dir,
                           language=f"{template.data.synthetic}-{index}",
                           base_language=template.data.synthetic,
                           sequences=template.data.synthetic_sequences)
    parts = len(range(index % len(spec.sites), count, len(spec.sites)))
    return VirtualSite(index, name, template.name, job, data_dir,
                       source=template_source(loaded, template),
                       part=index // len(spec.sites), parts=parts)


def ensure_dialect(dest: Path, base: str, dialect: str, sequences: int, seq_len: int) -> None:
    """Generate dialect ``dialect`` of synthetic language ``base`` at ``dest`` unless there."""
    from xffl.training.data import LANGUAGES, ensure_synthetic

    if base not in LANGUAGES:
        raise InvalidInput(f"unknown synthetic language {base!r}.")
    LANGUAGES.setdefault(dialect, LANGUAGES[base])  # same parameters, seeded by its own name
    ensure_synthetic(dest, dialect, sequences, seq_len)


def ensure_partition(source: Path, dest: Path, part: int, parts: int, seq_len: int) -> None:
    """Write part ``part`` of ``parts`` contiguous parts of ``source``'s sequences to ``dest``."""
    meta = read_meta(source)
    width = seq_len + 1
    n = meta["num_tokens"] // width
    lo, hi = n * part // parts, n * (part + 1) // parts
    if hi <= lo:
        raise InvalidInput(f"{source}: {n} sequences cannot be split into {parts} parts.")
    wanted = {"source": str(source), "part": part, "parts": parts, "seq_len": seq_len,
              "source_tokens": meta["num_tokens"]}
    if (dest / META_FILE).is_file():
        have = read_meta(dest)
        if have.get("partition") == wanted and (dest / TOKENS_FILE).is_file():
            return
    tokens = load_tokens(source)[lo * width:hi * width]
    dest.mkdir(parents=True, exist_ok=True)
    atomic_write(dest / TOKENS_FILE, tokens.tobytes())
    flags = load_flags(source, meta["num_tokens"])  # instruction and chat data: its loss mask
    if flags is not None:
        atomic_write(dest / FLAGS_FILE, bytes(flags[lo * width:hi * width]))
    out = {k: v for k, v in meta.items() if k != "synthetic"}
    out.update(num_tokens=(hi - lo) * width, partition=wanted)
    atomic_write(dest / META_FILE, (json.dumps(out, indent=2) + "\n").encode())


def prepare_site_data(site: VirtualSite) -> Path:
    """Make the site's dataset on first use (a dialect or a part of its template's data)."""
    seq_len = site.job.training.seq_len
    if site.language is not None and site.base_language is not None:
        ensure_dialect(site.data_dir, site.base_language, site.language, site.sequences, seq_len)
    elif site.source is not None:
        ensure_partition(site.source, site.data_dir, site.part, site.parts, seq_len)
    return site.data_dir


def _failure(exc: BaseException, t0: float) -> Outcome:
    if isinstance(exc, XfflError):
        return Outcome(False, time.perf_counter() - t0, error=exc.message,
                       code=int(exc.exit_code))
    return Outcome(False, time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}",
                   code=int(ExitCode.INTERNAL))


def init_worker(threads: int) -> None:
    """Pool initializer: ``threads`` torch threads per worker, so K workers share the cores.

    It also imports the trainer and torch._dynamo (which torch.optim imports when the first
    optimizer is built), which the fork server the workers come from has already imported
    (``simulate.PRELOAD``): where it could not, each worker pays the two seconds while the
    pool starts, not the first site it trains.
    """
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set: keep torch's choice
        torch.set_num_interop_threads(1)
    import torch._dynamo

    import xffl.training.streamed
    import xffl.training.trainer  # noqa: F401


def make_initial(run_id: str, model: ModelSpec, seed: int, out: str,
                 max_shard_bytes: int | None) -> Outcome:
    """Worker task: write the round-0 global (seeded init or model.init) at ``out``."""
    t0 = time.perf_counter()
    try:
        from xffl.training.checkpoint import init_global

        manifest = init_global(run_id, model, seed, Path(out), max_shard_bytes)
        return Outcome(True, time.perf_counter() - t0, digest=manifest.digest())
    except Exception as exc:
        return _failure(exc, t0)


def site_state(site: VirtualSite) -> Path:
    """The virtual site's own folder (error feedback): ``DIR/site-state/<name>``."""
    return site.data_dir.parent.parent / "site-state" / site.name


def run_site(site: VirtualSite, rnd: int, model: str, out: str) -> Outcome:
    """Worker task: train one virtual site for round ``rnd`` from ``model``; update at ``out``.

    The same trainer real sites run (:func:`xffl.training.trainer.train_round`, here in a
    single process), or ``training.update_fn`` when the job sets one.
    """
    t0 = time.perf_counter()
    try:
        if site.job.training.update_fn is not None:
            from xffl.training.streamed import tensor_update_round

            manifest = tensor_update_round(site.job, rnd, Path(model), Path(out))
        else:
            from xffl.training.trainer import train_round

            data = prepare_site_data(site)
            manifest = train_round(site.job, rnd, Path(model), data, Path(out),
                                   state_dir=site_state(site))
        return Outcome(True, time.perf_counter() - t0, digest=manifest.digest(),
                       loss=manifest.metrics.get(LOSS))
    except Exception as exc:
        return _failure(exc, t0)
