"""A site's container image: the install steps, and the Apptainer definition that runs them.

``xffl profiles image SITE`` writes, into one folder, this very xffl as a wheel, the exact
versions of its dependencies installed here (``requirements.txt``) and ``xffl.def``: an
Apptainer definition on the base the profile names (NGC PyTorch by default) whose ``%post``
runs :func:`install_steps`. The same steps, rendered from the same template, are what the
test suite runs inside a Charliecloud image, so the definition is tested by building, not by
reading it. torch is the base image's own (built for the facility's GPUs): it is neither
pinned nor reinstalled, and every install runs with ``--no-deps`` so pip never swaps it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from xffl.core.errors import InvalidInput
from xffl.site_profiles import own_wheel
from xffl.site_profiles.container import ContainerSpec
from xffl.site_profiles.pins import pinned_requirements
from xffl.site_profiles.schema import SiteProfile

if TYPE_CHECKING:
    import jinja2

DEFINITION_FILE = "xffl.def"
REQUIREMENTS_FILE = "requirements.txt"
IMAGE_DIR = "/opt/xffl"  # where the image keeps the wheel and requirements.txt


def _jinja() -> jinja2.Environment:
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("xffl.workflows.plan", "templates"),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)


def install_steps(python: str, folder: str, wheel: str) -> list[str]:
    """The shell lines that install xffl (``folder/wheel``) and its pinned dependencies
    (``folder/requirements.txt``) into the image's ``python``, and check the result."""
    template = _jinja().get_template("install_steps.sh.j2")
    text: str = template.render(python=python, folder=folder, wheel=wheel,
                                requirements=REQUIREMENTS_FILE)
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


def build_wheel(out: Path, wheel: Path | None = None) -> str:
    """This xffl's wheel in ``out`` (``wheel`` copied, or built from its source); its name."""
    if wheel is not None:
        if not wheel.is_file() or not wheel.name.startswith("xffl-") \
                or wheel.suffix != ".whl":
            raise InvalidInput(f"--wheel {wheel}: not an xffl wheel file; give the path of "
                               "xffl-VERSION-py3-none-any.whl")
        shutil.copyfile(wheel, out / wheel.name)
        return wheel.name
    return own_wheel.build_wheel(out, "pass --wheel PATH (the xffl wheel you installed)").name


@dataclass(frozen=True)
class ImageFiles:
    """What ``xffl profiles image`` wrote, and how to build the image from it."""

    folder: Path
    definition: Path
    wheel: str
    image: str
    build: list[str]


def site_container(profile: SiteProfile) -> ContainerSpec:
    """The profile's container, or Apptainer on NGC PyTorch for a profile without one."""
    if profile.container is not None:
        return profile.container
    return ContainerSpec(runtime="apptainer", image=f"/xffl-{profile.name}.sif")


def image_name(profile: SiteProfile) -> str:
    """The file name ``apptainer build`` writes: the profile's image's, else xffl-SITE.sif."""
    image = site_container(profile).image
    return Path(image).name if image.endswith(".sif") else f"xffl-{profile.name}.sif"


def definition(profile: SiteProfile, wheel: str, version: str) -> str:
    """The Apptainer definition of ``profile``'s image (xffl ``version`` from ``wheel``)."""
    container = site_container(profile)
    image = image_name(profile)
    template = _jinja().get_template("apptainer.def.j2")
    text: str = template.render(
        site=profile.name, version=version, base=container.base, wheel=wheel,
        folder=IMAGE_DIR, requirements=REQUIREMENTS_FILE, image=image,
        target=container.image if profile.container is not None else "",
        steps=install_steps(container.python, IMAGE_DIR, wheel))
    return text


def write_image_files(profile: SiteProfile, out: Path, wheel: Path | None = None) -> ImageFiles:
    """Write ``out``/xffl.def, requirements.txt and the xffl wheel for ``profile``'s image."""
    out.mkdir(parents=True, exist_ok=True)
    name = build_wheel(out, wheel)
    version = name.split("-")[1]
    (out / REQUIREMENTS_FILE).write_text(
        "# the coordinator's exact versions of xffl's dependencies (torch: the base image's)\n"
        + "".join(f"{line}\n" for line in pinned_requirements()))
    text = definition(profile, name, version)
    path = out / DEFINITION_FILE
    path.write_text(text)
    image = image_name(profile)
    return ImageFiles(folder=out, definition=path, wheel=name, image=image,
                      build=[f"cd {out.name}", f"apptainer build {image} {DEFINITION_FILE}"])
