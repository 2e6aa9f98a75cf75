"""`xffl logs`: the output of a run: its runner and workflow logs, or one site's training job."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Annotated, Any

import typer

from xffl.cli.common import (
    console,
    handle_errors,
    markup_safe,
    print_json,
    printable,
    resolve_run,
    state,
)
from xffl.cli.logs_view import causes, without_tracebacks
from xffl.cli.options import JsonOpt, RunArg
from xffl.cli.watch import TimeoutOpt
from xffl.core.errors import ConnectionFailed, ExitCode, InvalidInput
from xffl.core.layout import RunLayout
from xffl.jobs.registry.records import RunRecord
from xffl.jobs.registry.states import RunState
from xffl.jobs.registry.store import Registry

_EXEC = re.compile(r"EXECUTING step (?P<step>\S+) \(job (?P<job>\S+)\) .* into directory "
                   r"(?P<dir>\S+?):?$")
_STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def tail(path: Path, lines: int, everything: bool = True) -> list[str]:
    """The last ``lines`` lines of ``path`` (none if it does not exist); unless
    ``everything``, of its lines without tracebacks (:func:`without_tracebacks`)."""
    if not path.is_file():
        return []
    text = path.read_text(errors="replace").splitlines()
    return (text if everything else without_tracebacks(text))[-lines:]


def step_runs(log: Path, site: str) -> list[dict[str, str]]:
    """Every execution of ``site``'s train step in streamflow.log, in order.

    StreamFlow logs each execution as ``EXECUTING step /rounds/train_<site> (job J) ... into
    directory D:`` followed by the command, whose ``--round`` value is the round; an
    execution of a job name already seen is a retry (the next attempt).
    """
    runs: list[dict[str, str]] = []
    attempts: dict[str, int] = {}
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    for i, line in enumerate(lines):
        e = _EXEC.search(line)
        if not e or e["step"].rsplit("/", 1)[-1] != f"train_{site}":
            continue
        command = []
        for nxt in lines[i + 1:]:
            if _STAMP.match(nxt):
                break
            command.append(nxt.strip().rstrip("\\").strip())
        rnd = next((command[k + 1] for k, word in enumerate(command[:-1])
                    if word == "--round" and command[k + 1].isdigit()), None)
        if rnd is None:
            continue
        key = f"{e['job']}@{rnd}"
        attempts[key] = attempts.get(key, 0) + 1
        runs.append({"job": e["job"], "dir": e["dir"], "round": rnd,
                     "attempt": str(attempts[key])})
    return runs


def local_step_lines(log: Path, site: str, job: str, rnd: int, directory: str) -> list[str]:
    """The lines of streamflow.log about one execution of a site's train step.

    A job name is not unique in the log: ``xffl round`` (a cron tick) and ``xffl resume``
    append one workflow per invocation, each naming its first round's job ``.../0.0``. An
    execution is its ``EXECUTING`` line (job name and its own directory) up to the next
    execution of the same name; within it, the job's lines and the trainer's report.
    """
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    out: list[str] = []
    inside = started = False
    this_job = re.compile(re.escape(job) + r"(?![0-9.])")
    for line in lines:
        if not _STAMP.match(line):
            if inside:
                out.append(line)
            continue
        inside = False
        e = _EXEC.search(line)
        if e and e["job"] == job:
            if started and e["dir"] != directory:
                break  # the next execution of this job name
            started = started or e["dir"] == directory
        if not started:
            continue
        if this_job.search(line):
            out.append(line)
            inside = True
            continue
        try:
            payload = json.loads(line.split(None, 3)[3])
        except (IndexError, ValueError):
            continue
        if isinstance(payload, dict) and payload.get("site") == site \
                and payload.get("round") == rnd:
            out.append(line)
    return out


def slurm_step_output(run: RunRecord, site: str, step_dir: str | None,
                      rnd: int) -> list[str]:
    """The SLURM job's stdout: slurm-<id>.out in the step's directory, else StdOut= of scontrol."""
    from xffl.jobs.slurm_view import SiteUnreachable, load_profiles, query_site, ssh_run

    profile = load_profiles(Path(run.run_dir))[site]
    try:
        if step_dir:
            rc, out, _ = ssh_run(profile, f"cat {shlex.quote(step_dir)}/slurm-*.out")
            if rc == 0:
                return out.splitlines()
        # the round's job, found by name (renamed or not) while SLURM still knows it
        ids = [j.job_id for j in query_site(run.id, site, profile, rnd)
               if j.job_id and j.round == rnd]
        if not ids:
            return []
        rc, out, _ = ssh_run(profile, " ; ".join(f"scontrol show -o job {shlex.quote(i)}"
                                                 for i in ids))
        paths = re.findall(r"StdOut=(\S+)", out)
        if rc == 0 and paths:
            rc, out, _ = ssh_run(profile, f"cat {shlex.quote(paths[-1])}")
            if rc == 0:
                return out.splitlines()
    except SiteUnreachable as exc:
        raise ConnectionFailed(f"site {site} cannot be reached: {exc}") from None
    return []


def collect(registry: Registry, run: RunRecord, site: str | None, rnd: int | None,
            lines: int) -> dict[str, Any]:
    """The log lines `xffl logs` shows, as a dict: first, for a failed or cancelled run, its
    ``cause`` (the registry's words; with a site, that site's); without a site, the logs'
    tails, their tracebacks hidden unless --debug."""
    from xffl.jobs.slurm_view import load_profiles

    root = Path(run.run_dir)
    sf_log = RunLayout(root).streamflow_log
    cause = causes(registry, run, site)
    if site is None:
        return {"run_id": run.id, "cause": cause,
                "runner_log": tail(RunLayout(root).supervisor_log, lines, state.debug),
                "streamflow_log": tail(sf_log, lines, state.debug)}
    if site not in run.sites:
        raise InvalidInput(f"run {run.id} has no site {site!r} (sites: {', '.join(run.sites)})")
    executions = step_runs(sf_log, site)
    if not executions:
        raise InvalidInput(f"site {site} has not started training in run {run.id} yet")
    wanted = str(rnd) if rnd is not None else executions[-1]["round"]
    matching = [e for e in executions if e["round"] == wanted]
    if not matching:
        raise InvalidInput(f"site {site} has trained rounds "
                           f"{', '.join(sorted({e['round'] for e in executions}, key=int))} "
                           f"in run {run.id}; no round {rnd}")
    execution = matching[-1]
    index = int(wanted) - 1
    profile = load_profiles(root).get(site)
    if profile is not None and profile.slurm is not None and profile.connector.type == "ssh":
        source = "slurm"
        out = slurm_step_output(run, site, execution["dir"], index + 1)
    else:
        source = "streamflow.log"
        out = local_step_lines(sf_log, site, execution["job"], index + 1, execution["dir"])
    return {"run_id": run.id, "cause": cause, "site": site, "round": index + 1,
            "attempt": int(execution["attempt"]), "source": source,
            "directory": execution["dir"], "lines": out[-lines:]}


def _show(line: str) -> None:
    """One log line as text, at once (a pipe reader sees it now)."""
    console.print(printable(line), markup=False, soft_wrap=True)
    console.file.flush()


def follow_logs(registry: Registry, run: RunRecord, site: str | None, lines: int,
                timeout: float) -> RunRecord:
    """Print new log lines as they come until the run ends (exit 4 after ``timeout``).

    Without a site: supervisor.log and streamflow.log (their tracebacks hidden unless
    --debug). With one: the step lines of its latest
    training step, read as they are written (a local site's ``steps.log`` in the step's
    folder; a SLURM site's job output, read over SSH every few seconds); a new round or
    attempt of the site is announced by a header line and followed in turn.
    """
    from xffl.jobs.follow import Tail, wait_for_run
    from xffl.jobs.slurm_view import load_profiles
    from xffl.training.progress import STEP_LOG_FILE

    layout = RunLayout(Path(run.run_dir))
    if site is None:
        tails = [Tail(layout.supervisor_log), Tail(layout.streamflow_log)]
        first = [True, True]

        def each_run(_: RunRecord) -> None:
            for i, source in enumerate(tails):
                new = source.read() if state.debug else without_tracebacks(source.read())
                for line in new[-lines:] if first[i] else new:
                    _show(line)
                first[i] = False

        return wait_for_run(registry, run.id, timeout, on_update=each_run, poll=0.5)
    if site not in run.sites:
        raise InvalidInput(f"run {run.id} has no site {site!r} (sites: {', '.join(run.sites)})")
    profile = load_profiles(layout.root).get(site)
    remote = profile is not None and profile.slurm is not None \
        and profile.connector.type == "ssh"
    current: dict[str, Any] = {"dir": None, "tail": None, "printed": 0, "warned": False}

    def each_step(_: RunRecord) -> None:
        executions = step_runs(layout.streamflow_log, site)
        if not executions:
            return
        latest = executions[-1]
        if latest["dir"] != current["dir"]:
            current.update(dir=latest["dir"], printed=0,
                           tail=Tail(Path(latest["dir"]) / STEP_LOG_FILE))
            console.print(f"[bold]== {site} round {latest['round']} attempt "
                          f"{latest['attempt']} ==[/bold]", soft_wrap=True)
        if not remote:
            for line in current["tail"].read():
                _show(line)
            return
        try:
            out = slurm_step_output(run, site, latest["dir"], int(latest["round"]))
        except ConnectionFailed as exc:
            if not current["warned"]:
                console.print(f"[yellow]{markup_safe(exc)}[/yellow] (trying again)",
                              soft_wrap=True)
            current["warned"] = True
            return
        for line in out[current["printed"]:]:
            _show(line)
        current["printed"] = max(current["printed"], len(out))

    return wait_for_run(registry, run.id, timeout, on_update=each_step,
                        poll=5.0 if remote else 0.5)


def _cause(lines: list[str]) -> None:
    """The cause of a run's end, as the registry says it, before (or after) its logs."""
    console.print("[bold]== cause ==[/bold]")
    for line in lines:
        console.print(printable(line), markup=False, soft_wrap=True)


@handle_errors
def logs(
    run: RunArg = "last",
    site: Annotated[str | None, typer.Option("--site", help="Show this site's training job "
                                             "output.")] = None,
    round: Annotated[int | None, typer.Option("--round", min=1, help="Round (default: the "
                                              "latest one the site ran).")] = None,
    lines: Annotated[int, typer.Option("--lines", "-n", min=1, help="At most this many lines "
                                       "per log.")] = 200,
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="Print new lines as they come until the run ends (with --site: "
        "its step lines while it trains).")] = False,
    timeout: TimeoutOpt = 86400.0,
    as_json: JsonOpt = False,
) -> None:
    """Show a run's output: without --site, the tails of supervisor.log and streamflow.log; with
    --site, that site's training job output (a SLURM site's job stdout, read over SSH).

    A failed or cancelled run's output starts with its cause, per site, as `xffl status` has
    it. The tracebacks of StreamFlow's and the supervisor's internals are left out (a note
    on the line they belong to says so); `xffl logs --debug` shows every line.

    With -f the lines keep coming until the run ends (or --timeout, exit 4): a site's trainer
    prints a step line (step, loss, tokens/s, ETA) every 10 s or so. Exit 0 when the run
    completed; 1, after its cause, when it failed or was cancelled (as `xffl watch`).

    Example: xffl logs last --site alpha --round 1
    """
    rnd = round
    if rnd is not None and site is None:
        raise InvalidInput("--round picks a round of one site's training job; add --site SITE "
                           "(`xffl status` lists the sites).")
    if follow and (as_json or rnd is not None):
        raise InvalidInput("--follow prints lines as they come, from the latest round on; "
                           "leave out --json and --round.")
    registry = Registry()
    record = resolve_run(registry, run)
    if follow:
        final = follow_logs(registry, record, site, lines, timeout)
        if final.state != RunState.COMPLETED:  # as `xffl watch`: exit 1, and why
            _cause(causes(registry, final) or [f"run {final.id} {final.state}"])
            raise typer.Exit(int(ExitCode.RUN_FAILED))
        return
    data = collect(registry, record, site, rnd, lines)
    if as_json:
        print_json(data)
        return
    if data["cause"]:
        _cause(data["cause"])
    if site is None:
        for key, title in (("runner_log", "supervisor.log"), ("streamflow_log", "streamflow.log")):
            console.print(f"[bold]== {title} ==[/bold]")
            for line in data[key]:
                console.print(printable(line), markup=False, soft_wrap=True)
        return
    console.print(f"[bold]== {data['site']} round {data['round']} ({data['source']}) ==[/bold]")
    for line in data["lines"]:
        console.print(printable(line), markup=False, soft_wrap=True)
