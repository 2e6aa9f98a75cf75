"""A site's side of the plan: its StreamFlow deployments and the batch script of its SLURM jobs.

A SLURM site is an ssh deployment (its login node) wrapped by a slurm deployment whose
``train`` service carries the sbatch options of the site's effective SLURM settings (the
profile's slurm section with the job spec's per-site overrides applied). The same settings
render ``sbatch/<site>.sh``, the script a user can submit by hand.
"""

from __future__ import annotations

import getpass
import shlex
import sys
from pathlib import Path
from typing import Any

from xffl.core.names import slurm_job_name
from xffl.core.paths import xffl_home
from xffl.site_profiles.login import Login, resolve
from xffl.site_profiles.schema import LocalConnector, SiteProfile, SlurmSpec

# sbatch's long option names, the SlurmSpec field and StreamFlow's camelCase service key
_SBATCH_OPTIONS = (
    ("partition", "partition", "partition"), ("account", "account", "account"),
    ("qos", "qos", "qos"), ("ntasks-per-node", "ntasks_per_node", "ntasksPerNode"),
    ("gpus-per-node", "gpus_per_node", "gpusPerNode"),
    ("cpus-per-task", "cpus_per_task", "cpusPerTask"), ("mem", "mem", "mem"),
    ("constraint", "constraint", "constraint"),
)


def site_workdir(profile: SiteProfile, site: str) -> str:
    """The profile's working directory for ``site`` with placeholders substituted."""
    return profile.workdir.replace("{xffl_home}", str(xffl_home())).replace("{site}", site)


def site_python(profile: SiteProfile) -> str:
    """The Python interpreter with xffl installed at the site."""
    return profile.python or sys.executable


def sbatch_options(slurm: SlurmSpec) -> list[str]:
    """The ``--option=value`` lines of ``slurm`` beyond nodes/ntasks/time, ``extra`` last."""
    options = [f"--{flag}={getattr(slurm, field)}" for flag, field, _ in _SBATCH_OPTIONS
               if getattr(slurm, field) is not None]
    return options + list(slurm.extra)


def batch_template(profile: SiteProfile) -> str:
    """The batch script StreamFlow submits for a SLURM site (a Jinja2 template for it).

    ``{{streamflow_command}}`` is where StreamFlow puts the step's command; the profile's
    ``extra`` #SBATCH options (which StreamFlow has no key for), setup lines and
    environment come from the site's effective profile, shell-quoted, inside a Jinja2 raw
    block (so that a ``{{`` of theirs reaches the script as written).
    """
    assert profile.slurm is not None
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {opt}" for opt in profile.slurm.extra]
    lines += ["# xffl: one federated round at this site (submitted by StreamFlow)",
              "set -eo pipefail"]
    lines += list(profile.setup)
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(profile.env.items())]
    return "{% raw %}" + "\n".join(lines) + "\n{% endraw %}{{streamflow_command}}\n"


def sbatch_script(run_id: str, site: str, profile: SiteProfile, ranks: int, data_path: str,
                  final: Path) -> str:
    """A complete batch script for one round at ``site``, runnable by hand with sbatch."""
    import jinja2

    slurm = profile.slurm
    assert slurm is not None
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("xffl.workflows", "templates"),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False,
    )
    env.filters["q"] = lambda v: shlex.quote(str(v))
    return env.get_template("sbatch.sh.j2").render(
        site=site, run_id=run_id, script_name=f"sbatch/{site}.sh",
        job_name=slurm_job_name(run_id, site), slurm=slurm, ranks=ranks,
        options=sbatch_options(slurm),
        model=str(final / "rounds" / "0" / "global"), out=str(final / "manual" / site),
        setup=profile.setup, env=sorted(profile.env.items()), python=site_python(profile),
        launcher=profile.launcher, job_file=str(final / "jobs" / f"{site}.json"),
        data=data_path,
    )


def slurm_service(run_id: str, site: str, profile: SiteProfile, ranks: int,
                  template: Path) -> dict[str, Any]:
    """sbatch options (StreamFlow's camelCase names) for a site's train job.

    ``jobName`` is the run's and site's prefix; the runner sets the round's full name
    (``...-r<round>``) in each round's configuration, and the launcher renames a job that
    was submitted without it (``--slurm-job-name``).
    """
    slurm = profile.slurm
    assert slurm is not None
    service: dict[str, Any] = {"file": str(template), "jobName": slurm_job_name(run_id, site),
                               "nodes": str(slurm.nodes), "ntasks": ranks, "time": slurm.time}
    service.update({key: getattr(slurm, field) for _, field, key in _SBATCH_OPTIONS
                    if getattr(slurm, field) is not None})
    return service


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


def site_deployments(run_id: str, site: str, profile: SiteProfile, ranks: int,
                     out: Path, final: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The StreamFlow deployments of one site and the binding target of its train step."""
    conn = profile.connector
    if isinstance(conn, LocalConnector):
        return {f"site-{site}": {"type": "local", "config": {}}}, {"deployment": f"site-{site}"}
    resolved = resolve(conn, f"site profile {profile.name}")
    node = ssh_connection(resolved, out / "ssh", final / "ssh", site)
    login: dict[str, Any] = {
        "nodes": [node.pop("hostname")], **node,
        "connectTimeout": conn.transfer.connect_timeout, "retries": conn.transfer.retries,
        "retryDelay": conn.transfer.retry_delay,
        "transferBufferSize": conn.transfer.buffer_size,
    }
    workdir = site_workdir(profile, site)
    deployments: dict[str, Any] = {
        f"login-{site}": {"type": "ssh", "config": login, "workdir": workdir},
    }
    if profile.slurm is None:
        return deployments, {"deployment": f"login-{site}"}
    template = out / "sbatch" / f"{site}.j2"
    template.parent.mkdir(parents=True, exist_ok=True)
    template.write_text(batch_template(profile))
    deployments[f"slurm-{site}"] = {
        "type": "slurm", "wraps": f"login-{site}", "workdir": workdir,
        "config": {
            "pollingInterval": profile.slurm.polling_interval, "maxConcurrentJobs": 4,
            "services": {"train": slurm_service(run_id, site, profile, ranks,
                                                final / "sbatch" / f"{site}.j2")},
        },
    }
    return deployments, {"deployment": f"slurm-{site}", "service": "train"}
