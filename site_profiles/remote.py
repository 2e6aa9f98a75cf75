"""xffl's own SSH connections to a site's login node, with host keys always verified."""

from __future__ import annotations

import math
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import paramiko

from xffl.core.errors import ConnectionFailed, XfflError
from xffl.site_profiles.container import RUNTIME_COMMANDS, ContainerSpec
from xffl.site_profiles.credentials import renew_advice, site_credential
from xffl.site_profiles.login import Login, known_hosts_path, resolve
from xffl.site_profiles.lookup import placeholders
from xffl.site_profiles.schema import SiteProfile, SshConnector
from xffl.site_profiles.site_check import SiteCheck, missing_certificate
from xffl.site_profiles.versions import gres_of, probe_command, python_rows

CONNECT_TIMEOUT = 15.0


class _Client(paramiko.SSHClient):
    """An SSHClient that also closes the jump-host connections it was opened through."""

    def __init__(self) -> None:
        super().__init__()
        self.jumps: list[paramiko.SSHClient] = []

    def close(self) -> None:
        """Close this connection, then the jump hosts' (innermost first)."""
        super().close()
        for jump in reversed(self.jumps):
            jump.close()
        self.jumps = []


def _pkey(login: Login) -> paramiko.PKey | None:
    """The identity file with its certificate attached, or None for the ssh-agent."""
    if login.key_file is None:
        return None
    try:
        key = paramiko.PKey.from_path(login.key_file)
    except paramiko.PasswordRequiredException:
        raise ConnectionFailed(
            f"key {login.key_file} is protected by a passphrase; load it into the ssh-agent "
            "(ssh-add) and leave key_file out of the profile.") from None
    except (OSError, paramiko.SSHException, ValueError) as exc:
        raise ConnectionFailed(f"cannot read key {login.key_file} ({exc}); fix key_file in "
                               "the profile.") from None
    if login.certificate is not None:
        try:
            key.load_certificate(login.certificate)
        except (OSError, ValueError, paramiko.SSHException) as exc:
            raise ConnectionFailed(f"cannot use certificate {login.certificate} with key "
                                   f"{login.key_file} ({exc}); renew the certificate.") from None
    return key


def _auth_failed(name: str, profile: SiteProfile, login: Login, exc: Exception) -> str:
    """Why authentication failed, with the credential's expiry when that explains it."""
    cred = site_credential(name, login, _renew(profile))
    how = cred.describe()
    return (f"site {name!r}: authentication to {login.describe()} failed ({exc}); the login "
            f"uses {how}; check user and key_file in the profile, "
            f"{renew_advice(_renew(profile))}.")


def _renew(profile: SiteProfile) -> str | None:
    conn = profile.connector
    return conn.renew if isinstance(conn, SshConnector) else None


def _open(name: str, profile: SiteProfile, login: Login, known: Path) -> _Client:
    """Connect to ``login`` through its jump hosts; every failure is ConnectionFailed."""
    jumps: list[paramiko.SSHClient] = []
    sock = None
    if login.jump is not None:
        outer = _open(name, profile, login.jump, known)
        jumps = [*outer.jumps, outer]
        outer.jumps = []
        transport = outer.get_transport()
        try:
            assert transport is not None
            sock = transport.open_channel("direct-tcpip", (login.host, login.port),
                                          ("127.0.0.1", 0), timeout=CONNECT_TIMEOUT)
        except (paramiko.SSHException, OSError, AssertionError) as exc:
            for j in reversed(jumps):
                j.close()
            raise ConnectionFailed(
                f"site {name!r}: jump host {login.jump.describe()} cannot reach "
                f"{login.where} ({exc}); check host and port, and that the jump host allows "
                "TCP forwarding.") from None
    client = _Client()
    client.jumps = jumps
    where = login.where
    conn = profile.connector
    timeout = float(min(conn.transfer.connect_timeout, CONNECT_TIMEOUT)
                    if isinstance(conn, SshConnector) else CONNECT_TIMEOUT)
    try:
        if known.is_file():
            try:
                client.load_host_keys(str(known))
            except OSError as exc:
                raise ConnectionFailed(
                    f"site {name!r}: cannot read known_hosts {known} ({exc}); fix the file."
                ) from None
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        pkey = _pkey(login)
        client.connect(
            login.host, port=login.port, username=login.user, pkey=pkey, sock=sock,
            look_for_keys=False, allow_agent=pkey is None, timeout=timeout,
            banner_timeout=timeout, auth_timeout=timeout,
        )
    except ConnectionFailed as exc:
        client.close()
        if exc.message.startswith("site "):
            raise
        raise ConnectionFailed(f"site {name!r}: {exc.message}") from None
    except paramiko.BadHostKeyException:
        client.close()
        raise ConnectionFailed(
            f"site {name!r}: host key of {where} changed (possible man-in-the-middle or "
            f"a reinstalled login node); verify it with the facility and update known_hosts "
            f"{known}."
        ) from None
    except paramiko.AuthenticationException as exc:
        client.close()
        raise ConnectionFailed(_auth_failed(name, profile, login, exc)) from None
    except paramiko.SSHException as exc:
        client.close()
        if "known_hosts" in str(exc):
            raise ConnectionFailed(
                f"site {name!r}: host {where} is not in known_hosts {known}; add it "
                "with ssh-keyscan after verifying the fingerprint with the facility."
            ) from None
        raise ConnectionFailed(f"site {name!r}: SSH to {where} failed: {exc}.") from None
    except TimeoutError:
        client.close()
        raise ConnectionFailed(
            f"site {name!r}: connecting to {where} timed out after "
            f"{timeout:.0f} s; check host, port and your network/VPN."
        ) from None
    except OSError as exc:
        client.close()
        raise ConnectionFailed(
            f"site {name!r}: cannot reach {where} ({exc}); check host and port."
        ) from None
    return client


def connect(profile: SiteProfile) -> paramiko.SSHClient:
    """Open an SSH connection to the profile's login node; every failure is ConnectionFailed.

    The login is the profile's with ~/.ssh/config applied (:mod:`.login`): identity file and
    its OpenSSH certificate, or the ssh-agent; jump hosts; host keys verified against
    known_hosts for every hop.
    """
    conn = profile.connector
    if not isinstance(conn, SshConnector):
        raise ConnectionFailed(f"site {profile.name!r} is local; there is nothing to connect to.")
    login = resolve(conn, f"site profile {profile.name}")
    return _open(profile.name, profile, login, known_hosts_path(conn))


def transfer_login(profile: SiteProfile) -> Login | None:
    """The login of the profile's ``transfer_host`` (a data transfer node), if it has one:
    the login node's user, key and jump hosts unless it names its own."""
    conn = profile.connector
    if not isinstance(conn, SshConnector) or conn.transfer_host is None:
        return None
    login, dtn = resolve(conn, f"site profile {profile.name}"), conn.transfer_host
    key = str(Path(dtn.key_file).expanduser()) if dtn.key_file else login.key_file
    return replace(login, host=dtn.host, port=dtn.port or 22, user=dtn.user or login.user,
                   key_file=key, certificate=login.certificate if key == login.key_file
                   else None, alias=None)


def connect_transfer_host(profile: SiteProfile) -> paramiko.SSHClient:
    """Open an SSH connection to the profile's transfer_host (see :func:`connect`)."""
    login = transfer_login(profile)
    if login is None:
        raise ConnectionFailed(f"site profile {profile.name!r} names no transfer_host.")
    assert isinstance(profile.connector, SshConnector)
    try:
        return _open(profile.name, profile, login, known_hosts_path(profile.connector))
    except ConnectionFailed as exc:
        raise ConnectionFailed(f"{exc.message.rstrip('.')} (connector.transfer_host of "
                               f"site_profiles/{profile.name}.yaml).") from None


MAX_OUTPUT = 1 << 20  # what xffl keeps of a login-node command's stdout, and of its stderr


def run(client: paramiko.SSHClient, command: str, timeout: float = 60.0) -> tuple[int, str, str]:
    """Run ``command`` on the login node; return (exit status, stdout, stderr).

    A facility's answer is not trusted: the whole command is bounded by ``timeout`` (124
    after it, however slowly the bytes come) and only the first :data:`MAX_OUTPUT` bytes of
    each stream are kept (the rest is read and dropped, so the command can finish).
    """
    deadline = time.monotonic() + timeout
    try:
        _, out, _ = client.exec_command(command, timeout=timeout)
        channel = out.channel
        kept: tuple[bytearray, bytearray] = (bytearray(), bytearray())
        while True:
            if time.monotonic() > deadline:  # also for a site that never stops printing
                channel.close()
                return 124, "", f"timed out after {timeout:.0f} s"
            if channel.recv_ready():
                _keep(kept[0], channel.recv(65536))
            elif channel.recv_stderr_ready():
                _keep(kept[1], channel.recv_stderr(65536))
            elif channel.exit_status_ready() and (channel.eof_received or channel.closed):
                break
            else:
                time.sleep(0.005)
        return (channel.recv_exit_status(), kept[0].decode(errors="replace"),
                kept[1].decode(errors="replace"))
    except TimeoutError:
        return 124, "", f"timed out after {timeout:.0f} s"
    except paramiko.SSHException as exc:
        return 255, "", str(exc)


def _keep(buffer: bytearray, data: bytes) -> None:
    """Add ``data`` to ``buffer`` up to :data:`MAX_OUTPUT` bytes."""
    buffer += data[:max(0, MAX_OUTPUT - len(buffer))]


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
