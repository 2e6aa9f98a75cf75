"""`xffl profiles image`: write the Apptainer definition of a site's image, with xffl's wheel."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from xffl.cli.common import console, handle_errors, print_json
from xffl.cli.options import JsonOpt, output_option


@handle_errors
def image(
    name: Annotated[str, typer.Argument(metavar="NAME", help="Profile name (file NAME.yaml).")],
    output: Annotated[Path | None, output_option(
        "Folder to write (default: ./xffl-image-NAME).")] = None,
    wheel: Annotated[Path | None, typer.Option(
        "--wheel", metavar="WHL", help="The xffl wheel to put in the image (default: built "
        "from the source folder this xffl was installed from).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Write an Apptainer definition (xffl.def) that installs this exact xffl, as a wheel
    beside it, and the exact versions of its dependencies (requirements.txt) on the base
    image the profile's container names (NGC PyTorch by default), and say how to build it.

    Example: xffl profiles image leonardo -o leonardo-image
    """
    from xffl.site_profiles.image import write_image_files
    from xffl.site_profiles.lookup import find_profile

    profile = find_profile(name)
    files = write_image_files(profile, output or Path(f"xffl-image-{name}"), wheel)
    if json_out:
        print_json({"profile": name, "folder": str(files.folder),
                    "definition": str(files.definition), "wheel": files.wheel,
                    "image": files.image, "build": files.build})
        return
    console.print(f"wrote {files.definition}, {files.wheel} and requirements.txt in "
                  f"{files.folder}. Copy the folder to a machine with apptainer (the "
                  "facility's login node), then build the image there:", soft_wrap=True)
    for line in files.build:
        console.print(f"  {line}", soft_wrap=True, markup=False, highlight=False)
