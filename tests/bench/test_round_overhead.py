"""The round-overhead benchmark runs xffl and its baselines on the same work (the real stack)."""

from __future__ import annotations

import json

import pytest

from tests.bench.scripts import load_bench


@pytest.mark.slow
def test_xffl_and_baselines_do_the_same_rounds(slurm_stack,  # type: ignore[no-untyped-def]
                                                capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("round_overhead")
    # one site of one rank and one baseline: the test checks that both sides do the same
    # rounds and that the numbers add up, not the DDP start-up (test_slurm_sites), two sites
    # in parallel (test_slurm_sites too) or both baselines
    assert bench.main(["--rounds", "1", "--steps", "2", "--ranks", "1", "--sites", "1",
                       "--baselines", "poll", "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("\n{") + 1:])
    rounds = result["rounds"]
    assert set(rounds) == {"xffl", "poll"}
    for rows in rounds.values():
        (row,) = rows
        # every mode ran one job per site, on the same data: the same samples per site
        assert {s: t["samples"] for s, t in row["sites"].items()} == \
            {s: t["samples"] for s, t in rounds["xffl"][0]["sites"].items()}
        # the same float64 subtraction of the same numbers (JSON round-trips floats exactly)
        assert row["overhead_s"] == row["wall_s"] - row["slowest_job_s"]
    # the coordinator's CPU seconds in the round (bench/round_overhead/cpu.py): StreamFlow's
    # in the supervisor, and the admit steps' it ran
    spent = rounds["xffl"][0]["cpu_s"]
    assert spent["self"] > 0 and spent["steps"] > 0, spent
    job_ids = [t["job_id"] for rows in rounds.values() for t in rows[0]["sites"].values()]
    assert len(job_ids) == len(set(job_ids)) == 2  # two distinct SLURM jobs: 2 modes x 1 site
    assert set(rounds["xffl"][0]["sites"]) == {"alpha"}
    # one round: each mean is its one value exactly (statistics.mean sums exactly), and the
    # ratio is the same division as here: bitwise equal
    assert result["ratio"] == {"poll": result["overhead_s"]["xffl"] / result["overhead_s"]["poll"]}
