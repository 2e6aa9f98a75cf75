"""A job spec's Python (``model.entry_point``) never runs on the coordinator unasked.

The attack: a collaborator's spec names an importable module whose import (and whose
function) writes a marker file. ``xffl validate``, ``render``, ``submit``, the run's
supervisor (a cron round) and ``simulate`` of that spec never create the marker without
``--trust-entry-point``; with it they do (so the marker would show a missing check), and with
``model.init`` round 0 is the init's tensors, written without importing the code.
"""

from __future__ import annotations

import json
import stat
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from xffl.cli.app import app
from xffl.core.layout import RunLayout
from xffl.jobs.registry.store import Registry
from xffl.jobs.spec.trust import TRUST_FILE
from xffl.training.checkpoint import init_global, load_model
from xffl.training.config import ModelSpec
from xffl.workflows import supervisor

runner = CliRunner()
USERS_MODEL = "tests.training.custom_model:build"  # what the evil module builds, when called


def _evil(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """An importable module whose import writes ``marker`` (and whose build() writes
    ``marker.called``): its entry point and the marker. A name of its own per test, so that
    no earlier import in this process hides the next one."""
    name = f"evil_{uuid.uuid4().hex[:12]}"
    code, marker = tmp_path / "code", tmp_path / "marker"
    code.mkdir()
    (code / f"{name}.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('imported')\n\n\n"
        "def build(config):\n"
        f"    pathlib.Path({str(marker) + '.called'!r}).write_text('called')\n"
        "    from tests.training.custom_model import build as users\n"
        "    return users(config)\n")
    monkeypatch.syspath_prepend(str(code))
    return f"{name}:build", marker


def _job(tmp_path: Path, model: dict[str, Any], **training: Any) -> Path:
    """The quickstart (two local sites) with ``model``, as a collaborator's job folder."""
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["model"] = model
    spec["training"].update(training)
    job = tmp_path / "shared" / "job.yaml"
    job.parent.mkdir(exist_ok=True)
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


def _ran(marker: Path) -> bool:
    return marker.exists() or Path(f"{marker}.called").exists()


def test_validate_and_render_never_import_it_without_the_flag(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry, marker = _evil(tmp_path, monkeypatch)
    job = _job(tmp_path, {"preset": "tiny-test", "entry_point": entry})
    assert runner.invoke(app, ["validate", str(job)]).exit_code == 0
    plan = tmp_path / "plan"
    result = runner.invoke(app, ["render", str(job), "-o", str(plan)])
    assert result.exit_code == 2, result.output
    (line,) = [x for x in result.stderr.splitlines() if x.strip()]
    spec_line = next(n for n, t in enumerate(job.read_text().splitlines(), 1)
                     if "entry_point" in t)
    assert line.startswith(f"error: {job}:{spec_line}: job spec field model.entry_point: "), line
    assert "--trust-entry-point" in line and "model.init" in line, line
    assert not plan.exists() and not _ran(marker)  # nothing written, nothing imported
    # the plan alone needs no code
    no_model = runner.invoke(app, ["render", str(job), "-o", str(plan), "--no-init-model"])
    assert no_model.exit_code == 0, no_model.output
    assert not _ran(marker)
    # the user's consent: the code runs (the marker shows a missing check would be seen)
    trusted = runner.invoke(app, ["render", str(job), "-o", str(plan), "--force",
                                  "--trust-entry-point"])
    assert trusted.exit_code == 0, trusted.output
    assert marker.read_text() == "imported" and Path(f"{marker}.called").exists()
    assert (plan / "rounds" / "0" / "global" / "model.safetensors").is_file()


def test_consent_is_not_read_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A standing ``XFFL_RENDER_TRUST_ENTRY_POINT=1`` would cover specs not yet read."""
    entry, marker = _evil(tmp_path, monkeypatch)
    job = _job(tmp_path, {"preset": "tiny-test", "entry_point": entry})
    for var in ("XFFL_RENDER_TRUST_ENTRY_POINT", "XFFL_SUBMIT_TRUST_ENTRY_POINT",
                "XFFL_SIMULATE_TRUST_ENTRY_POINT"):
        monkeypatch.setenv(var, "1")
    assert runner.invoke(app, ["render", str(job), "-o", str(tmp_path / "p")]).exit_code == 2
    assert runner.invoke(app, ["submit", str(job), "--no-start"]).exit_code == 2
    assert runner.invoke(app, ["simulate", str(job), "--sites", "2"]).exit_code == 2
    assert not _ran(marker)


def test_with_an_init_round_0_is_the_inits_tensors_and_no_code_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry, marker = _evil(tmp_path, monkeypatch)
    init = tmp_path / "shared" / "init"
    init_global("run-init", ModelSpec(preset="tiny-test", entry_point=USERS_MODEL), 3, init)
    job = _job(tmp_path, {"init": "init", "entry_point": entry})
    plan = tmp_path / "plan"
    result = runner.invoke(app, ["render", str(job), "-o", str(plan)])
    assert result.exit_code == 0, result.output
    assert not _ran(marker)
    g0 = plan / "rounds" / "0" / "global"
    want, got = load_file(init / "model.safetensors"), load_file(g0 / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    manifest = json.loads((g0 / "manifest.json").read_text())
    assert manifest["extra"]["num_parameters"] == sum(t.numel() for t in want.values())
    load_model(g0, USERS_MODEL)  # what a site does with it: the names and shapes fit
    # a LoRA adapter over the user's model needs its layers, hence its code
    lora = _job(tmp_path, {"init": "init", "entry_point": entry}, lora={"r": 2})
    refused = runner.invoke(app, ["render", str(lora), "-o", str(tmp_path / "lora")])
    assert refused.exit_code == 2 and "LoRA" in refused.stderr, refused.output
    assert not _ran(marker)


def test_submit_records_consent_and_the_supervisor_requires_it(
        tmp_path: Path, xffl_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry, marker = _evil(tmp_path, monkeypatch)
    job = _job(tmp_path, {"preset": "tiny-test", "entry_point": entry})
    refused = runner.invoke(app, ["submit", str(job), "--no-start"])
    assert refused.exit_code == 2 and "--trust-entry-point" in refused.stderr, refused.output
    assert not (xffl_home / "runs").exists()
    assert runner.invoke(app, ["runs", "--json"]).stdout.strip() == "[]"

    submitted = runner.invoke(app, ["submit", str(job), "--no-start", "--trust-entry-point",
                                    "--json"])
    assert submitted.exit_code == 0, submitted.output
    run_id, run_dir = (json.loads(submitted.stdout)[k] for k in ("run_id", "run_dir"))
    record = Path(run_dir) / TRUST_FILE
    assert json.loads(record.read_text()) == {"model.entry_point": entry}
    assert stat.S_IMODE(record.stat().st_mode) & 0o077 == 0  # the user's alone
    assert not _ran(marker)  # submit writes no round 0: the supervisor does

    monkeypatch.setattr(supervisor, "_run", lambda *args: 0)  # stop after round 0
    registry = Registry()
    for tampered in ("missing", "another"):  # consent to another entry point is none
        if tampered == "missing":
            record.unlink()
        else:
            record.write_text(json.dumps({"model.entry_point": "pkg.mod:other"}))
        tick = runner.invoke(app, ["round", run_id, "--json"])
        assert tick.exit_code == 1, tick.output
        run = registry.get_run(run_id)
        assert run.state == "failed" and "did not allow it" in run.message, run.message
        assert not _ran(marker)
        assert not (RunLayout(Path(run_dir)).initial_model / "manifest.json").exists()
        registry.set_state(run_id, "waiting", "set by the test")
    record.write_text(json.dumps({"model.entry_point": entry}))
    assert runner.invoke(app, ["round", run_id]).exit_code == 0
    assert marker.read_text() == "imported"
    assert (RunLayout(Path(run_dir)).initial_model / "manifest.json").is_file()


def test_simulate_trains_here_so_any_named_python_needs_the_flag(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Virtual sites train on this machine: even with model.init, and training.update_fn."""
    entry, marker = _evil(tmp_path, monkeypatch)
    init = tmp_path / "shared" / "init"
    init_global("run-init", ModelSpec(preset="tiny-test", entry_point=USERS_MODEL), 3, init)
    for job in (_job(tmp_path, {"init": "init", "entry_point": entry}),
                _job(tmp_path, {"preset": "tiny-test"}, update_fn=entry)):
        result = runner.invoke(app, ["simulate", str(job), "--sites", "2", "--rounds", "1",
                                     "-o", str(tmp_path / "sim")])
        assert result.exit_code == 2, result.output
        assert "--trust-entry-point" in result.stderr
        assert not (tmp_path / "sim").exists() and not _ran(marker)


def test_submit_of_a_job_with_a_local_site_needs_the_flag_for_any_python(
        tmp_path: Path, xffl_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``local`` site trains on this machine: its training imports training.update_fn, and
    model.entry_point even with model.init (HEAD submitted both without the flag, and the
    sites imported the code on the coordinator). Refused, exit 2, one sentence naming the
    file, line, field, site and fix; nothing registered or written."""
    entry, marker = _evil(tmp_path, monkeypatch)
    init = tmp_path / "shared" / "init"
    init_global("run-init", ModelSpec(preset="tiny-test", entry_point=USERS_MODEL), 3, init)
    for field in ("model.entry_point", "training.update_fn"):
        job = _job(tmp_path, {"init": "init", "entry_point": entry}) if field.startswith(
            "model") else _job(tmp_path, {"preset": "tiny-test"}, update_fn=entry)
        result = runner.invoke(app, ["submit", str(job), "--no-start"])
        assert result.exit_code == 2, result.output
        (line,) = [x for x in result.stderr.splitlines() if x.strip()]
        spec_line = next(n for n, t in enumerate(job.read_text().splitlines(), 1)
                         if field.split(".")[1] + ":" in t)
        assert line == (f"error: {job}:{spec_line}: job spec field {field}: site alpha trains "
                        f"on this machine (profile local), so `xffl submit` would import "
                        f"{entry} and run it here; read that code and pass "
                        "--trust-entry-point if you trust it."), line
        assert not (xffl_home / "runs").exists() and not _ran(marker)
        assert runner.invoke(app, ["runs", "--json"]).stdout.strip() == "[]"
    # with the flag the run is submitted (its sites import the code when they train)
    trusted = runner.invoke(app, ["submit", str(job), "--no-start", "--trust-entry-point"])
    assert trusted.exit_code == 0, trusted.output
