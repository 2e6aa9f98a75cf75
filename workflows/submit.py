"""Submit a job: validate it, write its run directory, register it and start its runner."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from xffl.core.errors import InvalidInput
from xffl.core.layout import Registration
from xffl.core.names import NAME_RE, NAME_RULE
from xffl.core.paths import registry_path, runs_dir
from xffl.jobs.credential_gate import require_credentials
from xffl.jobs.registry.records import RunRecord
from xffl.jobs.registry.states import RunState
from xffl.jobs.registry.store import Registry, new_run_id
from xffl.jobs.spec.load import LoadedJob, load_job
from xffl.jobs.spec.trust import record_consent, require_consent, require_site_consent
from xffl.site_profiles.checks import preflight
from xffl.site_profiles.privacy import check_workdir
from xffl.workflows.plan.compile import write_plan
from xffl.workflows.plan.deployments import site_workdir
from xffl.workflows.site_ready import check_sites_ready
from xffl.workflows.supervisor import spawn


@dataclass(frozen=True)
class Submitted:
    """What ``submit`` returns: the run as registered and its runner's pid."""

    run: RunRecord
    pid: int | None


def prepare_run_dir(loaded: LoadedJob, run_id: str, run_dir: Path, registry: Path,
                    trust_entry_point: bool = False) -> None:
    """Write job.yaml (as submitted), job.json (resolved), the plan and run.json into ``run_dir``.

    Everything is written into a temporary sibling first and renamed at the end, so a failure
    leaves no half-written run directory behind. The plan is what ``xffl render`` writes;
    ``run.json`` registers it, so the plan's steps record the rounds in ``registry``. With
    ``trust_entry_point`` the user's consent to the spec's entry point is recorded too
    (:mod:`xffl.jobs.spec.trust`).
    """
    tmp = run_dir.parent / f".{run_dir.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        staged = write_plan(loaded, run_id, tmp, run_dir=run_dir)
        shutil.copyfile(loaded.path, staged.job_yaml)
        Registration(run_id=run_id, registry=registry).write(staged)
        if trust_entry_point and loaded.spec.model.entry_point is not None:
            record_consent(staged.root, loaded.spec)
        tmp.rename(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def submit(job_path: Path, name: str | None = None, start: bool = True,
           trust_entry_point: bool = False) -> Submitted:
    """Validate ``job_path``, create the run and start its detached runner.

    Without ``start`` the run waits for `xffl round` (one round per call, e.g. from cron).
    A spec whose round 0 needs its ``model.entry_point`` is refused unless
    ``trust_entry_point`` (the user's consent, recorded for the run's supervisor).
    """
    loaded = load_job(job_path)
    if name is not None and not NAME_RE.match(name):
        raise InvalidInput(f"--name {name!r} is not a valid run name prefix; use {NAME_RULE}.")
    require_consent(loaded.path, loaded.spec, trust_entry_point, "submit")
    profiles = {s.name: loaded.site_profile(s.name) for s in loaded.spec.sites}
    require_site_consent(loaded.path, loaded.spec, profiles, trust_entry_point, "submit")
    # certificates that will not outlast a round, then host keys and logins of every SSH site,
    # then every site's workdir private (created 0700 if missing), all before anything is
    # written
    require_credentials(loaded.spec, profiles, then=f"run `xffl submit {job_path}` again")
    preflight(loaded.profiles)
    for site, profile in profiles.items():
        check_workdir(site, profile, site_workdir(profile, site))
    # every site's data folders (and peft, for LoRA) through its own login: a problem there
    # is refused now, not after round 1's queue wait
    check_sites_ready(loaded)
    registry_file = registry_path()
    registry = Registry(registry_file)
    run_id = new_run_id(name or loaded.spec.name)
    run_dir = runs_dir() / run_id
    prepare_run_dir(loaded, run_id, run_dir, registry_file, trust_entry_point)
    try:
        registry.create_run(run_id, loaded.spec.name, loaded.path, run_dir, loaded.spec.rounds,
                            [s.name for s in loaded.spec.sites])
        pid = spawn(run_id, run_dir, registry_file) if start else None
    except BaseException:
        registry.delete_run(run_id)
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    if pid is None:
        registry.set_state(run_id, RunState.WAITING, f"not started: `xffl round {run_id}` runs the "
                           f"next round (`xffl schedule {run_id} --cron EXPR` from cron)")
    else:
        registry.event(run_id, "runner", f"supervisor spawned (pid {pid})")
    return Submitted(run=registry.get_run(run_id), pid=pid)
