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


class SshConnector(_Strict):
    """The facility's login node, reached over SSH; host keys are always verified."""

    type: Literal["ssh"] = "ssh"
    host: str
    port: int = Field(default=22, ge=1, le=65535)
    user: str | None = None
    key_file: str | None = Field(default=None, description="identity file; null = ssh-agent")
    known_hosts: str | None = Field(
        default=None, description="known_hosts for xffl's own connections (default ~/.ssh)"
    )


class SlurmSpec(_Strict):
    """SLURM defaults of the facility (a job spec may override them per site)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "01:00:00"
    nodes: int = Field(default=1, ge=1)
    ntasks_per_node: int | None = Field(default=None, ge=1)
    gpus_per_node: int | None = Field(default=None, ge=0)
    cpus_per_task: int | None = Field(default=None, ge=1)
    mem: str | None = None
    constraint: str | None = None
    extra: list[str] = Field(default_factory=list, description="more #SBATCH options")
    polling_interval: float = Field(default=5.0, gt=0, description="seconds between squeue polls")


class SiteProfile(_Strict):
    """Everything xffl needs to know about a facility, independent of any one job."""

    name: str
    description: str = ""
    connector: LocalConnector | SshConnector = Field(
        default_factory=LocalConnector, discriminator="type"
    )
    slurm: SlurmSpec | None = Field(default=None, description="set for SLURM facilities")
    setup: list[str] = Field(
        default_factory=list, description="shell lines run before training (module load, ...)"
    )
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
