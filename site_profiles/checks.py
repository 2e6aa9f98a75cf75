"""What `xffl profiles check` and submit's preflight ask of a site: its login (credential,
verified host key), its SLURM commands and partition, its workdir (made owner-only, writable,
private), its Python's versions and GPUs, its container image and runtime, its transfer host."""

from __future__ import annotations

import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

import paramiko

from xffl.core.errors import ConnectionFailed, XfflError
from xffl.site_profiles.container import RUNTIME_COMMANDS, ContainerSpec
from xffl.site_profiles.credentials import renew_advice, site_credential
from xffl.site_profiles.login import resolve
from xffl.site_profiles.lookup import placeholders
from xffl.site_profiles.remote import (
    connect,
    connect_transfer_host,
    run,
    transfer_login,
)
from xffl.site_profiles.schema import SiteProfile, SshConnector
from xffl.site_profiles.shell_text import expand_workdir
from xffl.site_profiles.site_check import SiteCheck, missing_certificate
from xffl.site_profiles.versions import gres_of, probe_command, python_rows


def _workdir_script(workdir: str) -> str:
    """Create the workdir owner-only if missing, prove it writable, print its mode (octal)."""
    probe = f"{workdir.rstrip('/')}/.xffl-write-test"
    return (f"mkdir -p -m 700 {shlex.quote(workdir)} && touch {shlex.quote(probe)} "
            f"&& rm -f {shlex.quote(probe)} && stat -c %a {shlex.quote(workdir)}")


def _octal(text: str) -> int | None:
    """A mode as `stat -c %a` prints it (e.g. "700"), or None for anything else."""
    return int(text, 8) if text and set(text) <= set("01234567") else None


def _add_private(check: SiteCheck, workdir: str, mode: int | None) -> None:
    """The row for the workdir's permissions: no one else may write where jobs leave updates."""
    if mode is None:
        check.add("workdir private", False, f"{workdir}: its mode could not be read")
    elif mode & 0o022:
        check.add("workdir private", False,
                  f"{workdir} is mode {mode:04o}: other users can replace what xffl's jobs "
                  f"leave there; run `chmod go-w {shlex.quote(workdir)}` at the site")
    else:
        check.add("workdir private", True, f"mode {mode:04o}")


def _check_local(check: SiteCheck, profile: SiteProfile, workdir: str) -> None:
    python = profile.python or sys.executable
    try:
        proc = subprocess.run(["sh", "-c", probe_command(python, full=True)],
                              capture_output=True, text=True, timeout=120, check=False)
        answer = (proc.returncode, proc.stdout, proc.stderr)
    except subprocess.TimeoutExpired:
        answer = (124, "", "timed out after 120 s")
    rows, check.versions = python_rows(python, *answer, gres=None, partition=None,
                                          profile=profile.name)
    for row in rows:
        check.add(*row)
    try:
        Path(workdir).mkdir(mode=0o700, parents=True, exist_ok=True)
        probe = Path(workdir) / ".xffl-write-test"
        probe.touch()
        probe.unlink()
        check.add("workdir writable", True, workdir)
    except OSError as exc:
        check.add("workdir writable", False, f"{workdir}: {exc}")
        return
    _add_private(check, workdir, Path(workdir).stat().st_mode & 0o7777)


def _workdir(profile: SiteProfile, name: str) -> str:
    from xffl.core.paths import xffl_home

    return expand_workdir(profile.workdir, str(xffl_home()), name)


def check_site(name: str, profile: SiteProfile) -> SiteCheck:
    """Check that the site can run xffl jobs; a connection failure is a row, not an exception."""
    check = SiteCheck(site=name)
    missing = placeholders(profile)
    if missing:
        check.add("placeholders", False,
                  f"fill in {'/'.join(missing)} in site_profiles/{profile.name}.yaml")
    workdir = _workdir(profile, name)
    if not isinstance(profile.connector, SshConnector):
        _check_local(check, profile, workdir)
        return check
    conn = profile.connector
    try:
        login = resolve(conn, f"site profile {profile.name}")
    except XfflError as exc:
        check.connected = False
        check.add("login", False, exc.message)
        check.unreached(profile)
        return check
    cred = site_credential(name, login, conn.renew)
    check.credential = cred
    now = time.time()
    unusable = [c for c in cred.endpoints if c.certificate is not None and
                not c.certificate.valid_after <= now < (c.expires or math.inf)]
    problem = cred.problem or (f"{unusable[0].endpoint}: certificate not valid now"
                               if unusable else None)
    no_cert = None if problem else missing_certificate(cred, conn.renew)
    check.add("login", problem is None and no_cert is None,
              f"{login.describe()} with {cred.describe()}"
              + (f"; {renew_advice(conn.renew)}" if problem else "")
              + (f" — {no_cert}" if no_cert else ""))
    if problem is not None or no_cert is not None:  # do not knock with what cannot work
        check.connected = False
        check.unreached(profile)
        return check
    try:
        client = connect(profile)
    except ConnectionFailed as exc:
        check.connected = False
        check.add("connect", False, exc.message)
        check.unreached(profile)
        return check
    with client:
        check.add("connect", True, f"{login.describe()} (host key verified)")
        rc, out, err = run(client, "command -v sbatch squeue sinfo")
        found = [Path(p).name for p in out.split()]
        lacking = [c for c in ("sbatch", "squeue", "sinfo") if c not in found]
        check.add("slurm commands", not lacking,
                  "sbatch squeue sinfo found" if not lacking else f"missing: {' '.join(lacking)}")
        partition = profile.slurm.partition if profile.slurm else None
        gres = None
        if partition:  # its GRES (%G) too: the GPUs row shows them
            rc, out, err = run(client, f"sinfo -h -p {shlex.quote(partition)} -o %G")
            ok = rc == 0 and bool(out.strip())
            gres = gres_of(out) if ok else None
            check.add("partition", ok, partition if ok else
                      f"{partition}: {err.strip() or 'not found (sinfo printed nothing)'}")
        rc, out, err = run(client, _workdir_script(workdir))
        check.add("workdir writable", rc == 0, workdir if rc == 0 else
                  f"{workdir}: {err.strip() or f'exit {rc}'}")
        if rc == 0:
            _add_private(check, workdir, _octal(out.split()[-1] if out.split() else ""))
        python = profile.python or "python3"
        answer = run(client, probe_command(python, full=True), 120)
        rows, check.versions = python_rows(python, *answer, gres=gres, partition=partition,
                                              profile=profile.name)
        for row in rows:
            check.add(*row)
        if profile.container is not None:
            check.add(*container_row(client, profile.container, profile.name))
    dtn = transfer_login(profile)
    if dtn is not None:
        try:
            connect_transfer_host(profile).close()
            check.add("transfer host", True, f"{dtn.describe()} (host key verified)")
        except ConnectionFailed as exc:
            check.add("transfer host", False, exc.message)
    return check


def container_row(client: paramiko.SSHClient, container: ContainerSpec,
                  name: str) -> tuple[str, bool, str]:
    """Whether the container's image exists at the site and its runtime is on the login
    node's PATH (the compute nodes' may differ: a `module load` in setup reaches both)."""
    exe = RUNTIME_COMMANDS[container.runtime]
    image = shlex.quote(container.image)
    rc, out, _ = run(client, f"if ! test -e {image}; then echo no-image; "
                     f"else command -v {exe} || echo no-runtime; fi")
    answer = out.strip().splitlines()[-1] if out.strip() else ""
    if answer == "no-image":
        return ("container image", False, f"{container.image} does not exist at the site; "
                f"build it (`xffl profiles image {name}` writes its definition) and put it "
                "there, or fix container.image")
    if answer == "no-runtime" or rc != 0:
        return ("container image", False, f"{container.image} exists, but {exe} is not on "
                "the login node's PATH; load its module in the profile's setup, or install it")
    return ("container image", True, f"{container.image} ({exe}: {answer})")


def preflight(profiles: dict[str, SiteProfile]) -> None:
    """Connect once to every SSH site; raise ConnectionFailed on the first failure."""
    seen: set[tuple[str, int, str | None]] = set()
    for profile in profiles.values():
        conn = profile.connector
        if not isinstance(conn, SshConnector):
            continue
        login = resolve(conn, f"site profile {profile.name}")
        key = (login.host, login.port, login.user)
        if key in seen:
            continue
        seen.add(key)
        connect(profile).close()
        if conn.transfer_host is not None:
            connect_transfer_host(profile).close()
