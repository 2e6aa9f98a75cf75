"""What one xffl must share with another across a border: the exchange format's version.

A site and the coordinator exchange checkpoints (:mod:`xffl.aggregator.exchange`); the
format's version is what both must agree on, and :func:`xffl_version` is recorded beside it
in every manifest so that a refusal can name the xffl that wrote it. This module imports
nothing of xffl's: a site's Python reads :data:`FORMAT_VERSION` from it in a fraction of a
second (the version probe of ``xffl submit`` and ``xffl profiles check``).
"""

from __future__ import annotations

import re
import shlex
from functools import cache
from importlib import metadata

#: the exchange format's version: manifest.json's ``format_version``. 2: the manifest records
#: the writer's ``xffl_version`` (a reader of format 1 refuses that field).
FORMAT_VERSION = 2
#: a version string as a site may report it (PEP 440 and local labels), at most 64 characters
VERSION_PATTERN = r"^[0-9A-Za-z][0-9A-Za-z.+!_-]{0,63}$"
_VERSION = re.compile(VERSION_PATTERN)


@cache
def xffl_version() -> str:
    """This xffl's version as installed (``unknown`` when run from a tree not installed)."""
    try:
        return metadata.version("xffl")
    except metadata.PackageNotFoundError:
        return "unknown"


def shown(version: object) -> str:
    """A version a site reported, as a message quotes it: itself when it is one, else ``?``."""
    return version if isinstance(version, str) and _VERSION.match(version) else "?"


def same_format(version: object) -> bool:
    """Whether ``version`` (a manifest's or a site's, untrusted) is this xffl's format."""
    return type(version) is int and version == FORMAT_VERSION


def format_mismatch(version: object, written_by: object) -> str:
    """Why a checkpoint of another format is refused: both formats and both xffl versions."""
    what = version if type(version) is int else "?"
    return (f"format version {what} (written by xffl {shown(written_by)}), where this xffl "
            f"{xffl_version()} reads format version {FORMAT_VERSION}")


def install_command(site: str) -> str:
    """The command that installs this coordinator's xffl (its exact version, its pinned
    dependencies) at ``site``, over the site profile's own SSH login."""
    return f"xffl profiles install {shlex.quote(site)}"
