"""What a site's failed install step means, as one line with the fix: no Python, no venv
module, a full disk, a quota, an unreachable index, or else pip's own last words."""

from __future__ import annotations

import re
from pathlib import Path

from xffl.core.errors import InvalidInput, RunFailed, XfflError

NO_SPACE = ("No space left on device", "[Errno 28]")
NO_QUOTA = ("Disk quota exceeded", "[Errno 122]")


def said(err: str, rc: int) -> str:
    """The last line a site wrote to stderr (else its exit status), printable and short."""
    lines = [line for line in err.strip().splitlines() if line.strip()
             and not line.lstrip().startswith("WARNING:")] or [f"exit {rc}"]
    return "".join(c if c.isprintable() else "?" for c in lines[-1].strip())[:200]


def field_at(path: Path, dotted: str) -> str:
    """``path:line`` of a field (``install.index_url``) in a profile file, else ``path``."""
    lines = path.read_text().splitlines()
    start, indent = 0, -1
    for part in dotted.split("."):
        for n in range(start, len(lines)):
            match = re.match(rf"(\s*){re.escape(part)}\s*:", lines[n])
            if match and len(match.group(1)) > indent:
                start, indent = n + 1, len(match.group(1))
                break
        else:
            return str(path)
    return f"{path}:{start}"


def step_failure(site: str, step: str, rc: int, err: str, workdir: str,
                 where_workdir: str) -> XfflError:
    """The error of a site command that failed while ``step`` (disk full, quota, other)."""
    text = said(err, rc)
    if any(s in err for s in NO_SPACE):
        return RunFailed(f"site {site!r}: the disk of {workdir} is full ({step}: {text}); free "
                         f"space there, or give the profile a workdir on a filesystem with "
                         f"room ({where_workdir}).")
    if any(s in err for s in NO_QUOTA):
        return RunFailed(f"site {site!r}: your quota on {workdir} is used up ({step}: {text}); "
                         f"remove earlier venvs in {workdir}/xffl-venvs and old runs there, "
                         f"or ask the facility for more (`quota` or the facility's command "
                         f"shows it).")
    if rc == 124:
        return RunFailed(f"site {site!r}: {step} did not finish ({text}); run `xffl profiles "
                         f"install {site}` again.")
    return RunFailed(f"site {site!r}: {step} failed ({text}).")


def no_python(site: str, python: str, rc: int, err: str, where: str) -> InvalidInput:
    """The site has no such Python (after the profile's setup lines)."""
    return InvalidInput(f"{where}: site profile field install.python: site {site!r} has no "
                        f"{python} ({said(err, rc)}); load the module that brings it in the "
                        "profile's setup lines, or give the interpreter's absolute path.")


def no_venv(site: str, python: str, why: str, where: str) -> InvalidInput:
    """The site's Python cannot make a venv (Debian's python3 without python3-venv)."""
    return InvalidInput(f"{where}: site profile field install.python: {python} at site "
                        f"{site!r} cannot make a venv ({why}); use a Python that has venv and "
                        "ensurepip there (a module's, or ask the facility for python3-venv).")


def unreachable(site: str, url: str, why: str, where: str) -> InvalidInput:
    """The site cannot reach an index the profile names."""
    return InvalidInput(f"{where}: the index {url} is unreachable from site {site!r} ({why}); "
                        "fix the URL, or leave install.index_url out so that xffl uploads a "
                        "wheelhouse.")
