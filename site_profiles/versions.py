"""A site's versions, asked of its own Python: one probe, read back as a site's words.

``xffl submit`` asks every site's Python which exchange format its xffl writes and refuses a
site whose format is not the coordinator's before anything is queued; ``xffl profiles check``
asks the same probe for more (Python, xffl, torch, transformers, the CUDA or ROCm build, the
GPUs torch sees where it runs). The probe is Python source sent with ``-c``, so it runs under
any xffl, older ones included (those read the format from ``xffl.aggregator.exchange``). It
prints one line, ``xffl-versions <json>``; a site's answer is bounded and validated field by
field (versions by pattern, GPU names printable and short), never trusted.
"""

from __future__ import annotations

import json
import shlex
from typing import Annotated

from pydantic import Field, StringConstraints, ValidationError

from xffl.core.validation import StrictModel
from xffl.core.versions import (
    FORMAT_VERSION,
    VERSION_PATTERN,
    install_command,
    same_format,
    shown,
    xffl_version,
)

MARKER = "xffl-versions "
#: the most characters of the probe's line read back (its answer is well under 1 KiB)
MAX_LINE = 8192
#: the GPUs a site may list, and the characters of each name
MAX_GPUS, GPU_CHARS = 64, 100

_HEAD = """import json, platform
from importlib import metadata
def v(name):
    try:
        return metadata.version(name)
    except Exception:
        return None
out = {"python": platform.python_version(), "xffl": v("xffl"), "torch": v("torch"),
       "transformers": v("transformers"), "format": None}
def why(exc):
    return (type(exc).__name__ + ": " + str(exc))[:200]
try:
    try:
        from xffl.core.versions import FORMAT_VERSION
    except ImportError:
        from xffl.aggregator.exchange import FORMAT_VERSION
    out["format"] = FORMAT_VERSION
except Exception as exc:
    out["error"] = why(exc)
"""
_FULL = """try:
    import xffl.training
except Exception as exc:
    out.setdefault("error", why(exc))
try:
    import torch
    out["cuda"], out["hip"] = torch.version.cuda, getattr(torch.version, "hip", None)
    out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
except Exception:
    pass
"""
_TAIL = 'print("' + MARKER + '" + json.dumps(out))\n'

Version = Annotated[str, StringConstraints(pattern=VERSION_PATTERN)]
GpuName = Annotated[str, StringConstraints(max_length=GPU_CHARS, pattern=r"^[ -~]*$")]


class SiteVersions(StrictModel):
    """What a site's Python reported; every field is the site's word, checked as such."""

    python: Version | None = None
    xffl: Version | None = None
    format: int | None = Field(default=None, strict=True, ge=0, le=1_000_000)
    torch: Version | None = None
    transformers: Version | None = None
    cuda: Version | None = None
    hip: Version | None = None
    gpus: list[GpuName] | None = Field(default=None, max_length=MAX_GPUS)
    error: Annotated[str, StringConstraints(max_length=200, pattern=r"^[ -~]*$")] | None = None

    def build(self) -> str:
        """torch's GPU build: ``CUDA 12.4``, ``ROCm 6.1`` or ``CPU only``."""
        if self.cuda:
            return f"CUDA {self.cuda}"
        return f"ROCm {self.hip}" if self.hip else "CPU only"

    def summary(self) -> str:
        """One line: Python, xffl (its exchange format), torch (its build), transformers."""
        fmt = "?" if self.format is None else self.format
        return (f"Python {shown(self.python)}, xffl {shown(self.xffl)} (exchange format {fmt}), "
                f"torch {shown(self.torch)} ({self.build()}), "
                f"transformers {shown(self.transformers)}")


def probe_command(python: str, full: bool = False) -> str:
    """The shell command that runs the probe in ``python`` (``full``: also import
    xffl.training and torch, for the GPUs: seconds, where the format alone takes a blink)."""
    source = _HEAD + (_FULL if full else "") + _TAIL
    return f"{shlex.quote(python)} -c {shlex.quote(source)}"


def parse_probe(out: str) -> SiteVersions | None:
    """The probe's answer in a site's stdout (its last marked line), or None when there is
    none or it is not one the probe prints (too long, not JSON, a field out of bounds)."""
    lines = [line for line in out.splitlines() if line.startswith(MARKER)]
    if not lines or len(lines[-1]) > MAX_LINE:
        return None
    try:
        data = json.loads(lines[-1][len(MARKER):])
        return SiteVersions.model_validate(data)
    except (ValueError, ValidationError):
        return None


def format_problem(python: str, versions: SiteVersions, profile: str) -> str | None:
    """Why ``python`` at a site (of site profile ``profile``) cannot take part in this
    coordinator's runs (its xffl missing, or of another exchange format: both versions and
    the install command), or None."""
    fix = f"install this xffl {xffl_version()} there: `{install_command(profile)}`"
    if versions.format is None:
        detail = f" ({versions.error})" if versions.error else ""
        return f"its Python {python} cannot import xffl{detail}; {fix}"
    if same_format(versions.format):
        return None
    return (f"its Python {python} has xffl {shown(versions.xffl)}, which writes exchange "
            f"format {versions.format}, where this xffl {xffl_version()} reads format "
            f"{FORMAT_VERSION}; {fix}")


def gpu_detail(versions: SiteVersions | None, gres: str | None, partition: str | None) -> str:
    """The GPUs row: what torch sees where the probe ran (a login node often has none) and
    the partition's GRES as SLURM lists it (``gres``: sinfo's %G, already bounded)."""
    seen = versions.gpus if versions is not None else None
    here = ("torch could not be asked" if seen is None else
            f"{len(seen)} where the probe ran" + (f" ({', '.join(sorted(set(seen)))})"
                                                  if seen else ""))
    if partition is None:
        return here
    listed = gres if gres and gres != "(null)" else "none listed"
    return f"{here}; partition {partition}: GRES {listed}"


def gres_of(out: str) -> str:
    """sinfo's ``%G`` lines for a partition (one per node group) as one short printable text."""
    groups = sorted({"".join(c for c in line.strip() if c.isprintable())[:GPU_CHARS]
                     for line in out.splitlines() if line.strip()})
    return ", ".join(groups[:8]) + (f" (+{len(groups) - 8} more)" if len(groups) > 8 else "")


Rows = list[tuple[str, bool, str]]


def python_rows(python: str, rc: int, out: str, err: str, gres: str | None,
                partition: str | None, profile: str) -> tuple[Rows, SiteVersions | None]:
    """``xffl profiles check``'s rows from the full probe's answer (exit status, stdout,
    stderr): xffl importable, its versions, its exchange format against this xffl's, GPUs;
    and the answer itself (None when there was none)."""
    versions = parse_probe(out) if rc == 0 else None
    if versions is None:
        last = (err.strip().splitlines() or [f"exit {rc}" if rc else "no answer to the probe"])
        said = "".join(c if c.isprintable() else "?" for c in last[-1])[:200]
        return [("xffl importable", False, f"{python}: {said}")], None
    rows: Rows = [("xffl importable", versions.error is None,
             python if versions.error is None else f"{python}: {versions.error}"),
            ("versions", True, versions.summary())]
    problem = format_problem(python, versions, profile)
    rows.append(("exchange format", problem is None, problem or
                 f"{versions.format}, as this xffl {xffl_version()} reads"))
    rows.append(("gpus", True, gpu_detail(versions, gres, partition)))
    return rows, versions
