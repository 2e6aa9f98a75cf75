"""Refuse to start a round at a site whose SSH credential will not outlast the round.

A round needs its sites' logins from the submission of their SLURM jobs until the updates
are gathered back: ``failure.round_timeout`` when the job sets one, else the site's SLURM
time limit (queue wait not included: it cannot be known in advance). A certificate that
expires before then, or a login that cannot work at all (missing key or certificate file,
no agent), blocks the round before anything is submitted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from xffl.core.errors import ConnectionFailed
from xffl.jobs.spec.schema import JobSpec
from xffl.site_profiles.credentials import (
    SiteCredential,
    iso,
    renew_advice,
    site_credential,
    span,
)
from xffl.site_profiles.login import resolve
from xffl.site_profiles.schema import SiteProfile, SshConnector, slurm_time_seconds


class CredentialExpired(ConnectionFailed):
    """A site's login credential has expired or will before the round ends: exit 3."""


@dataclass(frozen=True)
class Blocker:
    """Why a round cannot start at one site, as one sentence without the closing advice."""

    site: str
    reason: str
    expires: float | None
    renew: str | None

    def sentence(self, then: str) -> str:
        """The reason, what renews the credential and ``then`` (what to run afterwards)."""
        return f"site {self.site}: {self.reason}; {renew_advice(self.renew)}, then {then}."


def round_needs(spec: JobSpec, profile: SiteProfile) -> tuple[float | None, str]:
    """How long (seconds) a round holds the site's login, and where that number comes from."""
    if spec.failure.round_timeout is not None:
        return spec.failure.round_timeout, "failure.round_timeout"
    if profile.slurm is not None:
        return slurm_time_seconds(profile.slurm.time), f"the SLURM time limit {profile.slurm.time}"
    return None, "no time limit"


def site_credentials(profiles: dict[str, SiteProfile],
                     now: float | None = None) -> dict[str, SiteCredential]:
    """The credentials of every SSH site, by site name."""
    out = {}
    for site, profile in profiles.items():
        conn = profile.connector
        if isinstance(conn, SshConnector):
            login = resolve(conn, f"site profile {profile.name}")
            out[site] = site_credential(site, login, conn.renew, now)
    return out


def blockers(spec: JobSpec, profiles: dict[str, SiteProfile],
             now: float | None = None) -> list[Blocker]:
    """Every site whose login will not last through a round started ``now``."""
    now = now or time.time()
    found = []
    for site, cred in site_credentials(profiles, now).items():
        if cred.problem is not None:
            found.append(Blocker(site, cred.problem, None, cred.renew))
            continue
        limiting = cred.limiting
        if limiting is None or limiting.certificate is None:
            continue
        cert = limiting.certificate
        what = ("the SSH certificate " + cert.source if cert.source != "ssh-agent"
                else "the ssh-agent's SSH certificate") + (
            f" of {limiting.endpoint}" if len(cred.endpoints) > 1 else "")
        if cert.valid_after > now:
            found.append(Blocker(site, f"{what} is not valid before {iso(cert.valid_after)}",
                                 cert.valid_before, cred.renew))
            continue
        assert cert.valid_before is not None
        if cert.valid_before <= now:
            found.append(Blocker(site, f"{what} expired at {iso(cert.valid_before)} "
                                 f"({span(now - cert.valid_before)} ago)", cert.valid_before,
                                 cred.renew))
            continue
        needs, source = round_needs(spec, profiles[site])
        if needs is not None and cert.valid_before < now + needs:
            found.append(Blocker(
                site, f"{what} expires at {iso(cert.valid_before)} (in "
                f"{span(cert.valid_before - now)}), before a round's time limit of "
                f"{span(needs)} ({source}) ends", cert.valid_before, cred.renew))
    return found


def require_credentials(spec: JobSpec, profiles: dict[str, SiteProfile], then: str) -> None:
    """Raise CredentialExpired (exit 3) naming every blocked site; ``then`` ends the advice."""
    found = blockers(spec, profiles)
    if found:
        lines = [b.sentence(then) for b in found]
        raise CredentialExpired(lines[0], lines=lines)
