"""`xffl profiles`: list, show and check the site profiles."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from xffl.cli import profiles_image
from xffl.cli.common import XfflCommand, XfflSubGroup, console, handle_errors, print_json
from xffl.cli.options import JsonOpt
from xffl.cli.tables import Markup, Rows
from xffl.core.errors import ExitCode

app = typer.Typer(cls=XfflSubGroup, help="List, show, copy (init) and check site profiles, and "
                  "write a site's container image definition.", no_args_is_help=True)
app.command("image", cls=XfflCommand)(profiles_image.image)

NameArg = Annotated[str, typer.Argument(
        metavar="NAME", help="Profile name (file NAME.yaml).")]


@app.command("list", cls=XfflCommand)
@handle_errors
def list_profiles(json_out: JsonOpt = False) -> None:
    """List the site profiles xffl can find, with where each one comes from.

    Example: xffl profiles list
    """
    from xffl.site_profiles.lookup import available, load_profile_file
    from xffl.site_profiles.schema import SshConnector

    rows = []
    for name, path in sorted(available().items()):
        profile = load_profile_file(path)
        conn = profile.connector
        rows.append({
            "name": name, "connector": conn.type,
            "host": (conn.host + (f":{conn.port}" if conn.port else ""))
            if isinstance(conn, SshConnector) else "",
            "scheduler": "slurm" if profile.slurm else "none",
            "partition": (profile.slurm.partition or "") if profile.slurm else "",
            "source": str(path),
        })
    if json_out:
        print_json(rows)
        return
    table = Rows(("name", "connector", "host", "scheduler", "partition", "source"),
                 text=("host", "source"),
                 compact=("name", "connector", "host", "partition", "source"))
    for r in rows:
        table.add(*(r[k] for k in ("name", "connector", "host", "scheduler", "partition",
                                       "source")))
    table.print()


@app.command("init", cls=XfflCommand)
@handle_errors
def init(
    name: Annotated[str, typer.Argument(
        metavar="NAME", help="A bundled template (`xffl profiles list`).")],
    force: Annotated[bool, typer.Option("--force", help="Replace the copy if it exists.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Copy a bundled profile template, comments included, to your profiles to fill in.

    Example: xffl profiles init leonardo
    """
    from xffl.site_profiles.lookup import install_template

    target = install_template(name, replace=force)
    if json_out:
        print_json({"profile": name, "path": str(target)})
    else:
        console.print(f"wrote {target}: fill in every YOUR_... value, then `xffl profiles check "
                      f"{name}`.", soft_wrap=True)


@app.command("show", cls=XfflCommand)
@handle_errors
def show(name: NameArg, json_out: JsonOpt = False) -> None:
    """Print one site profile: its file as written, comments included (--json: every field,
    defaults filled in).

    Example: xffl profiles show leonardo
    """
    from xffl.site_profiles.lookup import available, find_profile

    profile = find_profile(name)  # validated first: an unknown or broken one is exit 2
    if json_out:
        print_json(profile.model_dump(mode="json"))
    else:  # plain stdout: the console would wrap long lines and break the YAML
        path = available()[name]
        sys.stdout.write(f"# {path}\n{path.read_text()}")


@app.command("check", cls=XfflCommand)
@handle_errors
def check(name: NameArg, data: Annotated[Path | None, typer.Option(
        "--data", metavar="JOB", help="Also check the data folders (and peft, for LoRA) of "
        "JOB's sites on this profile, as `xffl submit` does.")] = None,
           json_out: JsonOpt = False) -> None:
    """Check a site: SSH login (host key verified), SLURM, partition, workdir, and its Python:
    xffl importable, its versions (Python, xffl and its exchange format, torch and its CUDA or
    ROCm build, transformers) and GPUs (those torch sees there, the partition's GRES).

    Exit 0 when every check passes, 3 when the connection, login or host key fails (the
    checks it left unreached are listed as "not run"), 1 when connected but a check failed.

    Example: xffl profiles check leonardo --data job.yaml
    """
    from xffl.site_profiles.checks import check_site
    from xffl.site_profiles.lookup import find_profile

    loaded = None
    if data is not None:  # a broken job is exit 2 before any login
        from xffl.jobs.spec.load import load_job

        loaded = load_job(data)
    result = check_site(name, find_profile(name))
    if loaded is not None:
        from xffl.workflows.site_ready import data_rows, data_site_names

        if result.connected:
            for check_row in data_rows(loaded, name):
                result.add(*check_row)
        else:
            result.not_checked += [f"data {s}" for s in data_site_names(loaded, name)]
    if json_out:
        print_json(result.as_dict())
    else:
        table = Rows(("check", "ok", "detail"), title=f"site {name}", text=("detail",))
        for row, ok, detail in result.rows:
            table.add(row, Markup("[green]yes[/green]" if ok else "[red]NO[/red]"), detail)
        for row in result.not_checked:
            table.add(row, Markup("[yellow]not run[/yellow]"),
                      "not reached: a check above failed first")
        table.print()
    if not result.connected:
        raise typer.Exit(int(ExitCode.CONNECTION))
    if not result.ok:
        raise typer.Exit(int(ExitCode.RUN_FAILED))


@app.command("install", cls=XfflCommand)
@handle_errors
def install(name: NameArg, find_links: Annotated[list[Path] | None, typer.Option(
        "--find-links", metavar="DIR", help="Build the site's wheelhouse from the wheels in "
        "DIR only (no package index here either); repeatable.")] = None,
            json_out: JsonOpt = False) -> None:
    """Install this xffl, its pinned dependencies and a torch in a venv of the site's
    workdir, over the profile's SSH login; then set the profile's python to it.

    From the index the profile names (install.index_url), or else from a wheelhouse built
    here for the site's Python and platform and uploaded (pip runs there with --no-index).
    torch is the site's own (install.torch: site, e.g. its module) or comes from a torch
    index URL. The new venv becomes current only once it answers xffl's probe; a second
    install with nothing to change does nothing.

    Example: xffl profiles install leonardo
    """
    import time

    from xffl.cli.common import err_console
    from xffl.site_profiles.install import install as install_site

    start = time.monotonic()
    with err_console.status(f"installing xffl at {name}") as status:
        def step(text: str) -> None:
            err_console.print(f"  {text}", soft_wrap=True, highlight=False, markup=False)
            status.update(text)

        done = install_site(name, find_links or [], step)
    seconds = round(time.monotonic() - start, 1)
    if json_out:
        print_json({"profile": name, "python": done.python, "venv": done.venv,
                    "changed": done.changed, "profile_file": str(done.profile_file),
                    "seconds": seconds})
        return
    what = "installed" if done.changed else "already installed, nothing changed"
    console.print(f"site {name}: xffl {what} in {done.venv} "
                  f"({seconds:.1f} s); {done.profile_file}: python: "
                  f"{done.python}", soft_wrap=True, markup=False)
