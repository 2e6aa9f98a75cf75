"""A site profile's ``install:`` section: how `xffl profiles install` sets up xffl there."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from xffl.core.validation import PathText, StrictModel


def _url(value: str | None) -> str | None:
    """An index URL: http(s) or file, one word (it reaches the site's pip as one)."""
    if value is None:
        return None
    if not value.startswith(("https://", "http://", "file://")) or any(
            c.isspace() or not c.isprintable() for c in value):
        raise ValueError(f"{value!r} is not an index URL; give https://HOST/PATH (one word)")
    return value


class InstallSpec(StrictModel):
    """Where ``xffl profiles install SITE`` takes xffl, its dependencies and torch from."""

    python: PathText = Field(
        default="python3", description="the site's Python the venv is made from (after the "
        "profile's setup lines: a `module load` may put it on PATH)")
    index_url: str | None = Field(
        default=None, description="a package index the site's login node reaches; null = "
        "xffl builds a wheelhouse here for the site's Python and uploads it (pip runs there "
        "with --no-index)")
    torch: Literal["site"] | str = Field(
        default="site", description="`site`: the torch the site's Python already imports "
        "(its module), seen by the venv; else the index URL of a torch build (CUDA or ROCm), "
        "e.g. https://download.pytorch.org/whl/cu126, fetched by the site's pip")

    _index = field_validator("index_url")(_url)

    @field_validator("torch")
    @classmethod
    def _torch(cls, value: str) -> str:
        return value if value == "site" else str(_url(value))
