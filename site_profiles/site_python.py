"""What `xffl profiles install` asks the site's base Python: its version and platform (the
wheels it takes), whether it can make a venv, and whether it imports torch."""

from __future__ import annotations

import json
import shlex
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

MARKER = "XFFL-SITE-PYTHON "
_SOURCE = """import json, platform, sys
out = {"version": "%d.%d" % sys.version_info[:2], "full": platform.python_version(),
       "implementation": sys.implementation.name, "machine": platform.machine(),
       "system": sys.platform, "libc": "-".join(platform.libc_ver())}
try:
    import venv, ensurepip
    out["venv"] = None
except Exception as exc:
    out["venv"] = (type(exc).__name__ + ": " + str(exc))[:200]
if "torch" in sys.argv[1:]:  # found, not imported: importing torch takes seconds
    try:
        import importlib.metadata, importlib.util
        if importlib.util.find_spec("torch") is None:
            raise ModuleNotFoundError("No module named 'torch'")
        out["torch"] = importlib.metadata.version("torch")
    except Exception as exc:
        out["torch_error"] = (type(exc).__name__ + ": " + str(exc))[:200]
print("MARKER" + json.dumps(out))
""".replace("MARKER", MARKER)

Word = Annotated[str, StringConstraints(max_length=64, pattern=r"^[0-9A-Za-z._+-]*$")]
Said = Annotated[str, StringConstraints(max_length=200, pattern=r"^[ -~]*$")]


class SitePython(BaseModel):
    """The site Python's answer: every field its word, checked as such."""

    model_config = ConfigDict(extra="forbid")
    version: Annotated[str, StringConstraints(pattern=r"^3\.[0-9]{1,2}$")]
    full: Word
    implementation: Word
    machine: Word
    system: Word
    libc: Word
    venv: Said | None = None
    torch: Word | None = None
    torch_error: Said | None = None

    def platforms(self) -> list[str]:
        """pip's ``--platform`` tags of the wheels this Python takes (manylinux for its glibc,
        newest first)."""
        if self.system != "linux":
            return []
        name, _, glibc = self.libc.partition("-")
        major, _, minor = glibc.partition(".")
        if name != "glibc" or major != "2" or not minor.isdigit():
            return [f"linux_{self.machine}"]
        tags = [f"manylinux_2_{m}_{self.machine}" for m in range(int(minor), 16, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        return tags + [f"{tag}_{self.machine}" for m, tag in legacy.items() if int(minor) >= m]

    def describe(self) -> str:
        """``Python 3.11.7 (linux x86_64, glibc-2.36)``."""
        return f"Python {self.full} ({self.system} {self.machine}, {self.libc or 'no glibc'})"


def probe_command(python: str, torch: bool) -> str:
    """The shell command that asks ``python`` (``torch``: also its torch)."""
    return (f"{shlex.quote(python)} -c {shlex.quote(_SOURCE)}" + (" torch" if torch else ""))


def parse(out: str) -> SitePython | None:
    """The answer in the site's stdout (its last marked line), or None."""
    lines = [line for line in out.splitlines() if line.startswith(MARKER)]
    if not lines or len(lines[-1]) > 4096:
        return None
    try:
        return SitePython.model_validate(json.loads(lines[-1][len(MARKER):]))
    except (ValueError, ValidationError):
        return None


#: digest of what a venv holds (its wheelhouse's key), written into it once it works
STAMP = "xffl-install.json"
Digest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16,64}$")]


class Stamp(BaseModel):
    """What an installed venv says it holds: the wheelhouse key and the xffl version."""

    model_config = ConfigDict(extra="forbid")
    key: Digest
    xffl: Word
    requirements: int = Field(ge=0, le=10_000)
