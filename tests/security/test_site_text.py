"""A facility's words reach the terminal as text: no rich markup, no escape sequences.

The attack: what a site sends back ends up in the registry (a rejection reason quoting a
manifest's ``run_id``, a failure's last lines, what squeue said) and HEAD printed it as rich
markup: a ``[/]`` made every ``xffl status`` and ``xffl runs`` fail with a MarkupError, and an
ANSI escape reached the terminal as is (clearing it, retitling the window).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from xffl.cli.app import app
from xffl.cli.common import markup_safe, printable
from xffl.jobs.registry.records import RoundRecord, SiteRound
from xffl.jobs.registry.states import RoundState, SiteState
from xffl.jobs.registry.store import Registry

runner = CliRunner()
ESCAPES = "\x1b[2J\x1b]0;owned\x07\r\u202e"
PAYLOAD = f"[/] [bold red]run_id[/bold red] \\[/] {ESCAPES}end"


def _hostile_run(tmp_path: Path) -> str:
    """A run whose message, site reason and SLURM job row hold a facility's payload."""
    job = tmp_path / "job.yaml"
    job.write_text(QUICKSTART.read_text())
    submitted = runner.invoke(app, ["submit", str(job), "--no-start", "--json"])
    assert submitted.exit_code == 0, submitted.output
    run_id: str = json.loads(submitted.stdout)["run_id"]
    registry = Registry()
    run = registry.get_run(run_id)
    registry.start_round(run_id, 1, run.sites)
    registry.finish_round(run_id, RoundRecord(
        round=1, state=RoundState.COMPLETED, ended=1.0,
        sites=[SiteRound(site=s, state=SiteState.REJECTED, reason=f"manifest run_id {PAYLOAD}")
               for s in run.sites]))
    registry.record_slurm_job(run_id, 1, run.sites[0], f"7{PAYLOAD}", PAYLOAD, None, None)
    registry.set_state(run_id, "failed", f"site said: {PAYLOAD}")
    return run_id


@pytest.mark.parametrize("argv", [["status"], ["runs"], ["status", "--no-live"]])
def test_site_text_is_shown_as_text(tmp_path: Path, argv: list[str]) -> None:
    _hostile_run(tmp_path)
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert "\r" not in result.output and "\u202e" not in result.output
    assert "[/] [bold red]run_id[/bold red]" in result.stdout  # shown as the site wrote it
    assert "\\x1b[2J" in result.stdout  # the escape written out


def test_printable_and_markup_safe() -> None:
    assert printable("a\x1bb\tc\nd\x9be\u2066") == "a\\x1bb\tc\nd\\x9be\\u2066"
    from rich.text import Text

    for text in (PAYLOAD, "[", "[a=b]", "a\\[b]"):
        assert Text.from_markup(markup_safe(text)).plain == printable(text)
    for text in ("\\", "[/]\\"):  # rich doubles a last backslash: it cannot escape a tag
        assert Text.from_markup(f"[b]{markup_safe(text)}[/b]").plain.startswith(text)
