"""Credentials read from real OpenSSH certificates (ssh-keygen -s) and a real ssh-agent."""

from __future__ import annotations

import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.stack.certs import agent_add, ssh_agent
from xffl.jobs.credential_gate import blockers, round_needs
from xffl.jobs.spec.schema import JobSpec
from xffl.site_profiles.credentials import (
    agent_certificates,
    endpoint_credential,
    read_certificate,
    span,
    validity,
)
from xffl.site_profiles.login import Login
from xffl.site_profiles.schema import SiteProfile, slurm_time_seconds

T2030 = datetime(2030, 1, 1, tzinfo=UTC).timestamp()


def _keygen(*args: str) -> None:
    subprocess.run(["ssh-keygen", "-q", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    """A throwaway certificate authority key."""
    _keygen("-t", "ed25519", "-N", "", "-f", str(tmp_path / "ca"))
    return tmp_path / "ca"


def _signed(ca: Path, folder: Path, validity_: str, principals: str = "alice",
            name: str = "id", *extra: str) -> Path:
    key = folder / name
    if not key.exists():
        _keygen("-t", "ed25519", "-N", "", "-f", str(key))
    _keygen("-s", str(ca), "-I", f"id-{name}", "-n", principals, "-V", validity_, *extra,
            str(key) + ".pub")
    return key


def test_certificate_validity_and_principals_as_signed(ca: Path, tmp_path: Path) -> None:
    key = _signed(ca, tmp_path, "20300101000000Z:20300102003000Z", "alice,bob")
    cert = read_certificate(f"{key}-cert.pub")
    assert cert.valid_after == T2030 and cert.valid_before == T2030 + 86400 + 1800
    assert cert.principals == ("alice", "bob") and cert.key_id == "id-id"
    assert cert.allows("bob") and not cert.allows("carol")
    assert validity(cert, now=T2030 + 3600) == "valid until 2030-01-02 00:30 UTC (in 23h 30m)"
    assert validity(cert, now=T2030 + 86400 + 1860) == \
        "expired at 2030-01-02 00:30 UTC (1m ago)"
    assert validity(cert, now=T2030 - 120).startswith("not valid before 2030-01-01 00:00 UTC")


def test_forever_host_and_plain_key_files(ca: Path, tmp_path: Path) -> None:
    key = _signed(ca, tmp_path, "always:forever")
    forever = read_certificate(f"{key}-cert.pub")
    assert forever.valid_before is None and validity(forever) == "valid forever"
    host = _signed(ca, tmp_path, "always:forever", "login1", "host", "-h")
    with pytest.raises(ValueError, match="host certificate"):
        read_certificate(f"{host}-cert.pub")
    with pytest.raises(ValueError):
        read_certificate(f"{key}.pub")  # a public key, not a certificate


def _login(key: Path | None, user: str = "alice", cert: str | None = None) -> Login:
    return Login("127.0.0.1", 22, user, str(key) if key else None,
                 cert if cert is not None else (f"{key}-cert.pub" if key else None), None)


def test_endpoint_credential_kinds(ca: Path, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    key = _signed(ca, tmp_path, "20300101000000Z:20300102000000Z")
    cred = endpoint_credential(_login(key), now=T2030)
    assert cred.method == "certificate" and cred.expires == T2030 + 86400 and cred.problem is None
    wrong = endpoint_credential(_login(key, user="mallory"), now=T2030)
    assert wrong.problem is not None and "is for alice, not mallory" in wrong.problem
    plain = endpoint_credential(_login(key, cert=""), now=T2030)  # "" = no certificate file
    assert plain.method == "certificate" and plain.problem is not None  # "" does not exist
    nocert = endpoint_credential(Login("h", 22, "alice", str(key), None, None))
    assert nocert.method == "key" and nocert.expires is None and nocert.problem is None
    missing = endpoint_credential(_login(tmp_path / "nope"))
    assert missing.problem == f"identity file {tmp_path / 'nope'} does not exist"
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    agentless = endpoint_credential(_login(None))
    assert agentless.method == "ssh-agent" and "SSH_AUTH_SOCK" in (agentless.problem or "")


def test_agent_certificates_from_a_real_agent(ca: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    plain = tmp_path / "plain"
    _keygen("-t", "ed25519", "-N", "", "-f", str(plain))
    old = _signed(ca, tmp_path, "20300101000000Z:20300101120000Z", "alice", "old")
    new = _signed(ca, tmp_path, "20300101000000Z:20300102000000Z", "alice", "new")
    other = _signed(ca, tmp_path, "20300101000000Z:20300103000000Z", "bob", "other")
    with ssh_agent(tmp_path / "agent") as sock:
        monkeypatch.setenv("SSH_AUTH_SOCK", sock)
        empty = endpoint_credential(_login(None))
        assert empty.problem is not None and "holds no key" in empty.problem
        for key in (plain, old, new, other):
            agent_add(sock, key)  # ssh-add adds KEY-cert.pub beside each key
        certs, n_plain, problem = agent_certificates()
        assert problem is None and n_plain == 4  # the four keys themselves
        assert sorted(c.valid_before or 0 for c in certs) == \
            [T2030 + 43200, T2030 + 86400, T2030 + 2 * 86400]
        # alice's login uses her certificate that lasts longest; bob's cert is not hers
        cred = endpoint_credential(_login(None), now=T2030 + 60)
        assert cred.method == "ssh-agent certificate" and cred.expires == T2030 + 86400
        assert endpoint_credential(_login(None, user="carol")).method == "ssh-agent"


def _profile(key: Path, time: str = "01:00:00") -> SiteProfile:
    return SiteProfile.model_validate({
        "name": "p", "connector": {"type": "ssh", "host": "127.0.0.1", "port": 2222,
                                   "user": "alice", "key_file": str(key), "ssh_config": False,
                                   "renew": "step ssh certificate me@x.eu ~/.ssh/leo"},
        "slurm": {"partition": "debug", "time": time}})


def _spec(**failure: object) -> JobSpec:
    return JobSpec.model_validate({"name": "j", "rounds": 1, "failure": failure,
                                   "sites": [{"name": "leo", "profile": "p", "data": {"path": "d"}},
                                             {"name": "home", "profile": "local",
                                              "data": {"path": "d"}}]})


def test_blockers_against_the_round_time_limit(ca: Path, tmp_path: Path) -> None:
    key = _signed(ca, tmp_path, "20300101000000Z:20300101120000Z")  # 12 h, as at CINECA
    end = T2030 + 43200
    profiles = {"leo": _profile(key), "home": SiteProfile(name="local")}
    assert blockers(_spec(), profiles, now=end - 3601) == []  # 1 h job fits
    (late,) = blockers(_spec(), profiles, now=end - 3599)
    assert late.site == "leo" and late.expires == end
    assert "expires at 2030-01-01 12:00 UTC (in 59m)" in late.reason
    assert "before a round's time limit of 1h 00m (the SLURM time limit 01:00:00)" in late.reason
    assert late.sentence("run `xffl resume R` again") == (
        f"site leo: the SSH certificate {key}-cert.pub {late.reason.split('.pub ', 1)[1]}; "
        "renew it with `step ssh certificate me@x.eu ~/.ssh/leo`, then run `xffl resume R` "
        "again.")
    # failure.round_timeout bounds the round instead of the SLURM time limit
    assert blockers(_spec(round_timeout=600), profiles, now=end - 601) == []
    (short,) = blockers(_spec(round_timeout=600), profiles, now=end - 599)
    assert "10m (failure.round_timeout)" in short.reason
    (gone,) = blockers(_spec(), profiles, now=end + 7200)
    assert "expired at 2030-01-01 12:00 UTC (2h 00m ago)" in gone.reason
    (early,) = blockers(_spec(), profiles, now=T2030 - 60)
    assert "not valid before" in early.reason


@pytest.mark.parametrize(("text", "seconds"), [
    ("30", 1800), ("30:15", 1815), ("01:00:00", 3600), ("2-0", 172800), ("1-02:03", 93780),
    ("1-02:03:04", 93784), ("UNLIMITED", None), ("infinite", None),
])
def test_slurm_time_forms(text: str, seconds: int | None) -> None:
    assert slurm_time_seconds(text) == seconds


@pytest.mark.parametrize("text", ["1h", "1:2:3:4", "a-01:00", "", "-5"])
def test_slurm_time_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="not a SLURM time limit"):
        slurm_time_seconds(text)


def test_round_needs_and_span() -> None:
    profile = SiteProfile.model_validate({"name": "p", "slurm": {"time": "2-00:00:00"}})
    assert round_needs(_spec(), profile) == (172800, "the SLURM time limit 2-00:00:00")
    assert round_needs(_spec(round_timeout=90), profile) == (90, "failure.round_timeout")
    assert round_needs(_spec(), SiteProfile(name="local")) == (None, "no time limit")
    assert [span(s) for s in (5, 59, 61, 3600, 3661, 90000)] == \
        ["1m", "1m", "1m", "1h 00m", "1h 01m", "1d 1h"]
