"""The report's numbers from a registry with known timings, its plots, its page and its writing."""

from __future__ import annotations

import html
import json
import sqlite3
from pathlib import Path

import matplotlib.image
import PIL.Image
import pytest

from xffl.jobs.registry.records import RoundRecord, SiteRound, Transfer
from xffl.jobs.registry.store import Registry
from xffl.jobs.report import render as report_render
from xffl.jobs.report.breakdown import TransferTimes, busy_seconds, site_breakdown
from xffl.jobs.report.numbers import assemble, fmt
from xffl.jobs.report.write import write_report
from xffl.jobs.status import run_status

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HOSTILE = '<script>alert("x")</script> & $a^2$'


def _profiles(run_dir: Path) -> None:
    """alpha runs on this machine; beta is a SLURM site."""
    (run_dir / "profiles.json").write_text(json.dumps({
        "alpha": {"name": "alpha"},
        "beta": {"name": "beta", "slurm": {"partition": "debug"},
                 "connector": {"type": "ssh", "host": "login.example.org"}},
    }))


def _deliver(registry: Registry, run_id: str, rnd: int, site: str, seconds: float) -> float:
    started = registry.rounds(run_id)[rnd - 1].started
    assert started is not None
    got = registry.mark_delivered(run_id, rnd, site, at=started + seconds)
    assert got == seconds
    return seconds


def _run(tmp_path: Path) -> tuple[Registry, str]:
    """Two completed rounds with known numbers, and a third where beta failed.

    The rounds start at t = 1000, 2000 and 3000 s; each site's transfers are recorded at
    known times after them.
    """
    registry = Registry()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _profiles(run_dir)
    run_id = "rep-20261122-000000-abcd"
    registry.create_run(run_id, "rep", tmp_path / "job.yaml", run_dir, 3, ["alpha", "beta"])
    rounds = {  # round: (alpha: loss, train s, delivered s, start-up s), (beta: ...),
        #          global loss, agg s
        1: ((2.5, 12.5, 21.0, 2.0), (3.125, 10.0, 30.5, 3.0), 2.75, 0.75),
        2: ((2.0625, 10.0, 16.0, 1.5), (2.875, 8.0, 19.0, None), 2.25, 0.5),
    }
    for rnd, (alpha, beta, loss, agg) in rounds.items():
        (a_loss, a_train, a_del, a_up), (b_loss, b_train, b_del, b_up) = alpha, beta
        registry.start_round(run_id, rnd, ["alpha", "beta"])
        _deliver(registry, run_id, rnd, "alpha", a_del)
        _deliver(registry, run_id, rnd, "beta", b_del)
        registry.finish_round(run_id, RoundRecord(
            round=rnd, state="completed", started=1000.0 * rnd, ended=None,
            aggregate_seconds=agg, num_samples=1280, loss=loss, val_loss=loss + 0.5,
            val_samples=96, sites=[
                SiteRound("alpha", "completed", 768, 50000, a_loss, a_train, startup_seconds=a_up,
                          val_loss=a_loss + 0.5, val_loss_update=a_loss, val_samples=64),
                SiteRound("beta", "completed", 512, 30000, b_loss, b_train, attempts=2,
                          startup_seconds=b_up, val_loss=b_loss + 0.5, val_loss_update=b_loss,
                          val_samples=32)]))
    # beta's SLURM jobs: round 1 was tried twice (3 s + 2 s in the queue), round 2 once
    registry.record_slurm_job(run_id, 1, "beta", "101", "FAILED", 3.0, 1.0)
    registry.record_slurm_job(run_id, 1, "beta", "102", "COMPLETED", 2.0, 20.0)
    registry.record_slurm_job(run_id, 2, "beta", "103", "COMPLETED", 4.0, 12.0)
    registry.start_round(run_id, 3, ["alpha", "beta"])
    _deliver(registry, run_id, 3, "alpha", 9.0)
    registry.finish_round(run_id, RoundRecord(round=3, state="failed", started=3000.0, sites=[
        SiteRound("alpha", "completed", 768, 50000, 1.75, 8.0, startup_seconds=1.0),
        SiteRound("beta", "failed", reason=HOSTILE)]))
    for site, direction, started, ended, nbytes in TRANSFERS:
        registry.record_transfer(run_id, site, direction, started, ended, nbytes)
    registry.set_state(run_id, "failed", HOSTILE)
    return registry, run_id


# (site, direction, started, ended, bytes): alpha 1 + 1 s in round 1; beta's two inbound
# copies in round 1 overlap (1000-1003 and 1001-1004: 4 s, not 6) and its update took 1.5 s;
# round 2: alpha 0.5 s, beta nothing; round 3: alpha 1 s (its size not known)
TRANSFERS = [("alpha", "in", 1000.5, 1001.5, 500), ("beta", "in", 1000.0, 1003.0, 700),
             ("beta", "in", 1001.0, 1004.0, 20), ("alpha", "out", 1019.0, 1020.0, 3000),
             ("beta", "out", 1028.0, 1029.5, 4000), ("alpha", "in", 2000.0, 2000.5, 600),
             ("alpha", "in", 3000.0, 3001.0, None)]


def test_breakdown_numbers(tmp_path: Path) -> None:
    registry, run_id = _run(tmp_path)
    data = assemble(registry, registry.get_run(run_id))
    got = {(r.round, s.site): (s.queue_wait_s, s.startup_s, s.train_s, s.transfer_s, s.other_s,
                               s.delivered_s, s.tokens_per_s)
           for r in data.rounds for s in r.sites}
    assert got == {  # every number a sum of binary fractions: exact
        (1, "alpha"): (0.0, 2.0, 12.5, 2.0, 4.5, 21.0, 4000.0),    # 21 - 2 - 12.5 - 2
        (1, "beta"): (5.0, 3.0, 10.0, 5.5, 7.0, 30.5, 3000.0),     # 30.5 - (3+2) - 3 - 10 - 5.5
        (2, "alpha"): (0.0, 1.5, 10.0, 0.5, 4.0, 16.0, 5000.0),
        (2, "beta"): (4.0, None, 8.0, 0.0, 7.0, 19.0, 3750.0),     # start-up not measured
        (3, "alpha"): (0.0, 1.0, 8.0, 1.0, 0.0, 9.0, 6250.0),      # parts > delivered: 0
        (3, "beta"): (None, None, None, 0.0, None, None, None),    # SLURM, failed, no job
    }
    assert [(r.round, r.state, r.loss, r.aggregate_s) for r in data.rounds] == [
        (1, "completed", 2.75, 0.75), (2, "completed", 2.25, 0.5), (3, "failed", None, None)]
    assert data.rounds[0].sites[1].attempts == 2
    moved = {(r.round, s.site): (s.received_bytes, s.sent_bytes)
             for r in data.rounds for s in r.sites}
    assert moved == {(1, "alpha"): (500, 3000), (1, "beta"): (720, 4000),  # both copies in
                     (2, "alpha"): (600, 0), (2, "beta"): (0, 0),
                     (3, "alpha"): (0, 0), (3, "beta"): (0, 0)}


def test_breakdown_edge_cases() -> None:
    late = SiteRound("a", "completed", num_tokens=100, train_seconds=8.0, delivered_seconds=9.0,
                     startup_seconds=0.5)
    b = site_breakdown(late, queue_wait_s=2.0, transfer_s=0.25)  # clocks disagree: other >= 0
    assert (b.other_s, b.tokens_per_s) == (0.0, 12.5)
    # a part not measured (queue wait unknown, no transfers timed) stays None, its time in other
    b = site_breakdown(late, None)
    assert (b.queue_wait_s, b.transfer_s, b.other_s) == (None, None, 0.5)
    assert site_breakdown(SiteRound("a", "completed"), 0.0, 1.0).other_s is None  # not delivered
    assert site_breakdown(SiteRound("a", "completed", num_tokens=5, train_seconds=0.0),
                          0.0).tokens_per_s is None
    assert (fmt("loss", None), fmt("loss", 2.0625), fmt("aggregate_s", 0.5),
            fmt("tokens_per_s", 3749.6)) == ("-", "2.0625", "0.50", "3750")


def test_busy_seconds_counts_overlaps_once() -> None:
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0.0, 1.0), (2.0, 3.5)]) == 2.5        # apart
    assert busy_seconds([(1.0, 4.0), (0.0, 3.0)]) == 4.0        # overlapping, out of order
    assert busy_seconds([(0.0, 10.0), (2.0, 3.0)]) == 10.0      # one inside another
    assert busy_seconds([(0.0, 1.0), (1.0, 2.0)]) == 2.0        # touching


def test_transfers_belong_to_the_round_they_started_in() -> None:
    rounds = [RoundRecord(round=r, state="completed", started=s)
              for r, s in ((2, 20.0), (1, 10.0), (3, None))]
    times = TransferTimes.of([Transfer("a", "in", 5.0, 6.0),      # before round 1: nobody's
                              Transfer("a", "in", 10.0, 11.0),    # at round 1's start
                              Transfer("a", "out", 19.0, 21.0),   # ends in round 2: round 1's
                              Transfer("a", "in", 20.5, 21.0),
                              Transfer("b", "out", 30.0, 31.0)], rounds)  # round 3 not started
    assert (times.get(1, "a"), times.get(2, "a"), times.get(2, "b"), times.get(1, "b")) == \
        (3.0, 0.5, 1.0, 0.0)
    assert TransferTimes.of([], rounds).get(1, "a") is None  # a run that timed no transfer
    sized = TransferTimes.of([Transfer("a", "in", 10.0, 11.0, 7),
                              Transfer("a", "in", 12.0, 13.0, 5),
                              Transfer("a", "out", 14.0, 15.0, 11)], rounds)
    assert (sized.bytes(1, "a", "in"), sized.bytes(1, "a", "out"), sized.bytes(2, "a", "in")) \
        == (12, 11, 0)
    assert TransferTimes.of([], rounds).bytes(1, "a", "in") is None


def test_delivery_time_survives_rerun_and_clears_on_failure(tmp_path: Path) -> None:
    registry = Registry()
    registry.create_run("d1", "d", tmp_path / "j.yaml", tmp_path, 1, ["a", "b"])
    registry.start_round("d1", 1, ["a", "b"])
    _deliver(registry, "d1", 1, "a", 7.5)
    _deliver(registry, "d1", 1, "b", 4.0)
    registry.start_round("d1", 1, ["a", "b"])  # resumed: a's update is reused, b retrains
    registry.finish_round("d1", RoundRecord(round=1, state="failed", sites=[
        SiteRound("a", "completed", 1, 10, 1.0, 2.0), SiteRound("b", "failed", reason="x")]))
    sites = {s.site: s.delivered_seconds for s in registry.rounds("d1")[0].sites}
    assert sites == {"a": 7.5, "b": None}
    assert registry.mark_delivered("d1", 9, "a") is None  # no such round


def test_old_registry_is_migrated(tmp_path: Path, xffl_home: Path) -> None:
    xffl_home.mkdir(parents=True)
    db = sqlite3.connect(xffl_home / "registry.db")
    db.execute("CREATE TABLE site_rounds (run_id TEXT NOT NULL, round INTEGER NOT NULL,"
               " site TEXT NOT NULL, state TEXT NOT NULL, num_samples INTEGER,"
               " num_tokens INTEGER, loss REAL, train_seconds REAL,"
               " reason TEXT NOT NULL DEFAULT '', PRIMARY KEY (run_id, round, site))")
    db.execute("INSERT INTO site_rounds VALUES ('old', 1, 'a', 'completed', 1, 2, 3.0, 4.0, '')")
    db.commit()
    db.close()
    registry = Registry(xffl_home / "registry.db")
    registry.create_run("old", "old", tmp_path / "j.yaml", tmp_path, 1, ["a"])
    registry.finish_round("old", RoundRecord(round=1, state="completed", sites=[]))
    (site,) = registry.rounds("old")[0].sites
    assert (site.train_seconds, site.delivered_seconds, site.startup_seconds,
            site.attempts) == (4.0, None, None, 1)
    assert registry.transfers("old") == []


def _valid_png(path: Path) -> tuple[int, int]:
    assert path.read_bytes()[:8] == PNG_MAGIC
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 0 and pixels.shape[1] > 0
    return pixels.shape[0], pixels.shape[1]


def test_report_files_and_page(tmp_path: Path) -> None:
    registry, run_id = _run(tmp_path)
    run = registry.get_run(run_id)
    data, files = write_report(registry, run)
    out = Path(run.run_dir) / "report"
    assert files == {"validation": out / "validation.png",
                     "cross-site": out / "cross-site.png", "loss": out / "loss.png",
                     "breakdown": out / "breakdown.png",
                     "throughput": out / "throughput.png", "html": out / "report.html"}
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in files.values())
    for name in ("validation", "loss", "breakdown", "throughput"):
        height, width = _valid_png(files[name])
        assert height >= 300 and width >= 600
    with PIL.Image.open(files["loss"]) as png:  # the curves the loss plot draws
        assert json.loads(png.text["Description"]) == {
            "alpha": [[1.0, 2.5], [2.0, 2.0625], [3.0, 1.75]],
            "beta": [[1.0, 3.125], [2.0, 2.875]],  # failed in round 3: no loss
            "global": [[1.0, 2.75], [2.0, 2.25]]}
    with PIL.Image.open(files["validation"]) as png:  # the incoming globals' validation loss
        assert json.loads(png.text["Description"]) == {
            "alpha": [[1.0, 3.0], [2.0, 2.5625]], "beta": [[1.0, 3.625], [2.0, 3.375]],
            "federated": [[1.0, 3.25], [2.0, 2.75]]}
    page = files["html"].read_text()
    # every row as the table prints it: round, site, state, samples, tokens, loss, train s,
    # queue wait s, start-up s, transfer s, other s, aggregate s, tokens/s, MB in, MB out
    assert ('<td class="text">1</td><td class="text">alpha</td><td class="text">completed</td>'
            "<td>768</td><td>50000</td><td>2.5000</td><td>12.5</td><td>0.0</td><td>2.0</td>"
            "<td>2.0</td><td>4.5</td><td></td><td>4000</td><td>0.00</td><td>0.00</td>") in page
    assert ('<td class="text">beta</td><td class="text">completed after 2 attempts</td>'
            "<td>512</td><td>30000</td><td>3.1250</td><td>10.0</td><td>5.0</td><td>3.0</td>"
            "<td>5.5</td><td>7.0</td><td></td><td>3000</td>") in page
    assert ('<tr class="global"><td class="text">2</td><td class="text">global</td>'
            '<td class="text">completed</td><td>1280</td><td></td><td>2.2500</td><td></td>'
            "<td></td><td></td><td></td><td></td><td>0.50</td><td></td><td></td><td></td>"
            "<td>2.7500</td><td></td></tr>") in page
    # validation: a site's loss of the incoming global and of its own update
    assert "<td>0.00</td><td>0.00</td><td>3.0000</td><td>2.5000</td></tr>" in page
    assert "<td>2.0625</td>" in page and "<td>2.8750</td>" in page and "<td>3750</td>" in page
    # the hostile reason and run message are shown, escaped, never as markup
    assert HOSTILE not in page and "<script>" not in page
    assert html.escape(HOSTILE) in page
    # four plots embedded as PNG, the breakdown as an inline SVG (its legend and bars have
    # ids the page's layout test measures)
    assert page.count("data:image/png;base64,") == 4 and page.count("<svg ") == 1
    assert data.rounds[1].sites[1].tokens_per_s == 3750.0


def test_status_json_has_the_breakdown(tmp_path: Path) -> None:
    registry, run_id = _run(tmp_path)
    status = run_status(registry, registry.get_run(run_id))
    beta = status.rounds[0].sites[1]
    assert (beta.site, beta.queue_wait_s, beta.startup_seconds, beta.train_seconds,
            beta.transfer_s, beta.other_s, beta.delivered_seconds, beta.tokens_per_s) == (
        "beta", 5.0, 3.0, 10.0, 5.5, 7.0, 30.5, 3000.0)
    alpha = status.rounds[1].sites[0]
    assert (alpha.queue_wait_s, alpha.transfer_s, alpha.delivered_seconds) == (0.0, 0.5, 16.0)
    # the JSON object carries the same numbers under the same names, through a JSON round trip
    shown = json.loads(json.dumps(status.as_json()))
    assert shown["run_id"] == run_id and shown["slurm"] == [] and shown["schedule"] is None
    row = shown["rounds"][0]["sites"][1]
    assert (row["site"], row["queue_wait_s"], row["startup_s"], row["transfer_s"],
            row["other_s"], row["tokens_per_s"], row["state"]) == (
        "beta", 5.0, 3.0, 5.5, 7.0, 3000.0, beta.state.value)
    assert shown["rounds"][0]["round"] == status.rounds[0].record.round


def test_run_without_completed_rounds_gets_a_report(tmp_path: Path) -> None:
    registry = Registry()
    registry.create_run("empty-1", "empty", tmp_path / "j.yaml", tmp_path / "run", 3,
                        ["alpha", "beta"])
    registry.start_round("empty-1", 1, ["alpha", "beta"])
    out = tmp_path / "elsewhere" / "rep"
    _, files = write_report(registry, registry.get_run("empty-1"), out)
    assert files["html"] == out / "report.html"
    for name in ("loss", "breakdown", "throughput"):
        _valid_png(files[name])
    page = files["html"].read_text()
    assert "no completed round yet" in page
    assert '<td class="text">running</td><td>-</td><td>-</td><td>-</td>' in page


def test_a_report_written_by_the_library_is_owner_only(tmp_path: Path) -> None:
    """Called without the CLI (whose umask is 077), under umask 022: still 0700 / 0600."""
    import os
    import stat

    registry = Registry()
    registry.create_run("lib-1", "lib", tmp_path / "j.yaml", tmp_path / "run", 1, ["alpha"])
    old = os.umask(0o022)
    try:
        _, files = write_report(registry, registry.get_run("lib-1"), tmp_path / "rep")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "rep").stat().st_mode) == 0o700
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in files.values()}
    assert modes == dict.fromkeys(("validation.png", "cross-site.png", "loss.png",
                                   "breakdown.png",
                                   "throughput.png", "report.html"), 0o600)


def test_failed_rendering_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registry, run_id = _run(tmp_path)
    run = registry.get_run(run_id)
    out = tmp_path / "out"

    def broken(*_: object) -> None:
        raise RuntimeError("disk full")

    with monkeypatch.context() as m:
        m.setattr(report_render, "plot_throughput", broken)
        with pytest.raises(RuntimeError):
            write_report(registry, run, out)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".xffl-report-")]

    _, files = write_report(registry, run, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with monkeypatch.context() as m:  # an existing report stays as it was
        m.setattr(report_render, "plot_throughput", broken)
        with pytest.raises(RuntimeError):
            write_report(registry, run, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert len(files) == 6
