"""What the command lines of the plan's step tools share."""

from __future__ import annotations

import argparse

from xffl.core.paths import private_files


def step_parser(module: str) -> argparse.ArgumentParser:
    """The parser of the step tool ``module`` (``--run-dir``, ``--round``), its process made
    owner-only first: the step may run under ``streamflow run`` or cwltool, not xffl."""
    private_files()
    parser = argparse.ArgumentParser(prog=module)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--round", type=int, required=True)
    return parser
