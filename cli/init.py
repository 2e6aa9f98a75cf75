"""`xffl init`: a starter job (and the profile templates it names) in a folder, comments kept."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

import typer

from xffl.cli.common import console, handle_errors, print_json
from xffl.cli.options import JsonOpt
from xffl.core.errors import InvalidInput
from xffl.core.files import atomic_write

# template -> (the job spec shipped in xffl.jobs, the bundled profiles it names)
TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    "quickstart": ("quickstart.yaml", ()),
    "two-facilities": ("llama2-7b-two-facilities.yaml", ("leonardo", "karolina")),
    "llama3-8b": ("llama3.1-8b-two-facilities.yaml", ("leonardo", "karolina")),
    "llama3-8b-lora": ("llama3.1-8b-lora.yaml", ("leonardo", "karolina")),
    "sft-lora": ("sft-lora.yaml", ()),
}
Template = Literal["quickstart", "two-facilities", "llama3-8b", "llama3-8b-lora", "sft-lora"]
DATA_PLACEHOLDER = re.compile(r"DATA_DIR(/[A-Za-z0-9_/]+)")


def _with_data(text: str, data: Path) -> str:
    """The sft-lora job with its data paths (DATA_DIR/...) made absolute, quoted for YAML."""
    return DATA_PLACEHOLDER.sub(lambda m: json.dumps(str(data) + m.group(1)), text)


@handle_errors
def init(
    folder: Annotated[Path, typer.Argument(
        metavar="DIR", help="Folder to write job.yaml into.")] = Path("."),
    template: Annotated[Template, typer.Option(
        "--template", "-t", help="quickstart: two sites on this machine; two-facilities: "
        "LLaMA-2 7B on Leonardo and Karolina (the xFFL paper's setting); llama3-8b: Llama 3.1 "
        "8B there, the whole model, tp 4; llama3-8b-lora: its LoRA fine-tuning; sft-lora: "
        "LoRA instruction tuning of a tiny chat model on this machine (data written to "
        "DIR/data)."
    )] = "quickstart",
    force: Annotated[bool, typer.Option("--force", help="Replace DIR/job.yaml if it "
                                        "exists.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write a starter job spec into DIR (and copy the profile templates it needs).

    Example: xffl init demo && xffl submit demo/job.yaml --wait
    """
    from xffl.site_profiles.lookup import install_template, installed_dirs

    spec_file, profiles = TEMPLATES[template]
    job = folder / "job.yaml"
    if job.is_symlink():  # written through, it would replace whatever the link names
        raise InvalidInput(f"{job} is a symbolic link; xffl init writes no file through a "
                           "link: remove it, or choose another folder.")
    if job.exists() and not force:
        raise InvalidInput(f"{job} exists; choose another folder, or --force to replace it.")
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    # a new file renamed over the name: a link made meanwhile is replaced, never followed
    text = (resources.files("xffl.cli.examples") / spec_file).read_bytes()
    written, kept = [str(job)], []
    if template == "sft-lora":
        from xffl.training.sft_demo import write_demo

        written += [str(p) for p in write_demo(folder.resolve())]
        text = _with_data(text.decode(), folder.resolve() / "data").encode()
    atomic_write(job, text)
    for name in profiles:  # the user's own profiles folder: a job's folder cannot shadow them
        mine = installed_dirs()[0] / f"{name}.yaml"
        if mine.exists():
            kept.append(str(mine))
        else:
            written.append(str(install_template(name)))
    if as_json:
        print_json({"template": template, "job": str(job), "written": written, "kept": kept})
        return
    for path in written:
        console.print(f"wrote {path}", soft_wrap=True)
    for path in kept:
        console.print(f"kept  {path} (yours already)", soft_wrap=True)
    step = ("fill in every YOUR_... value (`xffl validate` lists those left), then "
            if profiles else "")
    console.print(f"next: {step}`xffl submit {job} --wait`", soft_wrap=True)
