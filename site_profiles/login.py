"""One explicit SSH login per site: the profile's connector with ~/.ssh/config applied.

xffl's own connections (paramiko) and StreamFlow's (asyncssh) are both given the resolved
host, port, user, key, certificate and jump hosts, so that the two always log in the same way
and ``xffl render`` shows exactly what StreamFlow will use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import paramiko

from xffl.core.errors import InvalidInput
from xffl.site_profiles.schema import JumpHost, SshConnector, parse_destination

MAX_JUMPS = 4


@dataclass(frozen=True)
class Login:
    """How to reach one SSH endpoint (a login node or a jump host)."""

    host: str
    port: int
    user: str | None
    key_file: str | None  # absolute path; None = the ssh-agent
    certificate: str | None  # absolute path of key_file's OpenSSH certificate, if any
    jump: Login | None
    alias: str | None = None  # the ~/.ssh/config Host it came from

    @property
    def where(self) -> str:
        """``host:port``."""
        return f"{self.host}:{self.port}"

    def describe(self) -> str:
        """``user@host:port`` plus the jump chain, for messages."""
        text = f"{self.user + '@' if self.user else ''}{self.where}"
        if self.alias:
            text += f" (Host {self.alias} of ~/.ssh/config)"
        return text + (f" via {self.jump.describe()}" if self.jump else "")

    def chain(self) -> list[Login]:
        """The jump hosts first, this login last."""
        return [*(self.jump.chain() if self.jump else []), self]


def ssh_config_path() -> Path:
    """The user's OpenSSH client configuration file."""
    return Path("~/.ssh/config").expanduser()


def _config(use: bool) -> paramiko.SSHConfig | None:
    path = ssh_config_path()
    if not use or not path.is_file():
        return None
    try:
        return paramiko.SSHConfig.from_path(str(path))
    except (OSError, ValueError, paramiko.ConfigParseError) as exc:
        raise InvalidInput(f"{path}: cannot parse it ({exc}); fix the file, or set "
                           "ssh_config: false in the site profile.") from None


def _expand(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def default_certificate(key_file: str | None) -> str | None:
    """``KEY-cert.pub`` when it exists: where ssh (and asyncssh) look for a key's certificate."""
    if key_file is None:
        return None
    cert = f"{key_file}-cert.pub"
    return cert if os.path.exists(cert) else None


def _endpoint(host: str, port: int | None, user: str | None, key_file: str | None,
              certificate: str | None, config: paramiko.SSHConfig | None, depth: int,
              where: str) -> Login:
    """A Login for ``host`` with ``config``'s entries filling what the caller left out."""
    found: dict[str, Any] = config.lookup(host) if config is not None else {}
    real = str(found.get("hostname", host))
    if "proxycommand" in found and "proxyjump" not in found:
        raise InvalidInput(f"{where}: ~/.ssh/config gives Host {host} a ProxyCommand, which "
                           "xffl cannot hand to StreamFlow; use ProxyJump there or the "
                           "profile's jump field.")
    if key_file is None and found.get("identityfile"):
        key_file = _expand(str(found["identityfile"][0]))
    cert_cfg = found.get("certificatefile")
    if certificate is None and cert_cfg:
        certificate = _expand(str(cert_cfg[0] if isinstance(cert_cfg, list) else cert_cfg))
    jump = None
    proxy = str(found.get("proxyjump", "none"))
    if proxy.lower() != "none":
        jump = _chain(proxy.split(","), config, depth + 1, where)
    return Login(
        host=real, port=int(port or found.get("port", 22)), user=user or found.get("user"),
        key_file=key_file, certificate=certificate or default_certificate(key_file),
        jump=jump, alias=host if real != host else None,
    )


def _chain(hops: list[str], config: paramiko.SSHConfig | None, depth: int,
           where: str) -> Login:
    """ProxyJump's ``a,b``: reach a, then b through a; return b's Login."""
    if depth + len(hops) > MAX_JUMPS:
        raise InvalidInput(f"{where}: more than {MAX_JUMPS} jump hosts (a ProxyJump loop in "
                           "~/.ssh/config?); shorten the chain.")
    prev: Login | None = None
    for hop in hops:
        try:
            dest = parse_destination(hop.strip())
        except ValueError as exc:
            raise InvalidInput(f"{where}: ProxyJump {hop!r}: {exc}; fix ~/.ssh/config.") from None
        login = _endpoint(dest["host"], dest.get("port"), dest.get("user"), None, None,
                          config, depth, where)
        if prev is not None:
            login = replace(login, jump=prev)
        prev = login
    assert prev is not None
    return prev


def _jump(jump: JumpHost, config: paramiko.SSHConfig | None, where: str) -> Login:
    return _endpoint(jump.host, jump.port, jump.user, _expand(jump.key_file), None, config, 1,
                     where)


def resolve(conn: SshConnector, where: str = "site profile") -> Login:
    """The login of ``conn``: profile values first, then ~/.ssh/config, then ssh's defaults.

    ``where`` names the profile in error messages. A profile's ``jump`` replaces a
    ProxyJump of the config.
    """
    config = _config(conn.ssh_config)
    login = _endpoint(conn.host, conn.port, conn.user, _expand(conn.key_file),
                      _expand(conn.certificate), config, 0, where)
    if conn.jump is not None:
        login = replace(login, jump=_jump(conn.jump, config, where))
    return login


def known_hosts_path(conn: SshConnector) -> Path:
    """The known_hosts file xffl's own connections verify host keys against."""
    return Path(conn.known_hosts or "~/.ssh/known_hosts").expanduser()
