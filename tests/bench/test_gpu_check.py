"""The one-GPU check's CPU dry run: every step of bench/gpu_check passes at tiny shapes.

Its four trainer runs start through ``xffl.training.launch`` as on the GPU, with the rank's
Python set to tests/workflows/warm_ranks.py's client (``XFFL_RANK_PYTHON``, as a container's
line would be): each rank is a fork of the shared server that imported torch and the trainer
once, instead of an interpreter paying ~3.3 CPU-s of imports of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.scripts import load_bench
from tests.workflows.warm_ranks import rank_python
from xffl.training.launch import RANK_PYTHON_ENV


@pytest.mark.slow
def test_cpu_dry_run_passes_every_step(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench("gpu_check")
    monkeypatch.setenv(RANK_PYTHON_ENV, str(rank_python()))  # the steps' launches: warm ranks
    code = bench.main(["--cpu-dry-run", "--out", str(tmp_path / "out"),
                       "--work", str(tmp_path / "work")])
    lines = capsys.readouterr().out.splitlines()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert code == 0, "\n".join(lines)
    assert [line.split()[1:3] for line in lines] == [
        [step, "PASS"] for step in ("init", "dense", "admit", "parity", "fsdp1", "lora")]
    # the dense round ran bf16 through the launcher and learned: 3 steps (of 2 accumulated
    # micro-batches each) of a byte model from its uniform loss (ln 256 = 5.5) fall by far
    # more than the gate's 0.1 (1.1 measured)
    dense = summary["dense"]
    assert dense["rc"] == 0 and dense["loss_drop"] > 0.1
    assert dense["extra"]["steps"] == 3 and dense["extra"]["grad_accum"] == 2
    assert dense["extra"]["dp"] == 1
    assert summary["admit"]["global_digest"]
    # two CPU runs of the same fp32 round are the same computation: bit for bit equal
    assert summary["parity"]["loss_gap"] == 0.0 and summary["parity"]["max_weight_gap"] == 0.0
    fsdp = summary["fsdp1"]
    assert fsdp["sharded_load_exact"] is True
    assert fsdp["fsdp_units"] == fsdp["layers"] + 1  # one unit per decoder layer, the root
    assert fsdp["admitted"]["admitted"] is True
    lora = summary["lora"]
    assert lora["admitted"]["admitted"] is True and lora["base"]["parameters"] > 0
