"""`xffl profiles` and `xffl submit`'s preflight, through a local Typer app, on the real stack."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from tests.cli.schemas import check
from tests.conftest import QUICKSTART
from tests.site_profiles.test_remote import (
    other_host_known_hosts,
    write_profile,
    wrong_known_hosts,
)
from xffl.cli import profiles
from xffl.cli.submit import submit
from xffl.core.versions import FORMAT_VERSION, xffl_version

app = typer.Typer()
app.add_typer(profiles.app, name="profiles")
app.command("submit")(submit)
runner = CliRunner()


def test_list_json() -> None:
    result = runner.invoke(app, ["profiles", "list", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert {"local", "leonardo", "karolina", "lumi"} <= set(rows)
    assert rows["leonardo"]["host"] == "login.leonardo.cineca.it:22"
    assert rows["leonardo"]["partition"] == "boost_usr_prod"
    assert rows["local"]["connector"] == "local"
    plain = runner.invoke(app, ["profiles", "list"])
    assert plain.exit_code == 0 and "karolina" in plain.stdout


def test_show() -> None:
    result = runner.invoke(app, ["profiles", "show", "leonardo"])
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.stdout)["connector"]
    assert shown["host"] == "login.leonardo.cineca.it" and "cineca-hpc" in shown["renew"]
    from xffl.site_profiles.lookup import bundled_dir

    template = bundled_dir() / "leonardo.yaml"  # as written: the renewal steps' comments too
    assert result.stdout == f"# {template}\n{template.read_text()}"
    assert "# or put it in your ssh-agent with `step ssh login" in result.stdout
    as_json = runner.invoke(app, ["profiles", "show", "lumi", "--json"])
    assert json.loads(as_json.stdout)["slurm"]["partition"] == "standard-g"
    missing = runner.invoke(app, ["profiles", "show", "leonard"])
    assert missing.exit_code == 2 and "leonardo" in missing.output


def test_check_local() -> None:
    result = runner.invoke(app, ["profiles", "check", "local", "--json"])
    assert result.exit_code == 0, result.output
    data = check("profiles-check", json.loads(result.stdout))
    assert data["ok"] is True
    # the site's answer, structured: this Python's xffl and format
    assert (data["versions"]["xffl"], data["versions"]["format"]) == (xffl_version(),
                                                                     FORMAT_VERSION)


@pytest.mark.slow
def test_check_alpha(tmp_path: Path, slurm_stack,  # type: ignore[no-untyped-def]
                     monkeypatch: pytest.MonkeyPatch) -> None:
    write_profile(tmp_path / "site_profiles", slurm_stack)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["profiles", "check", "test-alpha"])
    assert result.exit_code == 0, result.output
    assert "NO" not in result.stdout
    as_json = runner.invoke(app, ["profiles", "check", "test-alpha", "--json"])
    data = json.loads(as_json.stdout)
    assert data["ok"] and [c["check"] for c in data["checks"]] == [
        "login", "connect", "slurm commands", "partition", "workdir writable", "workdir private",
        "xffl importable", "versions", "exchange format", "gpus"]
    assert data["checks"][0]["detail"] == \
        f"{slurm_stack.user}@127.0.0.1:{slurm_stack.clusters['alpha'].ssh_port} with key "\
        f"{slurm_stack.ssh_key}"
    assert data["credential"]["endpoints"][0]["method"] == "key"


@pytest.mark.slow
def test_check_partition_missing(tmp_path: Path, slurm_stack,  # type: ignore[no-untyped-def]
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_profile(tmp_path / "site_profiles", slurm_stack)
    doc = yaml.safe_load(path.read_text())
    doc["slurm"]["partition"] = "nosuchpartition"
    path.write_text(yaml.safe_dump(doc))
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["profiles", "check", "test-alpha", "--json"])
    assert result.exit_code == 1, result.output
    failed = [c["check"] for c in json.loads(result.stdout)["checks"] if not c["ok"]]
    assert failed == ["partition"]


@pytest.mark.slow
def test_changed_host_key_exit_3(tmp_path: Path, slurm_stack,  # type: ignore[no-untyped-def]
                                 monkeypatch: pytest.MonkeyPatch, xffl_home: Path) -> None:
    kh = wrong_known_hosts(tmp_path / "kh", slurm_stack.clusters["alpha"].ssh_port)
    write_profile(tmp_path / "site_profiles", slurm_stack, known_hosts=kh)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["profiles", "check", "test-alpha"])
    assert result.exit_code == 3, result.output
    assert "host key" in result.output

    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["sites"] = spec["sites"][:1]
    spec["sites"][0]["profile"] = "test-alpha"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = runner.invoke(app, ["submit", str(job)])
    assert result.exit_code == 3, result.output
    assert "host key" in result.output
    runs = xffl_home / "runs"
    assert not runs.exists() or not any(runs.iterdir())


@pytest.mark.slow
def test_unknown_host_exit_3(tmp_path: Path, slurm_stack,  # type: ignore[no-untyped-def]
                             monkeypatch: pytest.MonkeyPatch) -> None:
    kh = other_host_known_hosts(tmp_path / "kh")
    write_profile(tmp_path / "site_profiles", slurm_stack, known_hosts=kh)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["profiles", "check", "test-alpha"])
    assert result.exit_code == 3, result.output
    assert "known_hosts" in result.output


def test_a_template_left_unfilled_is_refused_where_it_is(tmp_path: Path,
                                                         xffl_home: Path) -> None:
    """A job on the bundled leonardo template: validate names each YOUR_ line and the fix;
    `profiles init` copies the template (comments kept) and validate then points at the copy."""
    from xffl.cli.validate import validate
    from xffl.site_profiles.lookup import bundled_dir, installed_dirs

    full = typer.Typer()
    full.add_typer(profiles.app, name="profiles")
    full.command("validate")(validate)
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["sites"][0]["profile"] = "leonardo"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))

    def errors() -> list[str]:
        result = runner.invoke(full, ["validate", str(job)])
        assert result.exit_code == 2, result.output
        return [line.split(": job spec field sites[0].profile: ", 1)[1]
                for line in result.stderr.splitlines() if "site profile field" in line]

    template = bundled_dir() / "leonardo.yaml"
    fields = {"user": 21, "renew": 26, "account": 29, "python": 44, "workdir": 45}
    assert errors() == [f"{template}:{n}: site profile field {k}: still the template's YOUR_... "
                        "placeholder; copy the template with `xffl profiles init leonardo` and "
                        "fill it in there." for k, n in fields.items()]
    made = runner.invoke(full, ["profiles", "init", "leonardo"])
    assert made.exit_code == 0, made.output
    copy = installed_dirs()[0] / "leonardo.yaml"
    assert copy.read_text() == template.read_text()  # the renewal steps' comments included
    assert (copy.stat().st_mode & 0o777) == 0o600
    assert runner.invoke(full, ["profiles", "init", "leonardo"]).exit_code == 2  # no overwrite
    assert [e.split(":", 2)[:2] for e in errors()] == [[str(copy), str(n)]
                                                       for n in fields.values()]
    assert all(e.endswith("still the template's YOUR_... placeholder; fill it in.")
               for e in errors())
    filled = copy.read_text().replace("YOUR_USERNAME", "ada").replace("YOUR_ACCOUNT", "p_1") \
        .replace("YOUR_EMAIL", "ada@example.org").replace("YOUR_VENV", "venv") \
        .replace("YOUR_SCRATCH", "scratch")
    copy.write_text(filled)
    from xffl.jobs.spec.load import load_job

    assert load_job(job).profiles["alpha"].connector.user == "ada"  # filled in: it loads


def test_sites_is_the_hidden_old_name_of_profiles() -> None:
    """Scripts written for `xffl sites ...` keep working; the help shows `profiles` only."""
    from xffl.cli.app import app as full

    new = runner.invoke(full, ["profiles", "list", "--json"])
    old = runner.invoke(full, ["sites", "list", "--json"])
    assert new.exit_code == old.exit_code == 0, old.output
    assert json.loads(old.stdout) == json.loads(new.stdout)
    assert "deprecated" in old.stderr.lower()
    commands = [line.split()[0] for line in
                runner.invoke(full, ["--help"], env={"COLUMNS": "200"}).stdout.splitlines()
                if line.startswith("  ") and line.strip()]
    assert "profiles" in commands and "sites" not in commands


def test_an_unknown_profile_names_where_to_write_it(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal names two places xffl searches, as absolute paths (HEAD named a relative
    `site_profiles/NAME.yaml`, which from another folder is neither); a profile written at
    the first is then found (issue 31 item 12)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    result = runner.invoke(app, ["profiles", "check", "mysite"])
    assert result.exit_code == 2
    here = tmp_path / "site_profiles" / "mysite.yaml"
    mine = tmp_path / "config" / "xffl" / "site_profiles" / "mysite.yaml"
    assert f"(or write {here}, or {mine} for every job)" in " ".join(result.stderr.split())
    here.parent.mkdir()
    here.write_text(yaml.safe_dump({"name": "mysite", "connector": {"type": "local"}}))
    shown = runner.invoke(app, ["profiles", "show", "mysite", "--json"])
    assert shown.exit_code == 0, shown.output


@pytest.mark.parametrize("case", ["profile_transfer_streams_zero",
                                  "profile_transfer_streams_absurd"])
def test_check_refuses_absurd_transfer_streams(case: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`profiles check` reads the profile first: transfer.streams 0 or 1000 is one line, exit 2
    (before any connection; `validate` and `submit` are the bad-input corpus's)."""
    corpus = Path(__file__).resolve().parent / "bad_inputs" / case
    (tmp_path / "site_profiles").mkdir()
    profile = tmp_path / "site_profiles" / "mine.yaml"
    profile.write_text((corpus / "site_profiles" / "mine.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["profiles", "check", "mine"])
    assert result.exit_code == 2, result.output
    (line,) = [x for x in result.stderr.splitlines() if x.strip()]
    expect = yaml.safe_load((corpus / "expect.yaml").read_text())
    assert str(profile.resolve()) in line and f"field {expect['field']}: " in line, line
