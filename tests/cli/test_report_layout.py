"""`xffl report`'s page at 1200 px in headless Chromium: no element wider than the page, the
round-time breakdown's legend over no bar, and a summary of what ran at the top. The layout
is measured in the browser (tests/cli/browser.py), not compared as pixels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.cli.browser import intersects, layout
from tests.conftest import FinishedRun
from xffl.jobs.report.numbers import ReportData, RoundRow, SiteRow
from xffl.jobs.report.render import SEGMENTS, render_all

WIDTH = 1200
SUMMARY = ["model", "sites", "rounds", "final model's held-out loss", "wall time"]


def _site(name: str, rnd: int) -> SiteRow:
    """A site's round with every column filled, numbers as wide as real ones get."""
    return SiteRow(site=name, state="completed", num_samples=123456, num_tokens=987654321,
                   loss=2.3456 + rnd, attempts=1, reason="", queue_wait_s=1234.5,
                   startup_s=12.3, train_s=45678.9, transfer_s=123.4, other_s=12.3,
                   delivered_s=47000.0, tokens_per_s=123456.0, received_bytes=13_500_000_000,
                   sent_bytes=13_500_000_000, val_loss=2.5, val_loss_update=2.4,
                   val_samples=77, val_tokens=4928, device="NVIDIA A100-SXM4-64GB", gpus=4,
                   tokens_per_s_per_gpu=3000.0, tflops=150.0, mfu=0.48, peak_memory_gib=60.5,
                   save_s=30.1)


def _data(rounds: int, sites: list[str]) -> ReportData:
    """A run of ``rounds`` rounds at ``sites``, as the report reads it from the registry."""
    rows = [RoundRow(round=r, state="completed", num_samples=123456 * len(sites),
                     loss=2.4, aggregate_s=321.0, wall_s=50000.0,
                     sites=[_site(s, r) for s in sites], val_loss=2.5, val_samples=231,
                     val_tokens=14784) for r in range(1, rounds + 1)]
    final = {"round": rounds, "val_loss": 2.3107, "val_loss_median": 2.31,
             "val_samples": 231, "val_tokens": 14784, "sites": dict.fromkeys(sites, 2.31),
             "site_tokens": dict.fromkeys(sites, 4928)}
    return ReportData(run_id="llama-two-facilities-20261128-101500-a3f9", name="llama",
                      state="completed", message=f"{rounds} rounds completed",
                      rounds_done=rounds, rounds_total=rounds, sites=sites,
                      run_dir="/home/user/.local/share/xffl/runs/llama-two-facilities-"
                      "20261128-101500-a3f9", rounds=rows, model="preset llama3.1-8b",
                      site_setup=[f"{s} (16 ranks, profile leonardo)" for s in sites],
                      wall_s=8000.0, final_loss=final)


def check_page(got: dict[str, Any], bars: int) -> None:
    """The layout rules of the report at WIDTH px: nothing wider than the page, no bar and
    no title or round label under the breakdown's legend, the summary above the first
    section."""
    assert (got["page"], got["scroll_width"]) == (WIDTH, WIDTH), got["wide"][:5]
    assert got["wide"] == []
    assert got["legend"] is not None and len(got["bars"]) == bars
    assert len(got["texts"]) == 1 + bars // len(SEGMENTS)  # the title, a label per bar
    under = [b["id"] for b in got["bars"] + got["texts"]
             if intersects(b["box"], got["legend"])]
    assert under == [], (got["legend"], under)
    assert [k for k, _ in got["summary"]] == SUMMARY
    assert got["summary_top"] < got["first_heading_top"]


def test_a_report_of_many_rounds_fits_a_1200px_page(tmp_path: Path) -> None:
    """12 rounds at 3 sites, every number as wide as a 7B run's: the per-round table wraps
    its headers within the page, the breakdown's 36 bars are not under its legend."""
    render_all(_data(12, ["alpha", "beta", "gamma"]), tmp_path)
    got = layout(tmp_path / "report.html", WIDTH, tmp_path)
    check_page(got, 12 * 3 * len(SEGMENTS))
    summary = dict(got["summary"])
    assert summary["final model's held-out loss"].startswith("2.3107: the global after round 12")
    assert summary["wall time"] == "2 h 13 min from submit to the end"


@pytest.mark.slow
def test_the_quickstarts_report_at_1200px(quickstart_run: FinishedRun, tmp_path: Path) -> None:
    """The report the quickstart writes (3 rounds, 2 sites): the same rules, and its summary
    says what ran and the final model's held-out loss that `xffl status` records."""
    got = layout(Path(quickstart_run.report["html"]), WIDTH, tmp_path)
    check_page(got, 3 * 2 * len(SEGMENTS))
    summary = dict(got["summary"])
    final = quickstart_run.status["final_loss"]
    assert summary["final model's held-out loss"].startswith(
        f"{final['val_loss']:.4f}: the global after round 3")
    assert summary["model"] == "preset tiny (seeded weights)"
    assert summary["sites"] == ("alpha (2 ranks, profile local); "
                                "beta (2 ranks, profile local)")
    assert summary["rounds"] == "3 of 3 completed (completed)"


def test_without_chromium_the_layout_test_fails_under_ci(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """CI installs Chromium (scripts/install-system-deps.sh): there its absence is a failure,
    never a skip; elsewhere a skip."""
    from tests.cli import browser

    monkeypatch.setenv("PATH", str(tmp_path))  # no chromium on it
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="chromium is not installed"):
        browser.chromium()
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        browser.chromium()
