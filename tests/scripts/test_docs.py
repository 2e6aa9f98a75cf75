"""The docs: the job spec reference is what the models say; the getting-started commands run."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import QUICKSTART_COMMANDS, REPO

_spec = importlib.util.spec_from_file_location("docs_reference",
                                               REPO / "scripts" / "docs_reference.py")
assert _spec is not None and _spec.loader is not None
docs_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_reference)


def test_the_job_spec_reference_is_generated_from_the_models() -> None:
    assert docs_reference.main(["--check"]) == 0, "run python scripts/docs_reference.py"
    page = docs_reference.OUT.read_text()
    from xffl.jobs.spec.schema import JobSpec

    for name, field in JobSpec.model_fields.items():  # every field, with its description
        assert f"| `{name}` |" in page and (field.description or "") in page


def _xffl_commands(markdown: str) -> list[list[str]]:
    """Every `xffl ...` command in the page's bash blocks (``&&`` chains split)."""
    blocks = re.findall(r"```bash\n(.*?)```", markdown, flags=re.S)
    commands = []
    for block in blocks:
        for line in block.splitlines():
            for part in line.split("#")[0].split("&&"):
                argv = shlex.split(part)
                if argv and argv[0] == "xffl":
                    commands.append(argv[1:])
    return commands


def test_every_getting_started_command_is_what_the_quickstart_fixture_runs() -> None:
    """docs/getting-started.md and the README's "Try it" name only commands that
    tests/conftest.py's quickstart_run runs (which adds only output flags to them)."""
    readme = (REPO / "README.md").read_text()
    try_it = readme.split("## Try it", 1)[1].split("\n## ", 1)[0]
    for page in ((REPO / "docs" / "getting-started.md").read_text(), try_it):
        commands = _xffl_commands(page)
        assert commands == [argv[:len(c)] for c, argv in zip(commands, QUICKSTART_COMMANDS,
                                                             strict=True)]


def test_the_strict_docs_build_fails_on_a_broken_link(tmp_path: Path) -> None:
    """What scripts/test.sh relies on: mkdocs.yml's strict build refuses a dead link."""
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path)
    with open(tmp_path / "docs" / "reports.md", "a") as page:
        page.write("\nSee [the missing page](nowhere.md).\n")
    done = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict",
                           "-d", str(tmp_path / "site")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "nowhere.md" in done.stderr, done.stderr
