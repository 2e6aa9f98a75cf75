"""xffl's own SSH connections to a site's login node, with host keys always verified."""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from xffl.core.errors import ConnectionFailed
from xffl.site_profiles.schema import SiteProfile, SshConnector

CONNECT_TIMEOUT = 15.0
PLACEHOLDER = "YOUR_"


def _known_hosts(conn: SshConnector) -> Path:
    return Path(conn.known_hosts or "~/.ssh/known_hosts").expanduser()


def connect(profile: SiteProfile) -> paramiko.SSHClient:
    """Open an SSH connection to the profile's login node; every failure is ConnectionFailed."""
    conn = profile.connector
    if not isinstance(conn, SshConnector):
        raise ConnectionFailed(f"site {profile.name!r} is local; there is nothing to connect to.")
    where = f"{conn.host}:{conn.port}"
    known = _known_hosts(conn)
    client = paramiko.SSHClient()
    if known.is_file():
        try:
            client.load_host_keys(str(known))
        except OSError as exc:
            raise ConnectionFailed(
                f"site {profile.name!r}: cannot read known_hosts {known} ({exc}); fix the file."
            ) from None
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    key_file = str(Path(conn.key_file).expanduser()) if conn.key_file else None
    try:
        client.connect(
            conn.host, port=conn.port, username=conn.user, key_filename=key_file,
            look_for_keys=False, allow_agent=key_file is None, timeout=CONNECT_TIMEOUT,
            banner_timeout=CONNECT_TIMEOUT, auth_timeout=CONNECT_TIMEOUT,
        )
    except paramiko.BadHostKeyException:
        client.close()
        raise ConnectionFailed(
            f"site {profile.name!r}: host key of {where} changed (possible man-in-the-middle or "
            f"a reinstalled login node); verify it with the facility and update known_hosts "
            f"{known}."
        ) from None
    except paramiko.AuthenticationException as exc:
        client.close()
        how = f"key {key_file}" if key_file else "the ssh-agent"
        raise ConnectionFailed(
            f"site {profile.name!r}: authentication to {where} as {conn.user!r} with {how} "
            f"failed ({exc}); check user and key_file in the profile (or load the key into "
            "the agent)."
        ) from None
    except paramiko.SSHException as exc:
        client.close()
        if "known_hosts" in str(exc):
            raise ConnectionFailed(
                f"site {profile.name!r}: host {where} is not in known_hosts {known}; add it "
                "with ssh-keyscan after verifying the fingerprint with the facility."
            ) from None
        raise ConnectionFailed(f"site {profile.name!r}: SSH to {where} failed: {exc}.") from None
    except TimeoutError:
        client.close()
        raise ConnectionFailed(
            f"site {profile.name!r}: connecting to {where} timed out after "
            f"{CONNECT_TIMEOUT:.0f} s; check host, port and your network/VPN."
        ) from None
    except OSError as exc:
        client.close()
        raise ConnectionFailed(
            f"site {profile.name!r}: cannot reach {where} ({exc}); check host and port."
        ) from None
    return client


def run(client: paramiko.SSHClient, command: str, timeout: float = 60.0) -> tuple[int, str, str]:
    """Run ``command`` on the login node; return (exit status, stdout, stderr)."""
    try:
        _, out, err = client.exec_command(command, timeout=timeout)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
        return out.channel.recv_exit_status(), stdout, stderr
    except TimeoutError:
        return 124, "", f"timed out after {timeout:.0f} s"
    except paramiko.SSHException as exc:
        return 255, "", str(exc)


@dataclass
class SiteCheck:
    """The outcome of ``check_site``: one row (check, ok, detail) per check."""

    site: str
    rows: list[tuple[str, bool, str]] = field(default_factory=list)
    connected: bool = True

    @property
    def ok(self) -> bool:
        return self.connected and all(ok for _, ok, _ in self.rows)

    def add(self, check: str, ok: bool, detail: str) -> None:
        self.rows.append((check, ok, detail))

    def as_dict(self) -> dict[str, object]:
        return {"site": self.site, "ok": self.ok, "connected": self.connected,
                "checks": [{"check": c, "ok": o, "detail": d} for c, o, d in self.rows]}


def placeholders(profile: SiteProfile) -> list[str]:
    """Fields still holding a ``YOUR_...`` placeholder."""
    found = []
    conn = profile.connector
    if isinstance(conn, SshConnector):
        for key in ("host", "user", "key_file"):
            if PLACEHOLDER in str(getattr(conn, key) or ""):
                found.append(key)
    if profile.slurm is not None and PLACEHOLDER in str(profile.slurm.account or ""):
        found.append("account")
    if PLACEHOLDER in (profile.python or ""):
        found.append("python")
    if PLACEHOLDER in profile.workdir:
        found.append("workdir")
    return found


def _workdir_script(workdir: str) -> str:
    probe = f"{workdir.rstrip('/')}/.xffl-write-test"
    return (f"mkdir -p {shlex.quote(workdir)} && touch {shlex.quote(probe)} "
            f"&& rm -f {shlex.quote(probe)}")


def _check_local(check: SiteCheck, profile: SiteProfile, workdir: str) -> None:
    python = profile.python or sys.executable
    proc = subprocess.run([python, "-c", "import xffl.training"], capture_output=True,
                          text=True, timeout=120, check=False)
    check.add("xffl importable", proc.returncode == 0,
              python if proc.returncode == 0 else (proc.stderr.strip().splitlines() or [""])[-1])
    try:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        probe = Path(workdir) / ".xffl-write-test"
        probe.touch()
        probe.unlink()
        check.add("workdir writable", True, workdir)
    except OSError as exc:
        check.add("workdir writable", False, f"{workdir}: {exc}")


def _workdir(profile: SiteProfile, name: str) -> str:
    from xffl.core.paths import xffl_home

    return profile.workdir.replace("{xffl_home}", str(xffl_home())).replace("{site}", name)


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
        client = connect(profile)
    except ConnectionFailed as exc:
        check.connected = False
        check.add("connect", False, exc.message)
        return check
    with client:
        check.add("connect", True, f"{conn.user or ''}@{conn.host}:{conn.port} (host key verified)")
        rc, out, err = run(client, "command -v sbatch squeue sinfo")
        found = [Path(p).name for p in out.split()]
        lacking = [c for c in ("sbatch", "squeue", "sinfo") if c not in found]
        check.add("slurm commands", not lacking,
                  "sbatch squeue sinfo found" if not lacking else f"missing: {' '.join(lacking)}")
        partition = profile.slurm.partition if profile.slurm else None
        if partition:
            rc, out, err = run(client, f"sinfo -h -p {shlex.quote(partition)}")
            ok = rc == 0 and bool(out.strip())
            check.add("partition", ok, partition if ok else
                      f"{partition}: {err.strip() or 'not found (sinfo printed nothing)'}")
        rc, out, err = run(client, _workdir_script(workdir))
        check.add("workdir writable", rc == 0, workdir if rc == 0 else
                  f"{workdir}: {err.strip() or f'exit {rc}'}")
        python = profile.python or "python3"
        rc, out, err = run(client, f"{shlex.quote(python)} -c 'import xffl.training'", 120)
        check.add("xffl importable", rc == 0, python if rc == 0 else
                  f"{python}: {(err.strip().splitlines() or [f'exit {rc}'])[-1]}")
    return check


def preflight(profiles: dict[str, SiteProfile]) -> None:
    """Connect once to every SSH site; raise ConnectionFailed on the first failure."""
    seen: set[tuple[str, int, str | None]] = set()
    for profile in profiles.values():
        conn = profile.connector
        if not isinstance(conn, SshConnector):
            continue
        key = (conn.host, conn.port, conn.user)
        if key in seen:
            continue
        seen.add(key)
        connect(profile).close()
