"""The CLI answers at once: importing it pulls in no training, workflow or SSH stack.

torch alone costs ~1.5 s of start-up; StreamFlow, paramiko and numpy another few tenths.
Every command imports what it needs when it runs, so `xffl --help`, `status`, `runs`,
`logs`, `sites list` and `validate` start without them (bench/cli_latency times them).
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "streamflow", "paramiko", "numpy", "cwltool", "safetensors", "matplotlib")


def test_importing_the_cli_leaves_the_heavy_stacks_out() -> None:
    code = ("import json, sys, xffl.cli.app; "
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert json.loads(done.stdout) == []
