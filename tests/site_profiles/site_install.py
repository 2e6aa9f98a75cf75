"""What the tests of `xffl profiles install` give a site: its own torch (as a facility's
PyTorch module would), a package index that counts the requests it gets, and profiles."""

from __future__ import annotations

import shlex
import sys
import sysconfig
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO
from tests.stack.profiles import write_profile
from tests.stack.stack import StackInfo

#: the wheels scripts/site-wheels.sh fetched at set-up: the wheelhouse is built from these
SITE_WHEELS = REPO / "build" / "site-wheels"
#: torch and what it imports (its requirements), the whole of the site's "module"
TORCH_TREE = ("torch", "filelock", "typing-extensions", "sympy", "mpmath", "networkx",
              "jinja2", "markupsafe", "fsspec")


def torch_module(folder: Path) -> Path:
    """A facility's PyTorch module: ``folder/python3``, the machine's base Python with a
    folder on its path that holds torch and its requirements only (links into this venv's
    site-packages), as a module's python3 sees its torch. A venv made from it does not see
    that folder: `xffl profiles install` must give the venv the site's torch itself."""
    lib = folder / "torch-module"
    lib.mkdir(parents=True, exist_ok=True)
    purelib = Path(sysconfig.get_path("purelib"))
    for name in TORCH_TREE:
        dist = metadata.distribution(name)
        tops = {str(f).split("/")[0] for f in dist.files or ()
                if not str(f).startswith("..") and "__pycache__" not in str(f)}
        for top in tops:
            if (purelib / top).exists() and not (lib / top).exists():
                (lib / top).symlink_to(purelib / top)
    python = folder / "python3"
    base = getattr(sys, "_base_executable", sys.executable)
    python.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(lib))} "
                      f"exec {shlex.quote(base)} \"$@\"\n")
    python.chmod(0o755)
    return python


class _Counter(BaseHTTPRequestHandler):
    """Counts every request and answers 404: an index that has nothing."""

    def do_GET(self) -> None:
        type(self).seen.append(self.path)  # type: ignore[attr-defined]
        self.send_response(404)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


@contextmanager
def counting_index() -> Iterator[tuple[str, list[str]]]:
    """A package index on 127.0.0.1: its URL and the paths it was asked for, as they come."""
    seen: list[str] = []
    handler = type("Handler", (_Counter,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple/", seen
    finally:
        server.shutdown()
        server.server_close()


def install_profile(folder: Path, stack: StackInfo, workdir: Path, **fields: Any) -> Path:
    """Write alpha's profile (``test-alpha``) into ``folder`` with ``workdir``, a python that
    is not there yet and ``fields`` (``install``, ``setup``, ...); its file."""
    # exec'd ranks: the installed venv's Python starts them, which is what is under test
    name = write_profile(folder, stack.clusters["alpha"], stack, warm=False)
    path = folder / f"{name}.yaml"
    data = {**yaml.safe_load(path.read_text()), "workdir": str(workdir),
            "python": "/not/installed/yet/bin/python", **fields}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
