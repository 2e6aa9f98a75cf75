"""`xffl status` counts sequences (windows of seq_len + 1 tokens), `xffl data prepare`
examples, and each says which it counts (issue 44: both said samples/examples for either)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from typer.testing import CliRunner

from xffl.cli.app import app
from xffl.jobs.registry.records import RoundRecord, SiteRound
from xffl.jobs.registry.store import Registry

runner = CliRunner()


def test_status_names_its_column_sequences(xffl_home: Path, tmp_path: Path) -> None:
    """The table's column is `sequences`, and --help says they are windows, not examples."""
    registry = Registry()
    (tmp_path / "run").mkdir()
    registry.create_run("r-1", "r", tmp_path / "job.yaml", tmp_path / "run", 1, ["alpha"])
    registry.start_round("r-1", 1, ["alpha"])
    registry.finish_round("r-1", RoundRecord(
        round=1, state="completed", started=time.time(), ended=time.time(), num_samples=24,
        sites=[SiteRound(site="alpha", state="completed", num_samples=24, num_tokens=768)]))
    shown = runner.invoke(app, ["status", "r-1", "--no-live"])
    assert shown.exit_code == 0, shown.output
    header = next(line for line in shown.stdout.splitlines() if line.startswith("round\t"))
    assert header.split("\t")[:5] == ["round", "site", "state", "sequences", "tokens"]
    helped = runner.invoke(app, ["status", "--help"], env={"COLUMNS": "200"})
    assert "not the examples `xffl data prepare` counted" in " ".join(helped.stdout.split())


def test_data_prepare_says_packed_examples_become_the_sequences(tmp_path: Path) -> None:
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": f"example {i}"}) + "\n" for i in range(3)))
    done = runner.invoke(app, ["data", "prepare", str(src), "-o", str(tmp_path / "out")])
    assert done.exit_code == 0, done.output
    assert "3 examples" in done.stdout
    assert ("packed: a job reads the examples as windows of training.seq_len + 1 tokens, the "
            "sequences `xffl status` counts") in done.stdout
