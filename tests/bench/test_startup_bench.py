"""The start-up benchmark runs every variant (the harness on a light import; no timing is
asserted) and its ratios are the divisions of the medians it prints."""

from __future__ import annotations

import json

import pytest

from tests.bench.scripts import load_bench


def test_every_variant_runs_and_the_ratios_divide_the_medians(
        capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("startup")
    # json for torch and transformers: the variants' code paths, not their numbers, are under
    # test; the training round is a real one (tiny-test, 3 steps)
    assert bench.main(["-n", "1", "--imports", "json", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    cpu = result["cpu_s"]
    assert set(cpu) == {"python -c pass", bench.BASELINE, "imports, threshold only",
                        "imports, collect_less()", "a training round"}
    for name, rows in result["runs"].items():
        ((cpu_s, wall_s),) = rows  # one run: the median is that run (bitwise)
        assert cpu[name] == cpu_s and result["wall_s"][name] == wall_s and wall_s > 0
    # the training round imports torch: more CPU than the interpreter alone
    assert cpu["a training round"] > cpu["python -c pass"]
    assert result["ratio"] == {name: cpu[name] / cpu[bench.BASELINE]
                               for name in ("imports, threshold only", "imports, collect_less()")}
    table = bench.render(result)
    assert "imports, collect_less() / imports, CPython defaults: " in table
    assert f"target: collect_less() <= {bench.TARGET:.2f}x the baseline's CPU: " in table
