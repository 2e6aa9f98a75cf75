"""A site's side of the plan: its StreamFlow deployments and the batch script of its SLURM jobs.

A SLURM site is an ssh deployment (its login node) wrapped by an ``xffl-slurm`` deployment
(StreamFlow's SLURM connector with xffl's deadline; see :mod:`xffl.workflows.extensions.connectors`)
whose batch template is ``sbatch/<site>.j2``. That template and the hand-run
``sbatch/<site>.sh`` come from one Jinja2 template (``templates/sbatch.sh.j2``) and the
site's effective SLURM settings (the profile's slurm section with the job spec's per-site
overrides applied), so what StreamFlow submits and what a user submits by hand agree.
"""

from __future__ import annotations

import getpass
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xffl.core.errors import InvalidInput
from xffl.core.layout import RunLayout
from xffl.core.names import slurm_job_name
from xffl.core.paths import xffl_home
from xffl.schedulers.base import Scheduler
from xffl.site_profiles.container import binds, rank_python
from xffl.site_profiles.login import Login, resolve
from xffl.site_profiles.schema import (
    LocalConnector,
    SiteProfile,
    shell_unsafe_char,
)
from xffl.site_profiles.shell_text import expand_workdir
from xffl.workflows.extensions import (
    LOCAL_CONNECTOR,
    SSH_CONNECTOR,
    queue_connector,
)

TRAIN_SERVICE = "train"
COORDINATOR = "coordinator"  # the deployment of the steps that run on the coordinator
SLURM_NAME_OPTION = "--slurm-job-name"  # the launcher's option naming the round's job


def site_workdir(profile: SiteProfile, site: str) -> str:
    """The profile's working directory for ``site`` with placeholders substituted.

    The profile's text is checked by its schema; ``{xffl_home}`` (this machine's XFFL_HOME)
    must be as plain, since StreamFlow passes the workdir unquoted to the site's shell.
    """
    home = str(xffl_home())
    if "{xffl_home}" in profile.workdir and (bad := shell_unsafe_char(home)) is not None:
        raise InvalidInput(
            f"site {site!r}: the workdir of profile {profile.name!r} is under XFFL_HOME "
            f"{home!r}, which holds {bad!r}; StreamFlow passes the workdir unquoted to a shell, "
            "so set XFFL_HOME to a path of letters, digits and _ . / - + , : @ % =, or give "
            "the profile an absolute workdir")
    return expand_workdir(profile.workdir, home, site)


def site_python(profile: SiteProfile) -> str:
    """The Python interpreter with xffl installed at the site."""
    return profile.python or sys.executable


def site_data_path(profile: SiteProfile, site: str, path: str) -> str:
    """A site's data path on that site's filesystem (relative paths join the workdir)."""
    if path.startswith(("/", "~")):
        return path
    return f"{site_workdir(profile, site).rstrip('/')}/{path}"


def kept_updates_dir(profile: SiteProfile, site: str, run_id: str) -> str:
    """The folder at the site where the launcher keeps the site's last update of the run."""
    return f"{site_workdir(profile, site).rstrip('/')}/kept/{run_id}"


@dataclass(frozen=True)
class BatchPaths:
    """Where the hand-run batch script finds its inputs, relative to the submit folder."""

    model: str = "rounds/0/global"
    base: str = "rounds/0/base"  # a LoRA job's frozen base model (RunLayout.base_model)
    job_file: str = "jobs/{site}.json"
    out: str = "updates/{site}"
    kept: str = "kept/{site}"  # a chained round's state folder (the launcher's --keep)


def batch_script(run_id: str, site: str, profile: SiteProfile, ranks: int, data_path: str, *,
                 by_hand: bool, lora: bool = False, chain_margin: int | None = None) -> str:
    """The batch script of ``site`` from the one template, for StreamFlow or for sbatch.

    ``by_hand``: a complete script (``sbatch/<site>.sh``) that trains one round from paths
    relative to the folder it is submitted from. Otherwise: the Jinja2 template that
    StreamFlow renders again with each round's command (``{{streamflow_command}}``); the
    site's own lines sit in a raw block there (the profile schema refuses ``{%`` in them).
    ``lora``: the hand-run script also passes the frozen base model (``--base``), as the
    workflow's tool does. ``chain_margin``: a chained round's (``training.checkpoint.chain``)
    seconds before the time limit at which SLURM signals the job (``--signal=B:USR1@...``),
    which the script forwards to the launcher.
    """
    import jinja2

    from xffl.training.launch import build_command

    slurm, scheduler = profile.batch, profile.scheduler
    assert slurm is not None and scheduler is not None
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("xffl.workflows.plan", "templates"),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False,
    )
    env.filters["q"] = lambda v: shlex.quote(str(v))
    paths = BatchPaths()
    prefix = slurm_job_name(run_id, site)
    container = profile.container
    words = [] if container is None else rank_python(
        container, binds(container, site_workdir(profile, site), data_path))
    # StreamFlow's rendering names the job after the round, from the launcher's
    # --slurm-job-name in the round's command (the bare prefix if it has none)
    round_job_name = (f"{{{{ streamflow_command.split('{SLURM_NAME_OPTION}')[1].split()[0] "
                      f"if '{SLURM_NAME_OPTION}' in streamflow_command else '{prefix}' }}}}")
    return env.get_template("sbatch.sh.j2").render(
        name_directive=scheduler.name_directive(prefix if by_hand else round_job_name),
        directives=scheduler.directives(slurm.nodes, ranks, slurm.time, profile.batch_options(),
                                        chain_margin),
        chain_margin=chain_margin,
        by_hand=by_hand, site=site, run_id=run_id, script_name=f"sbatch/{site}.sh",
        job_name=prefix, ranks=ranks, setup=profile.setup, env=sorted(profile.env.items()),
        python=site_python(profile), launcher=profile.launcher, data=data_path,
        model=paths.model, job_file=paths.job_file.format(site=site),
        out=paths.out.format(site=site), base=paths.base if lora else "",
        kept=paths.kept.format(site=site),
        rank_python=shlex.join(words), runtime=container and container.runtime,
        image=container and container.image, rank_command=shlex.join(build_command(
            ranks, profile.launcher, ["..."], python=words)) if words else "",
    )


def ssh_connection(login: Login, links: Path, final_links: Path, tag: str) -> dict[str, Any]:
    """StreamFlow's connection object for ``login`` (jump hosts as nested ``tunnel``).

    asyncssh, under StreamFlow, takes a key's certificate only from ``KEY-cert.pub``; a
    certificate kept elsewhere is linked there as ``ssh/<tag>`` and ``ssh/<tag>-cert.pub``
    in the run directory (links, so a renewed certificate is picked up). Without a key
    file asyncssh uses the ssh-agent at $SSH_AUTH_SOCK.
    """
    node: dict[str, Any] = {"hostname": login.where, "checkHostKey": True,
                            "username": login.user or getpass.getuser()}
    if login.key_file is not None:
        key = login.key_file
        if login.certificate is not None and login.certificate != f"{key}-cert.pub":
            links.mkdir(parents=True, exist_ok=True)
            for name, target in ((tag, key), (f"{tag}-cert.pub", login.certificate)):
                (links / name).unlink(missing_ok=True)
                (links / name).symlink_to(target)
            key = str(final_links / tag)
        node["sshKey"] = key
    if login.jump is not None:
        node["tunnel"] = ssh_connection(login.jump, links, final_links, f"{tag}-jump")
    return node


def site_deployments(site: str, profile: SiteProfile, out: Path,
                     final: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The StreamFlow deployments of one site and the binding target of its train step."""
    conn = profile.connector
    workdir = site_workdir(profile, site)
    if isinstance(conn, LocalConnector):  # its jobs' folders in the site's workdir, as remotely
        return ({f"site-{site}": {"type": LOCAL_CONNECTOR, "config": {}, "workdir": workdir}},
                {"deployment": f"site-{site}"})
    resolved = resolve(conn, f"site profile {profile.name}")
    node = ssh_connection(resolved, out / "ssh", final / "ssh", site)
    login: dict[str, Any] = {
        "nodes": [node.pop("hostname")], **node,
        "connectTimeout": conn.transfer.connect_timeout, "retries": conn.transfer.retries,
        "retryDelay": conn.transfer.retry_delay,
        "transferBufferSize": conn.transfer.buffer_size,
        # a copy back (an update) is capped by the kind and size of the run's global
        "copyReference": str(RunLayout(final).initial_model),
        "copyFactor": conn.transfer.copy_factor,
        # a copy's files over several channels, resumed after a dropped connection
        "copyStreams": conn.transfer.streams, "copyRetries": conn.transfer.retries,
        "copyStreamsFromRtt": conn.transfer.streams_from_rtt,
        # sshd's MaxSessions is 10 per connection: the copy's channels beside the shells
        "maxConnections": 1 + conn.transfer.streams // 8,
    }
    if conn.transfer_host is not None:  # StreamFlow's data transfer connection: the DTN
        dtn = conn.transfer_host
        login["dataTransferConnection"] = {
            "hostname": f"{dtn.host}:{dtn.port or 22}", "checkHostKey": True,
            "username": dtn.user or login["username"],
            **({"sshKey": str(Path(dtn.key_file).expanduser())} if dtn.key_file else
               {"sshKey": login["sshKey"]} if "sshKey" in login else {})}
    if conn.known_hosts is not None:  # StreamFlow checks the host key as xffl does
        login["knownHosts"] = str(Path(conn.known_hosts).expanduser())
    deployments: dict[str, Any] = {  # xffl-ssh: checked copies, owner-only job folders
        f"login-{site}": {"type": SSH_CONNECTOR, "config": login, "workdir": workdir},
    }
    if profile.batch is None or profile.scheduler is None:
        return deployments, {"deployment": f"login-{site}"}
    queue = queue_deployment(profile.scheduler, site)
    deployments[queue] = {
        "type": queue_connector(profile.scheduler.name), "wraps": f"login-{site}",
        "workdir": workdir,
        "config": {
            # every sbatch option is a #SBATCH line of the template, as in the hand-run
            # script; StreamFlow adds --parsable, --chdir and the output file
            "pollingInterval": profile.batch.polling_interval, "maxConcurrentJobs": 4,
            "services": {TRAIN_SERVICE: {"file": str(RunLayout(final).batch_template(site))}},
        },
    }
    return deployments, {"deployment": queue, "service": TRAIN_SERVICE}


def queue_deployment(scheduler: Scheduler, site: str) -> str:
    """The name of the site's deployment that submits to its scheduler (``slurm-<site>``)."""
    return f"{scheduler.name}-{site}"
