"""The plan is the truth: what `xffl render` writes runs as written, and it is what submit runs.

The same job (the quickstart, shortened) rendered and run by cwltool, rendered and run by
`streamflow run`, and submitted: the final global models are the same bytes, and the
cyclic workflow submit runs is the one render wrote.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from xffl.cli.app import app

runner = CliRunner()
BIN = Path(sys.executable).parent


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _render(job: Path, out: Path) -> str:
    result = runner.invoke(app, ["render", str(job), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return str(json.loads(result.stdout)["run_id"])


@pytest.mark.slow
def test_cwltool_streamflow_and_submit_give_the_same_model(tmp_path: Path,
                                                          xffl_home: Path) -> None:
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec.update(rounds=2)
    spec["training"]["steps"] = 10
    for site in spec["sites"]:
        site["ranks"] = 1
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))

    by_cwltool, by_streamflow = tmp_path / "plan-cwltool", tmp_path / "plan-streamflow"
    _render(job, by_cwltool)
    _render(job, by_streamflow)
    assert not (by_cwltool / "run.json").exists()  # no registry: the plan stands alone
    # the three runs go side by side (each in its own folders; the shared synthetic corpora
    # are written atomically): they are independent, and one after another they would leave
    # a core idle while each runner waits for its steps
    commands = {"cwltool": ([str(BIN / "cwltool"), "--enable-ext", "--outdir", "out",
                             "main.cwl", "inputs.yml"], by_cwltool),
                "streamflow": ([str(BIN / "streamflow"), "run", "streamflow.yml", "--outdir",
                                "out"], by_streamflow)}
    runs = {}
    try:
        for name, (cmd, cwd) in commands.items():  # output to files: a full pipe would block
            with (tmp_path / f"{name}.out").open("w") as out, \
                    (tmp_path / f"{name}.err").open("w") as err:
                runs[name] = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err)
        result = runner.invoke(app, ["submit", str(job), "--wait", "--json", "--timeout",
                                     "300"])
        codes = {name: proc.wait(timeout=300) for name, proc in runs.items()}
    finally:
        for proc in runs.values():
            proc.kill()
    for name, code in codes.items():
        assert code == 0, (name, (tmp_path / f"{name}.err").read_text()[-3000:])
    assert json.loads((tmp_path / "cwltool.out").read_text())["next_round"] == 3
    assert result.exit_code == 0, result.output
    run_dir = Path(json.loads(result.stdout)["run_dir"])
    # the cyclic workflow submit ran is the one render wrote (tools name the run's paths)
    for name in ("main.cwl", "round.cwl"):
        assert (run_dir / name).read_bytes() == (by_cwltool / name).read_bytes(), name

    final = [p / "rounds" / "2" / "global" / "model.safetensors"
             for p in (by_cwltool, by_streamflow, run_dir)]
    assert len({_sha256(f) for f in final}) == 1, [_sha256(f) for f in final]
    # and each plan's last model is the run's output (cwltool and StreamFlow collect it)
    for plan in (by_cwltool, by_streamflow):
        assert _sha256(plan / "out" / "global" / "model.safetensors") == _sha256(final[0])
