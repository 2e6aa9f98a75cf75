"""The SiteProfile schema: connection, launcher, environment and paths of one facility."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from xffl.jobs.spec import check_name


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LocalConnector(_Strict):
    """The facility is this machine: StreamFlow's local connector runs the steps."""

    type: Literal["local"] = "local"


class SiteProfile(_Strict):
    """Everything xffl needs to know about a facility, independent of any one job."""

    name: str
    description: str = ""
    connector: LocalConnector = Field(default_factory=LocalConnector)
    launcher: Literal["torchrun", "srun", "none"] = Field(
        default="torchrun", description="how the training ranks are started inside a site job"
    )
    python: str | None = Field(
        default=None,
        description="Python interpreter with xffl installed at the site; null = the coordinator's",
    )
    workdir: str = Field(
        default="{xffl_home}/sites/{site}",
        description="where relative data paths and scratch live at the site; "
        "{xffl_home} and {site} are substituted",
    )
    env: dict[str, str] = Field(default_factory=dict, description="environment of the ranks")

    _name = field_validator("name")(check_name)

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not key.replace("_", "a").isalnum() or key[0].isdigit():
                raise ValueError(f"{key!r} is not a valid environment variable name")
        return value
