"""The SiteProfile schema: connection, launcher, environment and paths of one facility."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from xffl.core.names import check_name
from xffl.core.validation import PathText, StrictModel
from xffl.schedulers.base import Scheduler
from xffl.schedulers.slurm import SLURM
from xffl.site_profiles.container import GPU_RUNTIMES as GPU_RUNTIMES
from xffl.site_profiles.container import ContainerSpec
from xffl.site_profiles.install_spec import InstallSpec
from xffl.site_profiles.shell_text import ENV_NAME_RE as ENV_NAME_RE
from xffl.site_profiles.shell_text import WORKDIR_PLACEHOLDERS as WORKDIR_PLACEHOLDERS
from xffl.site_profiles.shell_text import WORKDIR_PUNCTUATION as WORKDIR_PUNCTUATION
from xffl.site_profiles.shell_text import shell_unsafe_char as shell_unsafe_char
from xffl.site_profiles.shell_text import template_text as template_text
from xffl.site_profiles.shell_text import workdir_text


class LocalConnector(StrictModel):
    """The facility is this machine: StreamFlow's local connector runs the steps."""

    type: Literal["local"] = "local"


class JumpHost(StrictModel):
    """A bastion the login node is reached through (OpenSSH's ProxyJump)."""

    host: str = Field(description="host name or a Host alias of ~/.ssh/config")
    port: int | None = Field(default=None, ge=1, le=65535)
    user: str | None = None
    key_file: PathText | None = Field(default=None, description="identity file; null = ssh-agent")

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: object) -> object:
        """``[user@]host[:port]`` as ProxyJump writes it."""
        return parse_destination(value) if isinstance(value, str) else value


def parse_destination(text: str) -> dict[str, Any]:
    """``[user@]host[:port]`` as a dict with host, and user/port when given."""
    user, _, rest = text.rpartition("@")
    host, sep, port = rest.rpartition(":") if rest.count(":") == 1 else (rest, "", "")
    if not host:
        raise ValueError("no host; write [user@]host[:port]")
    out: dict[str, Any] = {"host": host}
    if user:
        out["user"] = user
    if sep:
        if not port.isdigit():
            raise ValueError(f"the port {port!r} is not a number; write [user@]host[:port]")
        out["port"] = int(port)
    return out


class SshTransfer(StrictModel):
    """StreamFlow's SSH settings that decide whether multi-GB checkpoints cross slow links.

    xffl's SSH connector moves a checkpoint's files (a large file's byte ranges) over
    ``streams`` channels at once, in ``buffer_size`` pieces; a copy whose connection drops
    (or moves nothing for ``connect_timeout`` seconds) goes on from its checksummed prefix,
    up to ``retries`` times ``retry_delay`` seconds apart, before the site's step fails (and
    the round's own ``failure.retries`` take over). Transfers run after the SLURM job, so
    they do not count against its time limit; each copy has a deadline of its own: its bytes
    at 1 MB/s plus ``connect_timeout`` and ``retry_delay`` per attempt, and never more than
    ``failure.round_timeout`` (the round deadline under ``late: adopt``).
    """

    connect_timeout: int = Field(default=60, ge=1, le=3600,
                                 description="seconds to establish one SSH connection")
    retries: int = Field(default=5, ge=0, le=100,
                         description="resumptions of one dropped copy, and consecutive "
                         "connection errors, before giving up")
    retry_delay: int = Field(default=10, ge=0, le=3600,
                             description="seconds between connection attempts")
    buffer_size: int = Field(default=4 << 20, ge=4096, le=1 << 30,
                             description="bytes per read/write of a file transfer")
    streams: int = Field(default=4, ge=1, le=64, description="SSH channels one copy "
                         "uses at once, at most: a checkpoint's files (a large file's byte "
                         "ranges) move side by side; one channel is bound by its window over "
                         "the round trip")
    streams_from_rtt: bool = Field(default=True, description="measure the round trip "
                                   "before a copy and use fewer channels where one window "
                                   "covers it (one up to 2.1 ms, all from 6.3 ms on); false "
                                   "always uses `streams`")
    copy_factor: float = Field(
        default=4.0, ge=1, le=1000, description="one copy back from the site (an update) may "
        "hold this many times the files and bytes of the run's round-0 global, plus 64 MiB and "
        "64 entries for its JSON files; more is refused before it is written")


class SshConnector(StrictModel):
    """The facility's login node, reached over SSH; host keys are always verified.

    ``host`` may be a Host alias of the user's ~/.ssh/config (HostName, Port, User,
    IdentityFile, CertificateFile and ProxyJump are read from it); a value given here wins.
    A key's OpenSSH certificate is found as ``KEY-cert.pub``, the way ssh finds it.
    """

    type: Literal["ssh"] = "ssh"
    host: str = Field(description="login node host name, or a Host alias of ~/.ssh/config")
    port: int | None = Field(default=None, ge=1, le=65535,
                             description="null = ~/.ssh/config's Port, else 22")
    user: str | None = None
    key_file: PathText | None = Field(default=None, description="identity file; null = ssh-agent")
    certificate: PathText | None = Field(
        default=None, description="OpenSSH certificate of key_file; null = KEY-cert.pub if "
        "it exists (or ~/.ssh/config's CertificateFile)")
    jump: JumpHost | None = Field(default=None, description="bastion ([user@]host[:port])")
    known_hosts: PathText | None = Field(
        default=None, description="known_hosts for xffl's own connections (default ~/.ssh)"
    )
    ssh_config: bool = Field(default=True, description="read ~/.ssh/config for host aliases")
    transfer: SshTransfer = Field(default_factory=SshTransfer)
    transfer_host: JumpHost | None = Field(
        default=None, description="the facility's data transfer node ([user@]host[:port]): "
        "bulk copies go through it, jobs through the login node; user and key_file default "
        "to the login's, a jump host is the login's too")
    renew: str | None = Field(
        default=None, description="the command that renews the login credential (shown when "
        "it has expired), e.g. the facility's `step ssh certificate ...`")



_SHELL_UNSAFE = set('"$`\\')


def _slurm_text(value: str | None) -> str | None:
    """A SLURM value lands on an sbatch command line and in #SBATCH lines: keep it one word-ish."""
    if value is None:
        return None
    if any(ord(c) < 32 or ord(c) == 127 for c in value) or _SHELL_UNSAFE & set(value):
        raise ValueError(f"{value!r} holds a control character or one of \" $ ` \\, which "
                         "would break the batch script; use the plain SLURM value")
    return template_text(value)


def _slurm_lines(value: list[str] | None) -> list[str] | None:
    """Every extra #SBATCH option must be a single line."""
    for item in value or ():
        if any(ord(c) < 32 or ord(c) == 127 for c in item):
            raise ValueError(f"{item!r} holds a control character (newline, tab, ...); give "
                             "one #SBATCH option per list item")
        template_text(item)
    return value


def slurm_time_seconds(text: str) -> int | None:
    """A SLURM time limit in seconds (None for UNLIMITED/INFINITE); ValueError if malformed.

    The forms sbatch accepts: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
    """
    if text.strip().upper() in ("UNLIMITED", "INFINITE"):
        return None
    days, dash, rest = text.strip().rpartition("-")
    parts = rest.split(":")
    if not all(p.isdigit() for p in parts) or (dash and not days.isdigit()) or len(parts) > 3:
        raise ValueError("not a SLURM time limit; use MM, HH:MM:SS or D-HH:MM:SS")
    nums = [int(p) for p in parts]
    if dash:  # D-HH[:MM[:SS]]
        nums += [0] * (3 - len(nums))
        return int(days) * 86400 + nums[0] * 3600 + nums[1] * 60 + nums[2]
    if len(nums) == 1:
        return nums[0] * 60
    if len(nums) == 2:
        return nums[0] * 60 + nums[1]
    return nums[0] * 3600 + nums[1] * 60 + nums[2]


def _slurm_time(value: str | None) -> str | None:
    if value is not None:
        slurm_time_seconds(value)
    return value


_TEXT_FIELDS = ("partition", "account", "qos", "time", "mem", "constraint")


class SlurmSpec(StrictModel):
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

    _text = field_validator(*_TEXT_FIELDS)(_slurm_text)
    _lines = field_validator("extra")(_slurm_lines)
    _time = field_validator("time")(_slurm_time)

    def sbatch_options(self) -> list[str]:
        """The ``--option=value`` sbatch options beyond nodes/ntasks/time, ``extra`` last."""
        return SLURM.batch_options(self.model_dump(exclude={"extra"}), self.extra)


class SlurmOverride(StrictModel):
    """A job spec's per-site overrides of the profile's SlurmSpec: the same keys, all optional.

    A key left out keeps the profile's value; ``null`` clears an optional one (``account:
    null``); ``extra`` replaces the profile's list. tests/jobs/test_slurm_overrides.py keeps
    the keys and constraints equal to SlurmSpec's.
    """

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    nodes: int | None = Field(default=None, ge=1)
    ntasks_per_node: int | None = Field(default=None, ge=1)
    gpus_per_node: int | None = Field(default=None, ge=0)
    cpus_per_task: int | None = Field(default=None, ge=1)
    mem: str | None = None
    constraint: str | None = None
    extra: list[str] | None = None
    polling_interval: float | None = Field(default=None, gt=0)

    _text = field_validator(*_TEXT_FIELDS)(_slurm_text)
    _lines = field_validator("extra")(_slurm_lines)
    _time = field_validator("time")(_slurm_time)

    @field_validator("time", "nodes", "extra", "polling_interval", mode="before")
    @classmethod
    def _not_null(cls, value: object) -> object:
        if value is None:
            raise ValueError("cannot be null here; leave the key out to keep the profile's value")
        return value

    @model_serializer(mode="wrap")
    def _only_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Dump only the keys the job spec set, so job.json reads back the same overrides."""
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if k in self.model_fields_set}

    def apply(self, base: SlurmSpec) -> SlurmSpec:
        """``base`` with the keys set here replacing its values (validated as a SlurmSpec)."""
        return SlurmSpec.model_validate({**base.model_dump(),
                                         **self.model_dump(exclude_unset=True)})


class SiteProfile(StrictModel):
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
    python: PathText | None = Field(
        default=None,
        description="Python interpreter with xffl installed at the site; null = the coordinator's",
    )
    install: InstallSpec = Field(default_factory=InstallSpec,
                                 description="how `xffl profiles install` sets up xffl there")
    workdir: str = Field(
        default="{xffl_home}/sites/{site}",
        description="where relative data paths and scratch live at the site; "
        "{xffl_home} and {site} are substituted; letters, digits and _ . / - + , : @ % = only",
    )
    container: ContainerSpec | None = Field(
        default=None, description="run the training ranks inside this container image "
        "(srun/torchrun start `RUNTIME exec IMAGE python -m xffl.training` on the compute "
        "nodes); null = the ranks run `python` directly")
    env: dict[str, str] = Field(
        default_factory=dict, description="environment of the ranks; each value is literal "
        "text, exported shell-quoted (no $VAR or `...` expansion; use setup for that)")
    gpu_memory_gib: float | None = Field(
        default=None, gt=0, le=100_000, description="memory of one GPU (GiB): `xffl validate` "
        "checks the job's estimated peak per rank against it (null: no GPU check)")

    _name = field_validator("name")(check_name)
    _workdir_text = field_validator("workdir")(workdir_text)

    @property
    def batch(self) -> SlurmSpec | None:
        """The site's batch settings (its scheduler's section); None: no batch scheduler."""
        return self.slurm

    @property
    def scheduler(self) -> Scheduler | None:
        """The batch scheduler the site's rounds are submitted to; None: no batch scheduler."""
        return None if self.slurm is None else SLURM

    def batch_options(self) -> list[str]:
        """The scheduler's options of the site's batch settings (partition, ...), extra last."""
        if self.batch is None or self.scheduler is None:
            return []
        return self.scheduler.batch_options(self.batch.model_dump(exclude={"extra"}),
                                            self.batch.extra)

    def with_slurm(self, override: SlurmOverride | None) -> SiteProfile:
        """This profile with a job spec's SLURM overrides applied (ValueError: no SLURM here)."""
        if override is None or not override.model_fields_set:
            return self
        if self.slurm is None:
            raise ValueError(f"profile {self.name!r} has no slurm section")
        return self.model_copy(update={"slurm": override.apply(self.slurm)})

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key, text in value.items():
            if not ENV_NAME_RE.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name; use "
                                 "letters, digits and _, not starting with a digit")
            if "$(" in text or "${" in text:  # CWL's EnvVarRequirement evaluates them
                raise ValueError(f"the value of {key} holds '$(' or '${{', which CWL reads as "
                                 "an expression; give the plain value")
            if "\0" in text:
                raise ValueError(f"the value of {key} holds a NUL character, which no "
                                 "environment can hold; remove it")
            template_text(text)
        return value

    @field_validator("container")
    @classmethod
    def _container_fits(cls, value: ContainerSpec | None,
                        info: ValidationInfo) -> ContainerSpec | None:
        """The container can run where the profile says: a local image exists, GPUs pass."""
        if value is None:
            return None
        slurm, connector = info.data.get("slurm"), info.data.get("connector")
        if slurm is None:
            raise ValueError("a container needs the profile's slurm section: its ranks are "
                             "wrapped in the batch script of the site's SLURM jobs; add slurm: "
                             "or remove container:")
        if "," in info.data.get("workdir", ""):
            raise ValueError("the workdir holds ',', which a container's bind list would "
                             "split; use a workdir without commas")
        gpus_asked = bool(getattr(slurm, "gpus_per_node", None))
        if gpus_asked and value.gpus == "none":
            launcher = info.data.get("launcher", "torchrun")
            raise ValueError(
                f"slurm.gpus_per_node asks for GPUs, but gpus: none keeps them out of the "
                f"{value.runtime} container the ranks run in (launcher: {launcher}); set "
                "gpus: nv (NVIDIA) or rocm (AMD)" + (
                    ", with runtime: apptainer or singularity" if value.runtime not in
                    GPU_RUNTIMES else ""))
        if isinstance(connector, LocalConnector) and not Path(value.image).exists():
            raise ValueError(f"the image {value.image} does not exist on this machine (the "
                             "site's); build it there (`xffl profiles image` writes the "
                             "definition) or fix image:")
        return value

    @field_validator("setup")
    @classmethod
    def _setup_lines(cls, value: list[str]) -> list[str]:
        for line in value:
            template_text(line)
        return value
