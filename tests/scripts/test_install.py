"""The install a new user follows: torch's CPU build from one source, and a quickstart that
says what it is doing before its first long step."""

from __future__ import annotations

import os
import re
import selectors
import shlex
import shutil
import signal
import subprocess
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import REPO

TORCH_CPU = REPO / "scripts" / "torch-cpu.txt"


def _torch_cpu() -> tuple[str, str]:
    """(index URL, requirement) of scripts/torch-cpu.txt, the one source of both."""
    lines = [ln.strip() for ln in TORCH_CPU.read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    index = [ln.split(None, 1)[1] for ln in lines if ln.startswith("--index-url")]
    pins = [ln for ln in lines if ln.startswith("torch")]
    assert len(index) == 1 and len(pins) == 1, lines
    return index[0], pins[0]


def _torch_lines(markdown: str) -> list[list[str]]:
    """Every `pip install torch...` command in the page's bash blocks, as argv."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.S):
        for line in block.splitlines():
            if "pip install torch" not in line:
                continue
            argv = shlex.split(line.split("#")[0])
            if len(argv) > 2 and argv[0].endswith("pip") and argv[1] == "install" \
                    and argv[2].startswith("torch"):
                found.append(argv)
    return found


def test_the_readmes_first_install_lines_take_torchs_cpu_build_from_the_one_source() -> None:
    """The README's "Try it" installs torch's CPU build before the wheel (else pip pulls the
    CUDA build: a 6 GB venv on a CPU machine); its index and version, and those of
    docs/getting-started.md, are scripts/torch-cpu.txt's, which setup-venv.sh installs."""
    index, pin = _torch_cpu()
    readme = (REPO / "README.md").read_text()
    try_it = readme.split("## Try it", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", try_it, flags=re.S)[0].splitlines()
    installs = [shlex.split(ln.split("#")[0]) for ln in block if ln.startswith("pip install")]
    assert installs[0] == ["pip", "install", pin, "--index-url", index]  # torch first
    assert installs[1][2].endswith(".whl")
    # the GPU line the README gives instead: the same version, PyPI's (CUDA) build
    assert f"`pip install {pin}`" in try_it
    for page in ("docs/getting-started.md", "docs/two-clusters.md"):
        cpu = [argv for argv in _torch_lines((REPO / page).read_text()) if "/whl/cpu" in argv[-1]]
        assert cpu and all(argv[2:] == [pin, "--index-url", index] for argv in cpu), page
    # no second copy in the script that builds the venv: it reads the file
    setup = (REPO / "scripts" / "setup-venv.sh").read_text()
    assert index not in setup and "torch==" not in setup and "scripts/torch-cpu.txt" in setup
    # the pinned version is one the package accepts
    torch_range = next(r for r in map(Requirement, metadata.requires("xffl") or [])
                       if r.name == "torch")
    assert Version(pin.split("==")[1]) in torch_range.specifier


def test_the_quickstart_says_what_it_does_before_the_venv_exists(tmp_path: Path) -> None:
    """scripts/quickstart.sh's first line comes before .venv exists, then setup-venv.sh names
    the venv step before it starts. A real start in a copy of the files the two scripts
    read, stopped once the venv step has begun (nothing is installed)."""
    for rel in ("scripts/quickstart.sh", "scripts/setup-venv.sh", "scripts/torch-cpu.txt",
                "pyproject.toml"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tmp_path / rel)
    venv = tmp_path / ".venv"
    proc = subprocess.Popen(["bash", str(tmp_path / "scripts" / "quickstart.sh")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHON": "python3"})
    assert proc.stdout is not None
    lines: list[tuple[str, bool]] = []  # each line, and whether .venv existed when it came
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            # a guard against a hang, not a measurement: the old script printed its first
            # line only after the venv (and every package) was installed
            while sel.select(timeout=300):
                line = proc.stdout.readline()
                if not line:
                    break
                lines.append((line.rstrip("\n"), venv.exists()))
                if "creating .venv" in line:
                    break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert lines, "the quickstart printed nothing"
    first, venv_then = lines[0]
    assert first.startswith("quickstart: setting up .venv") and not venv_then, lines
    assert lines[1][0].startswith("setup-venv: creating .venv (Python 3."), lines
