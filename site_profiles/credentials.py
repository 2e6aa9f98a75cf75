"""What a site's SSH login rests on, and until when: key, OpenSSH certificate or ssh-agent.

Facilities with two-factor login (CINECA Leonardo) hand out OpenSSH certificates valid for
about 12 hours. Everything here is read locally, with no connection: the certificate file
next to the key, or the certificates the ssh-agent holds, so that a cron tick can tell that
the next round would fail before it submits anything.
"""

from __future__ import annotations

import base64
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

import paramiko
from cryptography.hazmat.primitives.serialization import (
    SSHCertificate,
    SSHCertificateType,
    load_ssh_public_identity,
)

from xffl.site_profiles.login import Login

FOREVER = 2**64 - 1
CERT_SUFFIX = "-cert-v01@openssh.com"


@dataclass(frozen=True)
class Certificate:
    """The parts of an OpenSSH user certificate that decide whether a login can work."""

    source: str  # file path, or "ssh-agent"
    key_id: str
    principals: tuple[str, ...]  # empty: any user
    valid_after: float
    valid_before: float | None  # None: forever

    def allows(self, user: str | None) -> bool:
        """Whether the certificate names ``user`` (or names nobody, which allows anyone)."""
        return not self.principals or user is None or user in self.principals


def _from_identity(cert: SSHCertificate, source: str) -> Certificate:
    before = cert.valid_before
    return Certificate(
        source=source, key_id=cert.key_id.decode(errors="replace"),
        principals=tuple(p.decode(errors="replace") for p in cert.valid_principals),
        valid_after=float(cert.valid_after),
        valid_before=None if before >= FOREVER else float(before),
    )


def read_certificate(path: str) -> Certificate:
    """Parse an OpenSSH certificate file (``KEY-cert.pub``); ValueError if it is not one."""
    with open(path, "rb") as fh:
        identity = load_ssh_public_identity(fh.read().strip())
    if not isinstance(identity, SSHCertificate):
        raise ValueError(f"{path} holds a public key, not an OpenSSH certificate")
    if identity.type != SSHCertificateType.USER:
        raise ValueError(f"{path} is a host certificate, not a user certificate")
    return _from_identity(identity, path)


def agent_certificates() -> tuple[list[Certificate], int, str | None]:
    """(certificates, number of plain keys, problem) held by the agent at $SSH_AUTH_SOCK."""
    if not os.environ.get("SSH_AUTH_SOCK"):
        return [], 0, "no ssh-agent (SSH_AUTH_SOCK is not set)"
    try:
        agent = paramiko.Agent()
        keys = list(agent.get_keys())
        agent.close()
    except (paramiko.SSHException, OSError) as exc:
        return [], 0, f"cannot talk to the ssh-agent at {os.environ['SSH_AUTH_SOCK']} ({exc})"
    certs: list[Certificate] = []
    plain = 0
    for key in keys:
        name = key.get_name()
        if not name.endswith(CERT_SUFFIX):
            plain += 1
            continue
        text = f"{name} {base64.b64encode(key.asbytes()).decode()}".encode()
        try:
            identity = load_ssh_public_identity(text)
        except (ValueError, TypeError):  # an algorithm cryptography cannot read
            continue
        if isinstance(identity, SSHCertificate) and identity.type == SSHCertificateType.USER:
            certs.append(_from_identity(identity, "ssh-agent"))
    return certs, plain, None


@dataclass
class Credential:
    """How one endpoint logs in, and until when that works."""

    endpoint: str  # user@host:port
    method: str  # "certificate", "key", "ssh-agent", "ssh-agent certificate"
    detail: str
    certificate: Certificate | None = None
    problem: str | None = None  # set when the login cannot work at all (missing file, ...)

    @property
    def expires(self) -> float | None:
        """When the login stops working (epoch seconds); None: it does not expire."""
        return self.certificate.valid_before if self.certificate else None

    def seconds_left(self, now: float | None = None) -> float | None:
        """Seconds until expiry (negative once expired); None: it does not expire."""
        return None if self.expires is None else self.expires - (now or time.time())


def _pick(certs: list[Certificate], user: str | None, now: float) -> Certificate | None:
    """The certificate a login would use: for ``user``, valid now, expiring last."""
    mine = [c for c in certs if c.allows(user)]
    valid = [c for c in mine if c.valid_after <= now]
    pool = valid or mine
    if not pool:
        return None
    return max(pool, key=lambda c: c.valid_before if c.valid_before is not None else float("inf"))


def endpoint_credential(login: Login, now: float | None = None) -> Credential:
    """The credential ``login`` uses (its jump hosts are separate endpoints)."""
    now = now or time.time()
    who = f"{login.user + '@' if login.user else ''}{login.where}"
    if login.key_file is not None:
        if not os.path.isfile(login.key_file):
            return Credential(who, "key", login.key_file,
                              problem=f"identity file {login.key_file} does not exist")
        if login.certificate is None:
            return Credential(who, "key", login.key_file)
        try:
            cert = read_certificate(login.certificate)
        except FileNotFoundError:
            return Credential(who, "certificate", login.certificate,
                              problem=f"certificate {login.certificate} does not exist")
        except (OSError, ValueError) as exc:
            return Credential(who, "certificate", login.certificate,
                              problem=f"cannot read certificate {login.certificate} ({exc})")
        if not cert.allows(login.user):
            return Credential(who, "certificate", login.certificate, cert,
                              problem=f"certificate {login.certificate} is for "
                              f"{', '.join(cert.principals)}, not {login.user}")
        return Credential(who, "certificate", login.certificate, cert)
    certs, plain, problem = agent_certificates()
    if problem is not None:
        return Credential(who, "ssh-agent", "no key_file in the profile", problem=problem)
    chosen = _pick(certs, login.user, now)
    sock = os.environ.get("SSH_AUTH_SOCK", "")
    if chosen is not None:
        return Credential(who, "ssh-agent certificate", sock, chosen)
    if plain == 0:
        return Credential(who, "ssh-agent", sock, problem=f"the ssh-agent at {sock} holds no "
                          f"key{' for ' + login.user if login.user and certs else ''}")
    return Credential(who, "ssh-agent", f"{sock} ({plain} key{'s' * (plain != 1)})")


@dataclass
class SiteCredential:
    """Every endpoint of a site's login chain (jump hosts first, login node last)."""

    site: str
    endpoints: list[Credential] = field(default_factory=list)
    renew: str | None = None  # the profile's command that renews the credential

    @property
    def problem(self) -> str | None:
        """The first endpoint that cannot log in at all, as a sentence fragment."""
        for cred in self.endpoints:
            if cred.problem:
                return f"{cred.endpoint}: {cred.problem}"
        return None

    @property
    def limiting(self) -> Credential | None:
        """The endpoint whose credential expires first (None if none expires)."""
        expiring = [c for c in self.endpoints if c.expires is not None]
        return min(expiring, key=lambda c: c.expires or 0.0) if expiring else None

    @property
    def expires(self) -> float | None:
        """When the first credential of the chain expires."""
        limiting = self.limiting
        return limiting.expires if limiting else None

    def describe(self, now: float | None = None) -> str:
        """``certificate /k-cert.pub, valid until 2026-11-23 19:00 UTC (in 11h 58m)``."""
        parts = []
        for cred in self.endpoints:
            text = f"{cred.method} {cred.detail}"
            if cred.certificate is not None:
                text += f", {validity(cred.certificate, now)}"
            if cred.problem:
                text += f" — {cred.problem}"
            parts.append(text if len(self.endpoints) == 1 else f"{cred.endpoint}: {text}")
        return "; ".join(parts)

    def as_dict(self, now: float | None = None) -> dict[str, object]:
        """JSON form for ``--json`` outputs."""
        now = now or time.time()
        return {
            "site": self.site, "renew": self.renew, "problem": self.problem,
            "expires": iso(self.expires) if self.expires is not None else None,
            "seconds_left": None if self.expires is None else round(self.expires - now),
            "endpoints": [{
                "endpoint": c.endpoint, "method": c.method, "detail": c.detail,
                "problem": c.problem,
                "expires": iso(c.expires) if c.expires is not None else None,
                "key_id": c.certificate.key_id if c.certificate else None,
                "principals": list(c.certificate.principals) if c.certificate else None,
            } for c in self.endpoints],
        }


def site_credential(site: str, login: Login, renew: str | None = None,
                    now: float | None = None) -> SiteCredential:
    """The credentials of ``login``'s whole chain."""
    return SiteCredential(site, [endpoint_credential(hop, now) for hop in login.chain()], renew)


def renew_advice(renew: str | None) -> str:
    """``renew it with `CMD``` (the profile's ``renew``), or what to do without one."""
    if renew:
        return f"renew it with `{renew}`"
    return ("renew it (your facility's login that issues certificates, e.g. `step ssh "
            "login`) or fix the profile's key_file")


def iso(ts: float) -> str:
    """``2026-11-23 19:00 UTC``."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")


def span(seconds: float) -> str:
    """``11h 58m``, ``4m``, ``2d 3h``."""
    seconds = abs(int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes = max(1, rest // 60) if not (days or hours) else rest // 60
    if days:
        return f"{days}d {hours}h"
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m"


def validity(cert: Certificate, now: float | None = None) -> str:
    """``valid until X (in 3h 02m)`` / ``expired at X (40m ago)`` / ``valid from X``."""
    now = now or time.time()
    if cert.valid_after > now:
        return f"not valid before {iso(cert.valid_after)} (in {span(cert.valid_after - now)})"
    if cert.valid_before is None:
        return "valid forever"
    if cert.valid_before <= now:
        return f"expired at {iso(cert.valid_before)} ({span(now - cert.valid_before)} ago)"
    return f"valid until {iso(cert.valid_before)} (in {span(cert.valid_before - now)})"
