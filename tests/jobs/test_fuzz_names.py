"""Property-based fuzzing of the names and paths a job spec and a site profile carry.

Whatever text a user writes, ``load_job`` either accepts it, and then it is a plain name or
path that the rendered plan only uses where it is safe, or refuses it with InvalidInput whose
every line names the file and the field; it never raises anything else.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from xffl.core.errors import InvalidInput
from xffl.core.names import NAME_RE
from xffl.jobs.spec.load import LoadedJob, load_job
from xffl.site_profiles.lookup import available
from xffl.site_profiles.schema import shell_unsafe_char
from xffl.workflows.plan.compile import write_plan
from xffl.workflows.plan.deployments import site_data_path

BUNDLED = {"local", "leonardo", "karolina", "lumi"}
FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

NASTY = ["x; rm -rf /", "$(id)", "`id`", "../..", "a b", "Alpha", "1job", "a" * 33, "a\nb",
         "a\x00b", "[/red]", "a#b", "a/b", "${HOME}", "-rf", "a:b", "", " ", "ünïcode",
         "a\u2028b", "a\rb", "a\tb", "'", '"', "\\", "*", "~", "%", "a.b"]
CWL_ID = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# the rules, written out here (not read from the code under test): what the loader must
# accept, so that a loader refusing too much fails these tests as one accepting too much does
PLAIN_NAME = re.compile(r"\A[a-z][a-z0-9_-]{0,31}\Z")
ROUND_SUFFIX = re.compile(r"-r[0-9]+\Z")


def valid_name(name: str) -> bool:
    """A job or profile name xffl must accept."""
    return bool(PLAIN_NAME.match(name))


def valid_site(name: str) -> bool:
    """A site name xffl must accept (a plain name not ending like a round, -r<N>)."""
    return valid_name(name) and not ROUND_SUFFIX.search(name)


def valid_path(path: str) -> bool:
    """A path xffl must accept: not blank, no control characters, no CWL expression."""
    return bool(path.strip()) and not CONTROL.search(path) and "$(" not in path \
        and "${" not in path

text = st.one_of(st.text(max_size=40), st.sampled_from(NASTY),
                 st.from_regex(NAME_RE, fullmatch=True))
path_text = st.one_of(st.text(max_size=60), st.sampled_from(NASTY),
                      st.from_regex(r"\A[a-z/._-]{1,30}\Z"),
                      st.builds(lambda a, b: f"data/{a}/{b}", st.text(max_size=10),
                                st.text(max_size=10)))


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    """One folder per module: each example rewrites its job.yaml (and profile) there."""
    with tempfile.TemporaryDirectory(prefix="xffl-fuzz-") as tmp:
        yield Path(tmp)


def _spec(name: str = "fuzz", site: str = "alpha", profile: str = "local",
          path: str = "data/alpha") -> dict[str, Any]:
    return {"name": name, "rounds": 1,
            "sites": [{"name": site, "profile": profile, "ranks": 1, "data": {"path": path}}]}


def _write(folder: Path, data: dict[str, Any], file: str = "job.yaml") -> Path:
    """Dump ``data`` as YAML; the dump must read back as the same data."""
    target = folder / file
    target.parent.mkdir(parents=True, exist_ok=True)
    dumped = yaml.safe_dump(data, allow_unicode=True, sort_keys=False)
    assume(yaml.safe_load(dumped) == data)  # PyYAML folds a few line breaks (NEL) to spaces
    target.write_text(dumped, encoding="utf-8")
    return target


def _load(job: Path, fields: set[str], file: Path | None = None) -> LoadedJob | None:
    """load_job, or None after checking that every error line names the file and a field."""
    try:
        return load_job(job)
    except InvalidInput as exc:
        named = str((file or job).resolve())
        for line in exc.lines:
            assert "\n" not in line and "\r" not in line, line
            assert line.startswith(named + ":"), line
            assert any(f" field {f}: " in line for f in fields), line
        return None


def _check_plan(loaded: LoadedJob, out: Path) -> dict[str, Any]:
    """Render the plan; every CWL id is plain and every file stays inside the plan folder."""
    paths = write_plan(loaded, f"{loaded.spec.name}-20260101-000000-abcd", out)
    root = paths.root.resolve()
    for file in root.rglob("*"):
        assert file.resolve().is_relative_to(root), file
    round_cwl = yaml.safe_load((root / "round.cwl").read_text())
    for ident in [*round_cwl["steps"], *round_cwl["inputs"]]:
        assert CWL_ID.match(ident), ident
    site = loaded.spec.sites[0].name
    assert (root / "tools" / f"train_{site}.cwl").is_file()
    assert (root / "jobs" / f"{site}.json").is_file()
    return yaml.safe_load((root / "tools" / f"train_{site}.cwl").read_text())  # type: ignore[no-any-return]


@FUZZ
@given(name=text, site=text)
@example(name="x; rm -rf /", site="$(id)")
@example(name="ok", site="ok-site_2")
def test_job_and_site_names(work: Path, name: str, site: str) -> None:
    folder = work / "names"
    job = _write(folder, _spec(name=name, site=site))
    loaded = _load(job, {"name", "sites[0].name"})
    assert (loaded is not None) == (valid_name(name) and valid_site(site)), (name, site)
    if loaded is None:
        return
    assert NAME_RE.match(loaded.spec.name) and NAME_RE.match(loaded.spec.sites[0].name)
    _check_plan(loaded, folder / "plan" / "x")


@FUZZ
@given(path=path_text)
@example(path="data/alpha\n; rm -rf /")
@example(path="$(inputs.job.path)")
@example(path="my data/with spaces'and\"quotes")
def test_data_paths(work: Path, path: str) -> None:
    folder = work / "paths"
    job = _write(folder, _spec(path=path))
    loaded = _load(job, {"sites[0].data.path"})
    assert (loaded is not None) == valid_path(path), path
    if loaded is None:
        return
    tool = _check_plan(loaded, folder / "plan" / "x")
    args = tool["arguments"]
    expected = site_data_path(loaded.profiles["alpha"], "alpha", path)
    assert args[args.index("--data") + 1] == expected  # one argv item: never split or run
    job_json = json.loads((folder / "plan" / "x" / "jobs" / "alpha.json").read_text())
    assert job_json["data"]["path"] == path


@FUZZ
@given(profile=text)
@example(profile="../../etc/passwd")
@example(profile="locl")
def test_profile_names(work: Path, profile: str) -> None:
    folder = work / "profiles"
    job = _write(folder, _spec(profile=profile))
    loaded = _load(job, {"sites[0].profile"})
    # only the profiles that exist (the bundled ones: no job folder profiles here) load
    assert (loaded is not None) == (valid_name(profile) and profile in BUNDLED), profile
    if loaded is None:
        return
    assert profile in available(folder)


@FUZZ
@given(name=text, workdir=path_text)
@example(name="mine", workdir="/scratch/x\n/bin/sh")
@example(name="mine", workdir="{xffl_home}/sites/{site}")
def test_profile_file_name_and_workdir(work: Path, name: str, workdir: str) -> None:
    folder = work / "profile-files"
    for old in folder.glob("site_profiles/*.yaml"):
        old.unlink()
    prof = _write(folder, {"name": name, "workdir": workdir}, "site_profiles/mine.yaml")
    job = _write(folder, _spec(profile="mine"))
    loaded = _load(job, {"name", "workdir"}, file=prof)
    # the file is mine.yaml: a profile named otherwise is refused (the name must match)
    # a workdir reaches the site's shell unquoted: plain path text only (schema.shell_unsafe_char)
    plain = valid_path(workdir) and shell_unsafe_char(workdir) is None
    assert (loaded is not None) == (name == "mine" and plain), (name, workdir)
    if loaded is None:
        return
    assert loaded.profiles["alpha"].name == "mine" == name
    _check_plan(loaded, folder / "plan" / "x")


@FUZZ
@given(raw=st.one_of(st.text(max_size=200), st.binary(max_size=200)))
@example(raw="name: [")
@example(raw=b"\xff\xfe")
@example(raw="? [a, b]\n: c\n")
def test_any_file_content_is_accepted_or_one_clear_error(work: Path, raw: str | bytes) -> None:
    folder = work / "raw"
    folder.mkdir(parents=True, exist_ok=True)
    job = folder / "job.yaml"
    job.write_bytes(raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass"))
    try:
        load_job(job)
    except InvalidInput as exc:
        for line in exc.lines:
            assert line.startswith(str(job.resolve()) + ":"), line
            assert "\n" not in line, line
