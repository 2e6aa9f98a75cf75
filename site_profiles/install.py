"""`xffl profiles install SITE`: this coordinator's exact xffl, its pinned dependencies and a
torch in a venv of the site's workdir, made current only once it works.

Layout at the site: ``WORKDIR/xffl-venvs/VERSION-KEY`` (one venv per xffl version and
wheelhouse key), ``WORKDIR/xffl-venvs/current`` (a symlink switched atomically after the new
venv answered xffl's probe), ``WORKDIR/xffl-wheelhouse/KEY`` (the uploaded wheels). The
profile's ``python:`` becomes ``WORKDIR/xffl-venvs/current/bin/python``. A second install
with the same key finds the current venv's stamp and its xffl's answer, and does nothing.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from xffl.core.errors import InvalidInput, RunFailed, XfflError
from xffl.core.paths import xffl_home
from xffl.core.versions import xffl_version
from xffl.site_profiles import install_errors as bad
from xffl.site_profiles.lookup import available, bundled_dir, find_profile, unfilled
from xffl.site_profiles.pins import torch_version
from xffl.site_profiles.profile_edit import set_top_level
from xffl.site_profiles.schema import SiteProfile
from xffl.site_profiles.shell_text import expand_workdir
from xffl.site_profiles.site_access import Site, open_site
from xffl.site_profiles.site_python import STAMP, SitePython, Stamp, parse, probe_command
from xffl.site_profiles.versions import parse_probe
from xffl.site_profiles.versions import probe_command as xffl_probe
from xffl.site_profiles.wheelhouse import REQUIREMENTS, Step, build_wheelhouse, wheelhouse_key

VENVS, WHEELS, PTH = "xffl-venvs", "xffl-wheelhouse", "xffl-site-torch.pth"
#: what a Python without a working venv module says (Debian's without python3-venv)
NO_VENV = ("ensurepip is not available", "No module named venv", "No module named ensurepip",
           "ensurepip is disabled", "python3-venv")
PIP_TIMEOUT = 3600.0
FULL_MIB = 16  # less free on the workdir's filesystem after a failed step: the disk was full


@dataclass
class Installed:
    """What an install did: the profile's new python, its venv, whether anything changed."""

    python: str
    venv: str
    changed: bool
    profile_file: Path


@dataclass
class _Plan:
    """One site's install: its names, where its answers point in the profile file."""

    name: str
    profile: SiteProfile
    path: Path
    workdir: str
    key: str

    @property
    def venvs(self) -> str:
        return f"{self.workdir.rstrip('/')}/{VENVS}"

    @property
    def python(self) -> str:
        return f"{self.venvs}/current/bin/python"

    def fail(self, site: Site, step: str, command: str, timeout: float = 600.0) -> str:
        """Run ``command``; its stdout, or the failure's one line (disk, quota, ...)."""
        rc, out, err = site.run(command, timeout)
        if rc != 0:
            raise self.failure(site, step, rc, err)
        return out

    def failure(self, site: Site, step: str, rc: int, err: str) -> XfflError:
        """The one-line error of a failed step: the site's words, or its free space when
        the words do not say (a tool that hid its ENOSPC) and the disk is full."""
        free = _free_mib(site, self.workdir)
        if free is not None and free < FULL_MIB and not any(
                s in err for s in (*bad.NO_SPACE, *bad.NO_QUOTA)):
            err = f"{err}\n{bad.NO_SPACE[0]} ({free} MiB free)"
        return bad.step_failure(self.name, step, rc, err, self.workdir,
                                bad.field_at(self.path, "workdir"))


def _free_mib(site: Site, folder: str) -> int | None:
    """MiB free on ``folder``'s filesystem at the site (df), or None when it cannot say."""
    rc, out, _ = site.run(f"df -Pk {shlex.quote(folder)} | tail -n 1", setup=False)
    fields = out.split()
    return int(fields[3]) // 1024 if rc == 0 and len(fields) >= 6 and fields[3].isdigit() \
        else None


def _profile_file(name: str) -> tuple[SiteProfile, Path]:
    """The profile and its file, which must be the user's own (install writes python:)."""
    profile = find_profile(name)
    path = available()[name]
    if path.parent.resolve() == bundled_dir().resolve():
        raise InvalidInput(f"site profile {name!r} is the bundled template {path}; copy it "
                           f"with `xffl profiles init {name}`, fill it in, then install.")
    left = [e for e in unfilled(name, profile) if "field python:" not in e]
    if left:
        raise InvalidInput(left[0], lines=left)
    return profile, path


def _ask(site: Site, name: str, profile: SiteProfile, path: Path) -> SitePython:
    """The base Python's answer; no Python or no venv module is one line with the fix."""
    python = profile.install.python
    where = bad.field_at(path, "install.python")
    rc, out, err = site.run(probe_command(python, profile.install.torch == "site"))
    answer = parse(out) if rc == 0 else None
    if answer is None:
        if rc in (126, 127) or "not found" in err or "No such file" in err:
            raise bad.no_python(name, python, rc, err, where)
        raise bad.step_failure(name, f"asking {python}", rc, err, profile.workdir,
                               bad.field_at(path, "workdir"))
    if answer.venv is not None:
        raise bad.no_venv(name, python, answer.venv, where)
    if profile.install.torch == "site" and answer.torch is None:
        raise InvalidInput(f"{bad.field_at(path, 'install.torch')}: site profile field "
                           f"install.torch is `site`, but {python} at site {name!r} imports "
                           f"no torch ({answer.torch_error}); load the site's PyTorch module "
                           "in setup, or give a torch index URL (e.g. "
                           "https://download.pytorch.org/whl/cu126).")
    return answer


def _key(profile: SiteProfile, target: SitePython) -> str:
    """The install's key: the wheelhouse's, and the profile's index and torch choices."""
    spec = profile.install
    text = json.dumps([wheelhouse_key(target, spec.index_url is None), spec.index_url,
                       spec.torch, target.torch])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _current(site: Site, plan: _Plan) -> bool:
    """Whether the current venv holds this install (its stamp's key) and its xffl answers."""
    current = f"{plan.venvs}/current"
    rc, out, _ = site.run(f"cat {shlex.quote(current)}/{STAMP} && echo && "
                          + xffl_probe(f"{current}/bin/python"), setup=False)
    if rc != 0:
        return False
    try:
        stamp = Stamp.model_validate_json(out.splitlines()[0])
    except (ValueError, IndexError):
        return False
    versions = parse_probe(out)
    return (stamp.key == plan.key and versions is not None
            and versions.xffl == xffl_version() and versions.error is None)


def _check_index(site: Site, plan: _Plan, url: str, field: str) -> None:
    """InvalidInput (file:line) when the site cannot reach ``url`` (an HTTP answer of any
    status is reachable)."""
    code = ("import sys, urllib.error, urllib.request\n"
            "try:\n    urllib.request.urlopen(sys.argv[1], timeout=20)\n"
            "except urllib.error.HTTPError:\n    pass\n")
    rc, _, err = site.run(f"{shlex.quote(plan.profile.install.python)} -c "
                          f"{shlex.quote(code)} {shlex.quote(url)}", 60)
    if rc != 0:
        raise bad.unreachable(plan.name, url, bad.said(err, rc),
                              bad.field_at(plan.path, field))


def _upload(site: Site, plan: _Plan, wheelhouse: Path, step: Step) -> str:
    """Copy the wheelhouse to the site (what is there already, by name and size, stays)."""
    remote = f"{plan.workdir.rstrip('/')}/{WHEELS}/{plan.key}"
    plan.fail(site, "creating the wheelhouse folder", f"mkdir -p {shlex.quote(remote)}")
    there = site.sizes(remote)
    files = sorted(p for p in wheelhouse.iterdir() if p.is_file())
    todo = [p for p in files if there.get(p.name) != p.stat().st_size]
    size = sum(p.stat().st_size for p in todo)
    step(f"uploading {len(todo)} of {len(files)} files ({size / 2**20:.1f} MiB) to {remote}")
    for file in todo:
        try:
            site.put(file, f"{remote}/{file.name}")
        except OSError as exc:
            raise bad.step_failure(plan.name, f"uploading {file.name}", 1, str(exc),
                                   plan.workdir, bad.field_at(plan.path, "workdir")) from None
    return remote


def _venv_name(site: Site, plan: _Plan) -> str:
    """The new venv's folder name: VERSION-KEY, unless that is the (broken) current one."""
    name = f"{xffl_version()}-{plan.key[:12]}"
    rc, out, _ = site.run(f"readlink {shlex.quote(plan.venvs)}/current", setup=False)
    return f"{name}-{int(time.time())}" if rc == 0 and out.strip() == name else name


def _create_venv(site: Site, plan: _Plan, step: Step) -> str:
    """Create the new venv (not current yet); its folder. A Python without venv is one line."""
    spec = plan.profile.install
    venv = f"{plan.venvs}/{_venv_name(site, plan)}"
    step(f"creating the venv {venv} with {spec.python}")
    # pip by ensurepip as a command of its own: `venv` would hide its words (ENOSPC, EDQUOT)
    rc, _, err = site.run(f"mkdir -p -m 700 {shlex.quote(plan.workdir)} && mkdir -p "
                          f"{shlex.quote(plan.venvs)} && rm -rf {shlex.quote(venv)} && "
                          f"{shlex.quote(spec.python)} -m venv --without-pip "
                          f"{shlex.quote(venv)} && {shlex.quote(venv)}/bin/python -m ensurepip "
                          "--upgrade --default-pip >/dev/null", 600)
    if rc != 0:
        error = plan.failure(site, "creating the venv", rc, err)
        site.run(f"rm -rf {shlex.quote(venv)}", setup=False)
        if any(s in err for s in NO_VENV):
            raise bad.no_venv(plan.name, spec.python, bad.said(err, rc),
                              bad.field_at(plan.path, "install.python"))
        raise error
    return venv


def _fill_venv(site: Site, plan: _Plan, venv: str, wheels: str, step: Step) -> None:
    """Give the venv torch and the wheels, then check that its xffl answers."""
    spec = plan.profile.install
    q, py = shlex.quote(venv), shlex.quote(f"{venv}/bin/python")
    pip = f"{py} -m pip --disable-pip-version-check --no-input install --log {q}/xffl-pip.log"
    if spec.torch == "site":
        step("giving the venv the site's own torch")
        where = ("import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
        plan.fail(site, "linking the site's torch", f"P=$({py} -c 'import sysconfig; print("
                  f"sysconfig.get_path(\"purelib\"))') && {shlex.quote(spec.python)} -c "
                  f"{shlex.quote(where)} > \"$P/{PTH}\"")
    else:
        step(f"installing torch {torch_version()} from {spec.torch}")
        plan.fail(site, "installing torch", f"{pip} --index-url {shlex.quote(spec.torch)} "
                  f"torch=={torch_version()}", PIP_TIMEOUT)
    # the wheelhouse alone: no index, and none of the site's pip configuration's folders
    source = (f"--index-url {shlex.quote(spec.index_url)}" if spec.index_url else
              "--no-index")
    quiet = "" if spec.index_url else "PIP_CONFIG_FILE=/dev/null "
    step("installing xffl and its pinned dependencies"
         + (f" from {spec.index_url}" if spec.index_url else " from the wheelhouse (no index)"))
    plan.fail(site, "installing xffl", f"{quiet}{pip} --no-deps --ignore-installed {source} "
              f"--find-links {shlex.quote(wheels)} -r {shlex.quote(wheels)}/{REQUIREMENTS}",
              PIP_TIMEOUT)
    step("asking the new venv's xffl")
    rc, out, err = site.run(xffl_probe(f"{venv}/bin/python", full=True), 300)
    versions = parse_probe(out) if rc == 0 else None
    if versions is None or versions.error is not None or versions.xffl != xffl_version():
        why = versions.error if versions is not None else bad.said(err, rc)
        raise RunFailed(f"site {plan.name!r}: the new venv {venv} does not run this xffl "
                        f"{xffl_version()} ({why}); it was removed and the current one kept.")


def _new_venv(site: Site, plan: _Plan, target: SitePython, find_links: Sequence[Path],
              step: Step) -> str:
    """Create, fill, check and stamp a new venv; its folder (removed if any step fails)."""
    venv = _create_venv(site, plan, step)
    try:
        wheelhouse = build_wheelhouse(target, find_links, step,
                                      deps=plan.profile.install.index_url is None)
        _fill_venv(site, plan, venv, _upload(site, plan, wheelhouse, step), step)
        stamp = Stamp(key=plan.key, xffl=xffl_version(),
                      requirements=len((wheelhouse / REQUIREMENTS).read_text().split()))
        plan.fail(site, "writing the venv's stamp", f"printf '%s\\n' "
                  f"{shlex.quote(stamp.model_dump_json())} > {shlex.quote(venv)}/{STAMP}")
    except BaseException:
        site.run(f"rm -rf {shlex.quote(venv)}", setup=False)
        raise
    return venv


def install(name: str, find_links: Sequence[Path], step: Step) -> Installed:
    """Install this xffl at site ``name`` (see the module doc); ``find_links``: build the
    wheelhouse from these folders only. Bad answers from the site are one line each."""
    profile, path = _profile_file(name)
    workdir = expand_workdir(profile.workdir, str(xffl_home()), name)
    with open_site(profile) as site:
        step(f"asking the site's {profile.install.python}")
        target = _ask(site, name, profile, path)
        plan = _Plan(name, profile, path, workdir, _key(profile, target))
        if _current(site, plan):
            step(f"{plan.venvs}/current already holds xffl {xffl_version()}: nothing to do")
            changed = False
        else:
            for url, field in ((profile.install.index_url, "install.index_url"),
                               (profile.install.torch, "install.torch")):
                if url is not None and url != "site":
                    _check_index(site, plan, url, field)
            venv = _new_venv(site, plan, target, find_links, step)
            step(f"making {venv} current")
            plan.fail(site, "switching current", f"cd {shlex.quote(plan.venvs)} && ln -sfn "
                      f"{shlex.quote(Path(venv).name)} current.new && mv -T current.new current")
            changed = True
    if profile.python != plan.python:
        set_top_level(path, "python", plan.python)
        find_profile(name)  # still a valid profile
    return Installed(plan.python, f"{plan.venvs}/current", changed, path)
