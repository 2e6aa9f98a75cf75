"""Print the folders that pyproject.toml's package-dir maps to xffl's subpackages, one a line."""

from __future__ import annotations

import re
from pathlib import Path

text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
mapping = re.search(r"^package-dir = \{(.*)\}$", text, re.M)
if mapping is None:
    raise SystemExit("pyproject.toml has no package-dir line")
for name, folder in re.findall(r'"xffl\.(\w+)" = "(\w+)"', mapping.group(1)):
    if name != folder:
        raise SystemExit(f"xffl.{name} maps to {folder}/: keep package and folder names equal")
    print(folder)
