"""Profile values that reach a shell or the batch template: the checks they pass."""

from __future__ import annotations

import re

from xffl.core.validation import check_path_text

# an environment variable's name, as POSIX sh and StreamFlow's `export NAME=...` take it
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# a workdir's characters besides letters and digits: StreamFlow joins the workdir, unquoted,
# into the commands it runs at an SSH site (mkdir, tar -C, ln, rm -rf, sbatch --chdir "...")
WORKDIR_PUNCTUATION = frozenset("_./-+,:@%=")
WORKDIR_PLACEHOLDERS = ("{xffl_home}", "{site}")


def shell_unsafe_char(path: str) -> str | None:
    """The first character of ``path`` that a shell would read as more than a path, if any.

    Letters, digits, ``_ . / - + , : @ % =`` and the workdir placeholders are plain text to
    sh even unquoted; anything else (blanks, quotes, ``$ ` ; & | < > ( ) * ? [ ] ~ \\``,
    ``#``, ``!``, ``{``, control characters) is refused where a path reaches a shell unquoted.
    """
    for placeholder in WORKDIR_PLACEHOLDERS:
        path = path.replace(placeholder, "")
    return next((c for c in path if not (c.isalnum() or c in WORKDIR_PUNCTUATION)), None)


def expand_workdir(workdir: str, home: str, site: str) -> str:
    """A profile's workdir with its placeholders filled: ``{xffl_home}`` by ``home`` (this
    machine's XFFL_HOME), ``{site}`` by the site's name."""
    return workdir.replace("{xffl_home}", home).replace("{site}", site)


def workdir_text(value: str) -> str:
    """A workdir is plain path text to an unquoted shell word (see :func:`shell_unsafe_char`)."""
    check_path_text(value)
    bad = shell_unsafe_char(value)
    if bad is not None:
        raise ValueError(
            f"{value!r} holds {bad!r}, which StreamFlow would pass unquoted to a shell at the "
            "site (mkdir, tar, sbatch --chdir); use an absolute path of letters, digits and "
            "_ . / - + , : @ % = (and the {xffl_home} and {site} placeholders)")
    return value

# StreamFlow renders the batch template with Jinja2 a second time; the site's own lines sit
# in a {% raw %} block there, which only a Jinja2 statement tag could end
_TEMPLATE_TAG = "{%"


def template_text(value: str) -> str:
    """A value that reaches the batch template: no Jinja2 statement tag."""
    if _TEMPLATE_TAG in value:
        raise ValueError(f"{value!r} holds '{_TEMPLATE_TAG}', which the batch script's "
                         "template would read as a Jinja2 statement; remove it")
    return value
