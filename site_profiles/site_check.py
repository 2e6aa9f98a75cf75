"""What `xffl profiles check` found at a site: a row per check, and the checks it never reached."""

from __future__ import annotations

from dataclasses import dataclass, field

from xffl.site_profiles.credentials import SiteCredential
from xffl.site_profiles.schema import SiteProfile, SshConnector
from xffl.site_profiles.versions import SiteVersions


@dataclass
class SiteCheck:
    """The outcome of ``check_site``: one row (check, ok, detail) per check."""

    site: str
    rows: list[tuple[str, bool, str]] = field(default_factory=list)
    connected: bool = True
    credential: SiteCredential | None = None
    not_checked: list[str] = field(default_factory=list)  # checks the failure left unreached
    versions: SiteVersions | None = None  # what the site's Python answered the probe

    @property
    def ok(self) -> bool:
        """Whether the site connected and every check run passed."""
        return self.connected and all(ok for _, ok, _ in self.rows)

    def add(self, check: str, ok: bool, detail: str) -> None:
        """Record one check's outcome."""
        self.rows.append((check, ok, detail))

    def unreached(self, profile: SiteProfile) -> None:
        """Name every check of an SSH site that its rows so far do not hold (not run)."""
        done = {c for c, _, _ in self.rows}
        self.not_checked = [c for c in ssh_checks(profile) if c not in done]

    def as_dict(self) -> dict[str, object]:
        """The ``--json`` form (docs/json/profiles-check.schema.json)."""
        return {"site": self.site, "ok": self.ok, "connected": self.connected,
                "checks": [{"check": c, "ok": o, "detail": d} for c, o, d in self.rows],
                "not_checked": list(self.not_checked),
                "credential": self.credential.as_dict() if self.credential else None,
                "versions": self.versions.model_dump() if self.versions else None}


def ssh_checks(profile: SiteProfile) -> list[str]:
    """The checks of an SSH site, in the order check_site runs them."""
    partition = profile.slurm.partition if profile.slurm else None
    return ["login", "connect", "slurm commands", *(["partition"] if partition else []),
            "workdir writable", "workdir private", "xffl importable", "versions",
            "exchange format", "gpus", *(["container image"] if profile.container else []),
            *(["transfer host"] if isinstance(profile.connector, SshConnector)
              and profile.connector.transfer_host is not None else [])]


def missing_certificate(cred: SiteCredential, renew: str | None) -> str | None:
    """What is wrong when a profile that renews a certificate (``renew``: its facility logs in
    with certificates, as 2FA sites do) logs in with a key that has none; else None."""
    last = cred.endpoints[-1] if cred.endpoints else None
    if renew is None or last is None or last.certificate is not None:
        return None
    what = (f"{last.detail}-cert.pub does not exist" if last.method == "key"
            else f"{last.method} {last.detail} holds no certificate")
    return (f"{last.endpoint}: no certificate ({what}); this facility logs in with a "
            f"certificate: get one with `{renew}`")
