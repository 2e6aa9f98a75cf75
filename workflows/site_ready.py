"""Before anything is queued: every site's xffl (its exchange format), its data folders and,
for a LoRA job, its peft.

``xffl submit`` checks them through each site's own connection (the SSH login it already
verified; the local filesystem for a local site), so a site whose xffl writes another
exchange format, or a missing, empty or mis-tokenized data folder, is refused at once instead
of failing round 1 after the queue wait (or after its GPU-hours, at aggregation). What a
site sends back is read as numbers and checked words only: the probe's versions
(:mod:`xffl.site_profiles.versions`), the size of train.bin and meta.json's fields. A
synthetic data.path is generated at the site on first use: nothing to check there.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

from xffl.core.errors import ConnectionFailed, InvalidInput
from xffl.jobs.spec.load import LoadedJob
from xffl.jobs.spec.peft_check import PROBE, PROBE_MISSING, install_command
from xffl.jobs.spec.schema import SiteSpec
from xffl.site_profiles.schema import SiteProfile, SshConnector
from xffl.site_profiles.versions import format_problem, parse_probe, probe_command
from xffl.workflows.plan.deployments import site_data_path, site_python, site_workdir

META_LIMIT = 65536  # the most bytes of a site's meta.json read back (xffl writes < 1 KiB)
ITEM_BYTES = {"uint16": 2, "uint32": 4}  # meta.json's dtypes (xffl.training.data)
DEFAULT_VOCAB = 256  # a meta.json without vocab_size: bytes (as the trainer reads it)
_MISSING, _NOT_DIR, _NO_META = 3, 4, 5  # exit codes of the probe script

#: runs a shell command at the site: (exit status, stdout, stderr)
Runner = Callable[[str], tuple[int, str, str]]


@dataclass(frozen=True)
class Folder:
    """One data folder of a site: the job spec's field and text, and where it is there."""

    field: str
    given: str
    where: str


def site_folders(profile: SiteProfile, site: SiteSpec) -> list[Folder]:
    """The data folders ``site`` reads, resolved as its trainer does (relative: the workdir)."""
    found = []
    if site.data.synthetic is None:
        found.append(Folder("data.path", site.data.path,
                            site_data_path(profile, site.name, site.data.path)))
    held_out = site.data.validation
    if held_out is not None and held_out.path is not None:
        found.append(Folder("data.validation.path", held_out.path,
                            site_data_path(profile, site.name, held_out.path)))
    return found


def said(err: str, rc: int) -> str:
    """The last line a site wrote to stderr (else its exit status), printable and short:
    a facility's words reach the user's terminal."""
    last = (err.strip().splitlines() or [f"exit {rc}"])[-1]
    return "".join(c if c.isprintable() else "?" for c in last)[:200]


def probe_script(folder: str) -> str:
    """Exit 3 (missing), 4 (not a folder) or 5 (no readable meta.json); else print
    train.bin's size (-1 without it) and the first bytes of meta.json. The folder is one
    quoted word, as the trainer gets it (a ``~`` is not expanded there either)."""
    return (f'd={shlex.quote(folder)}; [ -e "$d" ] || exit {_MISSING}; '
            f'[ -d "$d" ] || exit {_NOT_DIR}; [ -r "$d/meta.json" ] || exit {_NO_META}; '
            f'stat -c %s "$d/train.bin" 2>/dev/null || echo -1; '
            f'dd if="$d/meta.json" bs={META_LIMIT} count=1 2>/dev/null')


def _meta_problem(out: str, vocab: int) -> tuple[str, str] | None:
    """(what is wrong, the fix) of a probe's output against the model's ``vocab``, or None."""
    size_text, _, text = out.partition("\n")
    again = "prepare the data again (`xffl data prepare`)"
    try:
        meta = json.loads(text)
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or meta.get("dtype") not in ITEM_BYTES:
        return "holds a meta.json that is not xffl's (no dtype uint16 or uint32)", again
    tokens = meta.get("num_tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        return "holds a meta.json whose num_tokens is not a count", again
    if tokens == 0:
        return "holds no tokens (meta.json's num_tokens is 0)", \
            "prepare it from data that is not empty (`xffl data prepare`)"
    size = int(size_text) if size_text.strip().lstrip("-").isdigit() else -1
    expected = tokens * ITEM_BYTES[meta["dtype"]]
    if size != expected:
        have = "has no train.bin" if size < 0 else f"has a train.bin of {size} bytes"
        return f"{have}, where meta.json promises {tokens} {meta['dtype']} tokens", again
    used = meta.get("vocab_size", DEFAULT_VOCAB)
    if isinstance(used, int) and not isinstance(used, bool) and used > vocab:
        return (f"was tokenized for a vocabulary of {used} tokens, more than the model's "
                f"vocab_size {vocab}"), ("prepare it with the model's own tokenizer "
                                         "(`xffl data prepare --tokenizer`)")
    return None


def _folder_problem(run: Runner, profile: SiteProfile, site: str, folder: Folder,
                    vocab: int) -> tuple[str, str] | None:
    """(what is wrong with ``folder`` at the site, the fix), or None when it can train."""
    rc, out, err = run(probe_script(folder.where))
    relative = not folder.given.startswith(("/", "~"))  # site_data_path's rule
    if rc == _MISSING:
        if relative:
            return ("does not exist", f"{folder.field} {folder.given!r} is relative, so it is "
                    f"read under the site profile's workdir {site_workdir(profile, site)}: give "
                    "the folder's absolute path at the site, or prepare the data there")
        if folder.given.startswith("~"):
            return "does not exist", (f"{folder.field} reaches the trainer as written, "
                                      "without expanding ~: give the folder's absolute path")
        return "does not exist", (f"prepare the data there (`xffl data prepare ... -o "
                                  f"{shlex.quote(folder.where)}`) or fix {folder.field}")
    if rc == _NOT_DIR:
        return "is not a folder", f"point {folder.field} at a folder `xffl data prepare` wrote"
    if rc == _NO_META:
        return "has no readable meta.json", ("point it at a folder `xffl data prepare` wrote, "
                                             "or prepare the data there again")
    if rc != 0:
        raise ConnectionFailed(
            f"site {site!r}: cannot read its {folder.field} folder {folder.where} "
            f"({said(err, rc)}); check the connection "
            f"with `xffl profiles check {profile.name}`.")
    return _meta_problem(out, vocab)


def _peft_problem(run: Runner, python: str) -> str | None:
    """Why ``python`` at the site cannot train a LoRA job (peft missing), or None."""
    rc, _, err = run(f"{shlex.quote(python)} -c {shlex.quote(PROBE)}")
    if rc == 0:
        return None
    if rc == PROBE_MISSING:
        return (f"its Python {python} cannot import peft, which a LoRA job (training.lora) "
                f"needs; install it there: `{install_command(python)}`")
    return (f"its Python {python} does not run ({said(err, rc)}); fix python in the site profile "
            "(`xffl profiles check` shows it)")


def _version_problem(run: Runner, python: str) -> tuple[str | None, bool]:
    """Why ``python`` at the site cannot train for this coordinator (no xffl, or one of
    another exchange format, with the install command), or None; and whether it answered."""
    rc, out, err = run(probe_command(python))
    versions = parse_probe(out) if rc == 0 else None
    if versions is None:
        why = said(err, rc) if rc else "it printed no answer the probe prints"
        return (f"its Python {python} does not answer xffl's version probe ({why}); "
                "fix python in the site profile (`xffl profiles check` shows it)"), False
    return format_problem(python, versions), True


def _local(command: str) -> tuple[int, str, str]:
    """Run ``command`` in this machine's shell: a local site's filesystem is this one's."""
    try:
        proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                              timeout=120, check=False)
    except subprocess.TimeoutExpired:
        return 124, "", "timed out after 120 s"
    return proc.returncode, proc.stdout, proc.stderr


def _own_python(profile: SiteProfile) -> bool:
    """Whether the site trains with a Python of its own (not this process's interpreter)."""
    return isinstance(profile.connector, SshConnector) or profile.python is not None


def site_problems(loaded: LoadedJob, site: SiteSpec, run: Runner, vocab: int,
                  versions: bool = True) -> list[str]:
    """Every reason ``site`` would fail its first round (``its ...; the fix``), one each;
    ``versions``: its xffl's exchange format among them."""
    profile = loaded.site_profile(site.name)
    found = []
    answered = True
    if _own_python(profile) and versions:
        problem, answered = _version_problem(run, site_python(profile))
        if problem is not None:
            found.append(problem)
    if loaded.spec.training.lora is not None and _own_python(profile) and answered:
        problem = _peft_problem(run, site_python(profile))
        if problem is not None:
            found.append(problem)
    for folder in site_folders(profile, site):
        bad = _folder_problem(run, profile, site.name, folder, vocab)
        if bad is not None:
            found.append(f"its {folder.field} folder {folder.where} {bad[0]}; {bad[1]}")
    return found


@contextmanager
def site_runner(profile: SiteProfile) -> Iterator[Runner]:
    """Run shell commands at the site: over one verified SSH login, or here for a local one."""
    if not isinstance(profile.connector, SshConnector):
        yield _local
        return
    from xffl.site_profiles.remote import connect, run

    with connect(profile) as client:
        yield partial(run, client)


def _asks(loaded: LoadedJob, site: SiteSpec) -> bool:
    """Whether there is anything to ask ``site`` (its Python's xffl, a folder, or peft)."""
    profile = loaded.site_profile(site.name)
    return _own_python(profile) or loaded.spec.training.lora is not None or bool(
        site_folders(profile, site))


def _vocab(loaded: LoadedJob) -> int:
    """The model's vocab_size (preset or init's config.json, with the overrides)."""
    from xffl.training.arch import build_config

    return build_config(loaded.spec.model).vocab_size


def check_sites_ready(loaded: LoadedJob) -> None:
    """InvalidInput (exit 2) naming every site whose xffl, data (or peft) would fail round 1.

    One connection per SSH site (host key verified, as every xffl login); a connection that
    fails is ConnectionFailed (exit 3).
    """
    vocab = _vocab(loaded)
    found: list[str] = []
    for site in loaded.spec.sites:
        if not _asks(loaded, site):
            continue
        with site_runner(loaded.site_profile(site.name)) as run:
            found += [f"{loaded.path}: site {site.name!r}: {p}."
                      for p in site_problems(loaded, site, run, vocab)]
    if found:
        raise InvalidInput(found[0], lines=found)


def data_site_names(loaded: LoadedJob, profile: str) -> list[str]:
    """The job's sites on profile ``profile`` (InvalidInput naming its profiles if none)."""
    sites = [s.name for s in loaded.spec.sites if s.profile == profile]
    if not sites:
        raise InvalidInput(f"{loaded.path}: no site of the job runs on profile {profile!r}; "
                           "name one of its profiles ("
                           f"{', '.join(sorted({s.profile for s in loaded.spec.sites}))}).")
    return sites


def data_rows(loaded: LoadedJob, profile: str) -> list[tuple[str, bool, str]]:
    """`xffl profiles check NAME --data JOB`: a row (check, ok, detail) per site of the job
    on profile ``profile``."""
    names = data_site_names(loaded, profile)
    sites = [s for s in loaded.spec.sites if s.name in names]
    vocab = _vocab(loaded)
    rows = []
    for site in sites:
        if loaded.spec.training.lora is None and not site_folders(
                loaded.site_profile(site.name), site):
            rows.append((f"data {site.name}", True, "synthetic: made at the site on first use"))
            continue
        with site_runner(loaded.site_profile(site.name)) as run:  # versions: their own rows
            problems = site_problems(loaded, site, run, vocab, versions=False)
        folders = [f.where for f in site_folders(loaded.site_profile(site.name), site)]
        rows.append((f"data {site.name}", not problems,
                     "; ".join(problems) or f"ready: {', '.join(folders) or 'peft'}"))
    return rows
