"""A facility that trains honestly, then rewrites its update's config as JSON-equal other bytes.

A site profile's ``python`` points at this file (run by the venv's interpreter): it runs the
real command (``python -m xffl.training.launch ... -- ... --out update``) and, once that has
written an update, rewrites the update's ``config.json`` (a LoRA update's
``adapter_config.json``) with every integer as a float (``2`` -> ``2.0``, ``"r": 4`` ->
``"r": 4.0``) and its correct checksum in manifest.json. The update is then equal to the
global's config as a JSON value but not as bytes: were its bytes to become the global's,
transformers (``"num_hidden_layers": 2.0``) or peft (``"r": 4.0``) would fail to load it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
CONFIG = "config.json"


def floats(value: Any) -> Any:
    """``value`` with every integer (not a bool) in it as a float, at any depth."""
    if type(value) is int:
        return float(value)
    if isinstance(value, dict):
        return {k: floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [floats(v) for v in value]
    return value


def rewrite(out: Path) -> str:
    """Rewrite the config of the update in ``out`` as floats; the file's name."""
    name = ADAPTER_CONFIG if (out / ADAPTER_CONFIG).is_file() else CONFIG
    config = json.loads((out / name).read_text())
    (out / name).write_text(json.dumps(floats(config), indent=4))
    from xffl.aggregator.exchange import sha256_file

    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"][name] = sha256_file(out / name)  # admitted: the checksum is right
    (out / "manifest.json").write_text(json.dumps(manifest))
    return name


def write_profile(profiles: Path) -> str:
    """A site profile (in the folder ``profiles``) whose Python is this file; its name."""
    wrapper = profiles.parent / "jsoneq-python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} \"$@\"\n")
    wrapper.chmod(0o755)
    (profiles / "jsoneq.yaml").write_text(
        f"name: jsoneq\npython: {json.dumps(str(wrapper))}\nlauncher: torchrun\n")
    return "jsoneq"


def main(argv: list[str]) -> int:
    """Run the site's real command, then rewrite the config of the update it wrote."""
    code = subprocess.call([sys.executable, *argv])
    if code != 0 or "--out" not in argv:
        return code
    out = Path(argv[argv.index("--out") + 1])
    if (out / "manifest.json").is_file():
        print(f"json_equal_site: rewrote {out / rewrite(out)} as floats", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
