"""`xffl report` on a real quickstart run, and `xffl status --json`'s round-time breakdown."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import PIL.Image
import pytest
from typer.testing import CliRunner

from tests.cli.schemas import check
from tests.conftest import FinishedRun
from xffl.cli.app import app
from xffl.jobs.registry.store import Registry
from xffl.jobs.report.numbers import fmt

runner = CliRunner()


def _decodes(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 0 and pixels.shape[1] > 0


@pytest.mark.slow
def test_report_of_the_quickstart(tmp_path: Path, quickstart_run: FinishedRun,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The report and status of the quickstart as written (3 rounds, 2 sites)."""
    monkeypatch.setenv("XFFL_HOME", str(quickstart_run.home))
    run_id = quickstart_run.run_id

    # `xffl report --json -o DIR`, run by the fixture as the README's quickstart does
    numbers = check("report", quickstart_run.report)
    out = Path(numbers["html"]).parent
    assert numbers["html"] == str(out / "report.html")
    assert sorted(numbers["files"]) == sorted(str(out / n) for n in (
        "report.html", "validation.png", "cross-site.png", "loss.png", "breakdown.png",
        "throughput.png"))
    for name in ("validation.png", "loss.png", "breakdown.png", "throughput.png"):
        _decodes(out / name)
    page = (out / "report.html").read_text()
    rounds = Registry().rounds(run_id)
    assert [r.round for r in rounds] == [1, 2, 3]
    assert [r["loss"] for r in numbers["rounds"]] == [r.loss for r in rounds]
    # the loss PNG carries the curves it draws: every site's and the global loss per round
    with PIL.Image.open(out / "loss.png") as png:
        curves = json.loads(png.text["Description"])
    assert curves == {
        "alpha": [[float(r.round), s.loss] for r in rounds for s in r.sites if s.site == "alpha"],
        "beta": [[float(r.round), s.loss] for r in rounds for s in r.sites if s.site == "beta"],
        "global": [[float(r.round), r.loss] for r in rounds]}
    # the main plot: each site's validation loss of the incoming global, and the federated one
    with PIL.Image.open(out / "validation.png") as png:
        curves = json.loads(png.text["Description"])
    assert curves == {
        "alpha": [[float(r.round), s.val_loss] for r in rounds for s in r.sites
                  if s.site == "alpha"],
        "beta": [[float(r.round), s.val_loss] for r in rounds for s in r.sites
                 if s.site == "beta"],
        "federated": [[float(r.round), r.val_loss] for r in rounds]}
    assert all(v is not None for points in curves.values() for _, v in points)
    for rnd in rounds:
        assert rnd.state == "completed" and rnd.loss is not None
        assert f"<td>{fmt('loss', rnd.loss)}</td>" in page
        assert {s.site for s in rnd.sites} == {"alpha", "beta"}
        for site in rnd.sites:
            assert site.loss is not None and f"<td>{fmt('loss', site.loss)}</td>" in page
            assert f"<td>{fmt('tokens_per_s', site.num_tokens / site.train_seconds)}</td>" \
                in page
            # the hardware table: a row per site and round (CPU: 0 GPUs, no MFU)
            assert (f'<tr><td class="text">{rnd.round}</td><td class="text">{site.site}</td>'
                    f'<td class="text">cpu</td><td>0</td>'
                    f"<td>{fmt('tokens_per_s_per_gpu', site.tokens_per_s_per_gpu)}</td>"
                    f"<td>{fmt('tflops', site.tflops)}</td><td>-</td>"
                    f"<td>{fmt('peak_memory_gib', site.peak_memory_gib)}</td>") in page
    assert all(s["device"] == "cpu" and s["tokens_per_s_per_gpu"] > 0
               for r in numbers["rounds"] for s in r["sites"])

    status = runner.invoke(app, ["status", run_id, "--json"])
    assert status.exit_code == 0, status.output
    for rnd in json.loads(status.stdout)["rounds"]:
        for site in rnd["sites"]:
            parts = (site["queue_wait_s"], site["startup_s"], site["train_s"],
                     site["transfer_s"], site["other_s"])
            assert all(v is not None and v >= 0 for v in parts), site
            assert site["queue_wait_s"] == 0.0  # local sites: no SLURM queue
            assert site["delivered_s"] > site["train_s"] > 0 and site["startup_s"] > 0
            # the parts are disjoint spans inside the delivery time, so other (delivered minus
            # four parts, 4 float64 roundings) is never clamped; adding the five back rounds 4
            # more times; every partial sum is <= delivered, so each rounding is at most
            # 2^-53 * delivered: 8 in all, bound 16 * 2^-53 * delivered (leaving out any
            # part, each > 0 s but the queue wait, breaks it)
            assert abs(sum(parts) - site["delivered_s"]) <= \
                16 * 2**-53 * site["delivered_s"], site
            # the same float64 division of the same numbers (JSON round-trips floats
            # exactly): bitwise equal
            assert site["tokens_per_s"] == site["num_tokens"] / site["train_s"]
    # the table has the breakdown's columns (not a terminal: tab-separated, cli/tables.py)
    table = runner.invoke(app, ["status", run_id])
    assert table.exit_code == 0, table.output
    assert ("round\tsite\tstate\tsequences\ttokens\tloss\tval loss\tqueue s\tstart s\ttrain s\t"
            "xfer s\tother s\tagg s\tMB in/out\tdevice\tGPUs\ttok/s per GPU\tTFLOP/s\tMFU\t"
            "peak GiB\tsave s\n") in table.stdout, table.stdout
    # StreamFlow brought every round's global to each site and its update back, timed
    moved = {(t.site, t.direction) for t in Registry().transfers(run_id)}
    assert moved == {(s, d) for s in ("alpha", "beta") for d in ("in", "out")}
    # and sized: what came back is the update the coordinator keeps, file for file; what
    # went out is the round's global model and the site's job file (its jobs/<site>.json)
    run_dir = Path(quickstart_run.status["run_dir"])
    for rnd in json.loads(status.stdout)["rounds"]:
        for site in rnd["sites"]:
            update = run_dir / "rounds" / str(rnd["round"]) / "updates" / site["site"]
            assert site["sent_bytes"] == sum(f.stat().st_size for f in update.iterdir())
            parent = run_dir / "rounds" / str(rnd["round"] - 1) / "global"
            model = sum(f.stat().st_size for f in parent.iterdir())
            assert model < site["received_bytes"] < model + 4096, site


def test_report_of_an_unknown_run_exits_2() -> None:
    result = runner.invoke(app, ["report", "no-such-run"])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no run 'no-such-run'" in lines[0], result.stderr
    assert result.stdout == ""
