"""A site's container: the profile section, and the command line its ranks run inside it."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from xffl.core.validation import StrictModel, check_path_text
from xffl.site_profiles.shell_text import shell_unsafe_char, template_text

ContainerRuntime = Literal["apptainer", "singularity", "charliecloud"]
# the command each runtime is run with
RUNTIME_COMMANDS = {"apptainer": "apptainer", "singularity": "singularity",
                    "charliecloud": "ch-run"}
# the runtimes that pass the node's GPUs into a container at run time (--nv, --rocm)
GPU_RUNTIMES = ("apptainer", "singularity")
# in a container line, the launcher's working folder (it substitutes it before starting ranks)
CWD_WORD = "{cwd}"
# NGC's PyTorch image: torch built for the NVIDIA driver, CUDA, cuDNN and NCCL in one base
DEFAULT_BASE = "nvcr.io/nvidia/pytorch:25.01-py3"


def _container_path(value: str) -> str:
    """A path the container line passes to a shell: absolute and plain (no quoting needed)."""
    check_path_text(value)
    template_text(value)
    if not value.startswith("/"):
        raise ValueError(f"{value!r} is not an absolute path; give the path at the facility "
                         "from /")
    bad = shell_unsafe_char(value)
    if bad is not None or "{" in value:
        raise ValueError(f"{value!r} holds {bad or '{'!r}; use a path of letters, digits and "
                         "_ . / - + , : @ % =")
    return value


def _bind(value: str) -> str:
    """One extra bind, ``SRC[:DST]``: both absolute, plain paths, no comma (apptainer's list)."""
    parts = value.split(":")
    if len(parts) > 2 or "," in value:
        raise ValueError(f"{value!r} is not SRC or SRC:DST (one colon at most, no comma); "
                         "give one bind per list item")
    for part in parts:
        _container_path(part)
    return value


class ContainerSpec(StrictModel):
    """The container image the site's training ranks run in, and the runtime that runs it.

    The workdir (the round's job folders, the kept updates) and the job's data path are
    bound into the container at the same paths; ``binds`` adds more (the site's scratch,
    a shared model cache).
    """

    runtime: ContainerRuntime = Field(
        description="apptainer or singularity (`exec --nv IMAGE`), or charliecloud (`ch-run "
        "IMAGE --`; an image directory or SquashFS file)")
    image: str = Field(description="the image at the facility: an absolute path (a .sif file "
                       "for apptainer/singularity, a directory or .sqfs for charliecloud)")
    binds: list[Annotated[str, AfterValidator(_bind)]] = Field(
        default_factory=list, description="more SRC[:DST] folders to bind (absolute paths); "
        "the workdir and the data path are bound already")
    gpus: Literal["nv", "rocm", "none"] = Field(
        default="nv", description="how the node's GPUs reach the ranks: nv (--nv, NVIDIA), "
        "rocm (--rocm, AMD) or none (charliecloud: the image holds the GPU libraries, "
        "injected with ch-fromhost)")
    python: str = Field(default="python3", description="the Python inside the image that has "
                        "xffl (a name on the image's PATH or an absolute path)")
    base: str = Field(default=DEFAULT_BASE, description="the base image of the definition "
                      "`xffl profiles image` writes (NGC PyTorch; a ROCm PyTorch image for AMD)")

    _image = field_validator("image")(_container_path)

    @field_validator("python")
    @classmethod
    def _python(cls, value: str) -> str:
        if value.startswith("/"):
            return _container_path(value)
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", value):
            raise ValueError(f"{value!r} is neither an absolute path nor a plain command name "
                             "(letters, digits, _ . + -); give the image's python")
        return value

    @field_validator("base")
    @classmethod
    def _base(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:/@+-]*", value):
            raise ValueError(f"{value!r} is not an image reference (registry/name:tag); "
                             "e.g. nvcr.io/nvidia/pytorch:25.01-py3")
        return value

    @model_validator(mode="after")
    def _gpus_pass(self) -> ContainerSpec:
        if self.gpus != "none" and self.runtime not in GPU_RUNTIMES:
            raise ValueError(
                f"{self.runtime} cannot pass GPUs into the container at run time (no "
                f"--{self.gpus}); set gpus: none with an image that holds the GPU libraries "
                "(ch-fromhost), or use runtime: apptainer")
        return self


def binds(container: ContainerSpec, workdir: str, data_path: str) -> list[str]:
    """The binds of a round's ranks: the workdir, the data path outside it, then ``binds``."""
    out = [workdir.rstrip("/") or "/"]
    if not data_path.startswith(out[0].rstrip("/") + "/"):
        out.append(data_path)
    return out + [b for b in container.binds if b not in out]


def rank_python(container: ContainerSpec, bound: list[str]) -> list[str]:
    """The words that run the image's Python in the container, with ``bound`` bound.

    The launcher puts them where it would put ``python``: ``srun ... WORDS -m xffl.training``,
    or ``WORDS -m torch.distributed.run ...`` (torchrun and its ranks inside the container).
    """
    if container.runtime == "charliecloud":  # ch-run [--bind=SRC[:DST]]... IMAGE -- CMD
        # ch-run starts in the image's /, not in the folder it was started from: the
        # launcher puts its own folder (the round's job folder) for CWD_WORD. ch-run binds
        # the host's $TMPDIR (a CWL step's own temporary folder) at /tmp and cannot make a
        # mount point below it: folders under /tmp are reached through TMPDIR=/tmp instead
        under_tmp = [b for b in bound if ":" not in b and b.startswith("/tmp/")]
        return [*(["env", "TMPDIR=/tmp"] if under_tmp else []), "ch-run", f"--cd={CWD_WORD}",
                *(f"--bind={b}" for b in bound if b not in under_tmp),
                container.image, "--", container.python]
    gpus = {"nv": ["--nv"], "rocm": ["--rocm"], "none": []}[container.gpus]
    return [container.runtime, "exec", *gpus, *(w for b in bound for w in ("--bind", b)),
            container.image, container.python]
