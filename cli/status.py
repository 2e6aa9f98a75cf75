"""`xffl status`: where a run stands, round by round and site by site."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from xffl.cli.common import handle_errors, markup_safe, print_json, resolve_run
from xffl.cli.options import JsonOpt, RunArg
from xffl.cli.tables import Markup, Rows, say
from xffl.jobs.registry.store import Registry

if TYPE_CHECKING:
    from xffl.jobs.registry.records import FinalLoss, RunRecord
    from xffl.jobs.status import RunStatus, SiteStatus


# what an 80-column terminal shows of the rounds x sites table (`--json`, `--tsv` or a wider
# terminal show every column)
COMPACT = ("round", "site", "state", "sequences", "loss", "val loss", "train s")
# training.local_groups: shown when a site of the run reports them
GROUP_COLUMNS = ("groups MB/step", "groups MB/round")


def _num(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _hardware(site: SiteStatus) -> list[str]:
    """The hardware cells of a site's round: device, GPUs, tokens/s per GPU, TFLOP/s, MFU,
    peak memory, save seconds."""
    from xffl.jobs.report.numbers import fmt

    return [site.device or "-", fmt("gpus", site.gpus),
            fmt("tokens_per_s_per_gpu", site.tokens_per_s_per_gpu), fmt("tflops", site.tflops),
            fmt("mfu", site.mfu), fmt("peak_memory_gib", site.peak_memory_gib),
            fmt("save_s", site.save_seconds)]


def _groups(site: SiteStatus) -> list[str]:
    """training.local_groups: the MB a rank all-reduced for the groups' syncs, per optimizer
    step (a sync's / every) and in the round (``-`` without groups)."""
    return [_num(None if v is None else v / 1e6, "{:.3g}")
            for v in (site.group_bytes_per_step, site.group_bytes_round)]


def title(run: RunRecord) -> str:
    """The state, the rounds done and the message of a run, the count said once: a message
    that already counts the rounds ("3 rounds completed", "2 of 4 rounds completed; ...")
    stands for it."""
    said = (f"{run.rounds_done} rounds", f"{run.rounds_done} of {run.rounds_total} rounds")
    if run.message and any(s in run.message for s in said):
        return f"{run.state} — {run.message}"
    return f"{run.state} — {run.rounds_done}/{run.rounds_total} rounds" + (
        f" — {run.message}" if run.message else "")


def final_line(final: FinalLoss) -> str:
    """The status line of the final model's held-out loss."""
    sites = ", ".join(f"{markup_safe(s)} {v:.4f}" for s, v in final.sites.items())
    return (f"final model (the global after round {final.round}): held-out loss "
            f"[bold]{final.val_loss:.4f}[/bold], the mean over the sites' held-out targets "
            f"(median across sites {final.val_loss_median:.4f}; {sites})")


def render_status(data: RunStatus, tsv: bool = False) -> None:
    """Print a run's status as a header and a rounds x sites table; ``tsv``: the table's
    rows alone (no header, title or footer lines)."""
    from xffl.jobs.report.numbers import fmt, megabytes

    run = data.run
    # training.local_groups' columns, in a run whose sites report them
    grouped = any(s.group_bytes_round is not None for r in data.rounds for s in r.sites)
    if not tsv:
        say(f"run [bold]{markup_safe(run.id)}[/bold]: {markup_safe(title(run))}")
    table = Rows(("round", "site", "state", "sequences", "tokens", "loss", "val loss", "queue s",
                  "start s", "train s", "xfer s", "other s", "agg s", "MB in/out", "device",
                  "GPUs", "tok/s per GPU", "TFLOP/s", "MFU", "peak GiB", "save s",
                  *GROUP_COLUMNS[:len(GROUP_COLUMNS) if grouped else 0]),
                 text=("state", "device"), compact=COMPACT)
    for rnd in data.rounds:
        number = str(rnd.record.round)
        for site in rnd.sites:
            table.add(number, site.site, site.state + (
                f" after {site.attempts} attempts" if site.attempts > 1 else "") + (
                f" ({site.reason})" if site.reason else ""),
                _num(site.num_samples), _num(site.num_tokens),
                _num(site.loss, "{:.4f}"), _num(site.val_loss, "{:.4f}"),
                fmt("queue_wait_s", site.queue_wait_s),
                fmt("startup_s", site.startup_seconds), _num(site.train_seconds, "{:.1f}"),
                fmt("transfer_s", site.transfer_s), fmt("other_s", site.other_s), "",
                f"{megabytes(site.received_bytes)}/{megabytes(site.sent_bytes)}"
                if site.received_bytes is not None else "-", *_hardware(site),
                *(_groups(site) if grouped else []))
        table.add(number, Markup("[bold]global[/bold]"), rnd.record.state,
                  _num(rnd.record.num_samples), "", _num(rnd.record.loss, "{:.4f}"),
                  _num(rnd.record.val_loss, "{:.4f}"), "", "", "", "", "",
                  _num(rnd.record.aggregate_seconds, "{:.2f}"), "",
                  *[""] * (7 + (len(GROUP_COLUMNS) if grouped else 0)),
                  end_section=True)
    table.print(tsv)
    if tsv:
        return
    robust = [r for r in data.rounds if r.val_loss_median is not None]
    if robust:
        from xffl.aggregator.metrics import VAL_LOSS_ROBUST
        from xffl.aggregator.reported import VAL_LOSS_FACTOR

        last = robust[-1]
        say(f"global val loss: the mean over the sites' held-out targets, each site's loss at "
            f"most {VAL_LOSS_FACTOR:g} x ln(vocabulary); training.stop_when reads "
            f"{VAL_LOSS_ROBUST}: {last.val_loss_median:.4f} in round {last.record.round}")
    if data.final_loss is not None:
        say(final_line(data.final_loss))
    if data.copies:
        moving = Rows(("site", "copy", "MB so far", "of MB", "MB/s", "ETA s"),
                      title="copies in flight")
        for c in data.copies:
            moving.add(c.site, "update back" if c.direction == "out" else "global out",
                       f"{c.bytes / 1e6:.1f}", f"{c.total / 1e6:.1f}", f"{c.mb_s:.1f}",
                       _num(c.eta_s, "{:.0f}"))
        moving.print()
    if data.slurm:
        jobs = Rows(("round", "site", "SLURM job", "SLURM state", "queue wait s", "run s",
                     "steps"), title="SLURM jobs", text=("SLURM state", "steps"))
        for job in data.slurm:
            state = job.state or ("unreachable" if not job.reachable else "-")
            if job.error:
                state += f" ({job.error})"
            elif not job.live and job.state in {"PENDING", "RUNNING", "COMPLETING"}:
                state += " (last seen)"
            jobs.add(_num(job.round), job.site, job.job_id or "-", state,
                     _num(job.queue_wait_s, "{:.0f}"), _num(job.run_s, "{:.0f}"),
                     "-" if job.step_to is None else f"{job.step_from}-{job.step_to}")
        jobs.print()
    if data.chains:
        chained = Rows(("round", "site", "jobs", "steps done", "of", "ETA s"),
                       title="rounds of several jobs (training.checkpoint.chain)")
        for chain in data.chains:
            chained.add(str(chain.round), chain.site, str(chain.jobs), str(chain.steps_done),
                        _num(chain.steps), "done" if chain.done else _num(chain.eta_s, "{:.0f}"))
        chained.print()
    if any(e.rounds_seen or e.slurm_estimate_s is not None for e in data.estimates):
        est = Rows(("site", "queue wait s", "start-up s", "s/step", "rounds", "SLURM seed s"),
                   title="estimates for the next round (exponentially weighted)")
        for e in data.estimates:
            est.add(e.site, _num(e.queue_wait_s, "{:.0f}"), _num(e.startup_s, "{:.1f}"),
                    _num(e.seconds_per_step, "{:.3f}"), str(e.rounds_seen),
                    _num(e.slurm_estimate_s, "{:.0f}"))
        est.print()
    if data.credentials:
        creds = Rows(("site", "login", "next round"), title="SSH credentials",
                     text=("login", "next round"))
        for row in data.credentials:
            creds.add(row.site, row.login,
                      Markup(f"[yellow]waiting: {markup_safe(row.waiting)}[/yellow]")
                      if row.waiting else "ready")
        creds.print()
    if data.latest_global:
        say(f"latest global model: {markup_safe(data.latest_global)}")
    if data.schedule:
        say(f"schedule: `xffl round` at '{data.schedule.cron}', next tick "
            f"{data.schedule.next_tick.replace('T', ' ')[:16]}")
    say(f"run directory: {markup_safe(run.run_dir)}")


@handle_errors
def status(
    run: RunArg = "last",
    as_json: JsonOpt = False,
    live: Annotated[bool, typer.Option("--live/--no-live", help="Ask SLURM over SSH about a "
                                       "running run's jobs.")] = True,
    tsv: Annotated[bool, typer.Option("--tsv", help="Print the rounds x sites rows alone, "
                                      "tab-separated: no header, title or footer lines "
                                      "(`xffl status --tsv | cut -f2,6`).")] = False,
) -> None:
    """Show a run's state and a rounds x sites table (state, sequences, loss, durations).

    sequences: a site's training data in windows of training.seq_len + 1 tokens (those its
    round read, unless the job declares the data's size), the weight of `weighting: samples`;
    not the examples `xffl data prepare` counted: packed examples fill windows end to end, a
    padded example is one window.

    After the last round every site evaluates the final global model on its held-out data;
    the line `final model (the global after round R): held-out loss L` (--json:
    ``final_loss``) gives their mean over all the held-out targets and the median across
    sites.

    Each site's round is broken down into SLURM queue wait, training and transfer +
    orchestration (until its update was in place); `xffl report` draws the same numbers.

    For SLURM sites it also shows each round's job id, SLURM state, queue wait and run time,
    read live over SSH while the run is running (a site that cannot be reached says so). A
    round of several jobs (training.checkpoint.chain) shows each job's steps (from-to) and a
    line per site: jobs so far, steps done and, in flight, an ETA in seconds of training
    (--json: ``slurm[].step_from``/``step_to`` and ``chains``).

    While a round's global goes out to a site or its update comes back, a table of the copies
    in flight shows each one's bytes so far, MB/s and ETA (--json: ``copies``; every finished
    copy with its bytes, seconds and MB/s: ``transfers``).

    An 80-column terminal shows the table's main columns (round, site, state, sequences, loss,
    val loss, train s); a wider one, a pipe, --tsv and --json every column.

    Example: xffl status quickstart-20261122-051000-a3f9
    """
    from xffl.jobs.status import run_status

    registry = Registry()
    record = resolve_run(registry, run)
    data = run_status(registry, record, slurm=not tsv, live=live and not tsv)
    if as_json:
        print_json(data.as_json())
    else:
        render_status(data, tsv)
