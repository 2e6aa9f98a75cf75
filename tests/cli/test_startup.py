"""The CLI answers at once: importing it pulls in no training, workflow or SSH stack.

torch alone costs ~1.5 s of start-up; StreamFlow, paramiko and numpy another few tenths.
Every command imports what it needs when it runs, so `xffl --help`, `status`, `runs`,
`logs`, `sites list` and `validate` start without them (bench/cli_latency times them).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "streamflow", "paramiko", "numpy", "cwltool", "safetensors", "matplotlib")


def test_importing_the_cli_leaves_the_heavy_stacks_out() -> None:
    code = ("import json, sys, xffl.cli.app; "
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert json.loads(done.stdout) == []


STATUS = """
import json, sys
from xffl.cli.app import main
sys.argv = ["xffl", "status", "last", "--json"]
try:
    main()
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)),
      file=sys.stderr)
"""


def test_status_of_a_run_with_local_sites_validates_no_profile(xffl_home: Path) -> None:
    """Its sites need no login, so status reads no credential and builds no pydantic model.

    Validating the run's profiles (pydantic's models) was half of `xffl status last`.
    """
    from typer.testing import CliRunner

    from tests.conftest import QUICKSTART
    from xffl.cli.app import app

    assert CliRunner().invoke(app, ["submit", str(QUICKSTART), "--no-start"]).exit_code == 0
    heavy = (*HEAVY, "pydantic", "xffl.site_profiles.schema", "xffl.jobs.spec.schema")
    done = subprocess.run([sys.executable, "-c", STATUS.format(heavy=heavy)],
                          capture_output=True, text=True, timeout=120, check=True)
    status = json.loads(done.stdout)
    assert status["state"] == "waiting" and status["credentials"] == []
    assert json.loads(done.stderr.strip().splitlines()[-1]) == []
