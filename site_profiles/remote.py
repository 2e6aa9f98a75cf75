"""xffl's own SSH connections to a site's login node, with host keys always verified."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import paramiko

from xffl.core.errors import ConnectionFailed
from xffl.site_profiles.credentials import renew_advice, site_credential
from xffl.site_profiles.login import Login, known_hosts_path, resolve
from xffl.site_profiles.schema import SiteProfile, SshConnector

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
