"""`xffl export` of a run that completed no round: refused, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from xffl.cli.app import app

runner = CliRunner()


def test_export_of_a_run_that_completed_no_round_is_refused(xffl_home: Path,
                                                            tmp_path: Path) -> None:
    """Its only global is round 0's untrained model: exporting it by default (exit 0, no
    word) handed out random weights as the run's result (issue 31 item 12)."""
    submitted = runner.invoke(app, ["submit", str(QUICKSTART), "--no-start", "--json"])
    run_id = json.loads(submitted.stdout)["run_id"]
    assert runner.invoke(app, ["cancel", run_id]).exit_code == 0
    out = tmp_path / "exported"
    refused = runner.invoke(app, ["export", run_id, "-o", str(out)])
    assert refused.exit_code == 2, refused.output
    assert f"run {run_id} is cancelled and completed no round" in refused.stderr
    assert "--round 0" in refused.stderr and not out.exists()
    as_json = runner.invoke(app, ["export", "-o", str(out), "--json"])
    assert as_json.exit_code == 2 and json.loads(as_json.stdout)["error"]["code"] == 2
    on_purpose = runner.invoke(app, ["export", "-o", str(out), "--round", "0"])
    assert on_purpose.exit_code == 2 and "no global model after round 0" in on_purpose.stderr
