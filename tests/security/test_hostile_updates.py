"""A hostile-update corpus through one real round: one honest site and many compromised ones.

Every site's "Python" is tests/security/hostile_site.py (no site trains: the round is about
admission, and a trainer's interpreter, 3.3 CPU-s, costs 60 of theirs). The honest site sends
well-formed weights of its own; every hostile site writes a well-formed update and then
alters it one way (VARIANTS: names that are paths, extra files, links, huge
and non-finite counts and metrics, wrong run, round, parent or config, impersonation,
oversized JSON, header bombs, files the global's kind never holds, metric names of its own,
...). The hostile sites have real (not synthetic) data and no ``data.max_samples``. With
failure.min_sites 1 the round must make the honest update the global model, reject each
hostile one with its reason (or admit it, where what it tried is ignored or undone: then it
weighs nothing), write the global's config.json from the coordinator's own bytes, and change
nothing outside the run directory and the sites' own folders.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from tests.security.hostile_site import ADMITTED, VARIANTS, honest_update
from tests.workflows.site_data import write_shards
from xffl.aggregator.exchange import Manifest, finalize_manifest, read_manifest, verify_checkpoint
from xffl.cli.app import app
from xffl.site_profiles.versions import probe_command

runner = CliRunner()
SCRIPT = Path(__file__).with_name("hostile_site.py")


def snapshot(root: Path, skip: list[Path]) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` but those under ``skip``: a file's size and mtime (ns)."""
    out = {}
    for path in root.rglob("*"):
        if any(path == s or s in path.parents for s in skip):
            continue
        st = path.lstat()
        out[str(path)] = (0, 0) if path.is_dir() else (st.st_size, st.st_mtime_ns)
    return out


def variant(i: int, attack: Any, reason: str | None) -> str:
    """How a failure names the variant: its site, the function that made the attack (the
    factories' inner functions are all ``attack``: the factory, ``_metric``, names it) and
    the reason expected, which tells apart the variants of one factory."""
    made_by = attack.__qualname__.split(".<locals>", 1)[0]
    return f"h{i:02d} ({made_by}, expected: {reason!r})"


def test_a_variant_is_named_by_its_factory_and_its_reason() -> None:
    named = [variant(i, attack, reason) for i, (attack, reason) in enumerate(VARIANTS)]
    assert len(set(named)) == len(VARIANTS)
    assert not any("(attack," in n for n in named), named
    (nan,) = [n for n in named if "'loss' is nan" in n]
    assert nan.endswith("(_metric, expected: \"metric 'loss' is nan\")"), nan


def test_the_hostile_sites_update_is_what_finalize_manifest_writes(tmp_path: Path) -> None:
    """hostile_site.py writes its well-formed update with the standard library alone: the
    manifest must be xffl's own for those files (else a variant could be rejected for a
    flaw of the forgery, not for its attack)."""
    glob = tmp_path / "global"
    glob.mkdir()
    save_file({"model.norm.weight": np.arange(8, dtype=np.float32),
               "lm_head.weight": np.ones((4, 8), dtype=np.float32)},
              str(glob / "model.safetensors"), metadata={"format": "pt"})
    (glob / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    finalize_manifest(glob, Manifest(kind="global", run_id="run-1", round=0))

    forged, own = tmp_path / "forged", tmp_path / "own"
    honest_update(glob, forged, "h07", 1, "run-1")
    own.mkdir()
    for name in ("model.safetensors", "config.json"):
        (own / name).write_bytes((forged / name).read_bytes())
    expected = finalize_manifest(own, Manifest(
        kind="update", run_id="run-1", round=1, site="h07", num_samples=4, num_tokens=32,
        metrics={"loss": 1.0}, parent=read_manifest(glob).digest()))
    made = verify_checkpoint(forged)
    assert made.model_dump(exclude={"created"}) == expected.model_dump(exclude={"created"})


@pytest.mark.slow
def test_hostile_updates_are_rejected_and_the_honest_one_is_the_global(
        tmp_path: Path, xffl_home: Path) -> None:
    profiles = tmp_path / "site_profiles"
    profiles.mkdir()
    wrapper = tmp_path / "hostile-python"
    # xffl submit's version probe (``python -c SOURCE``) is answered by the shell with this
    # interpreter's answer, asked once here (a Python per site answering it: 3.0 CPU-s)
    answer = subprocess.run(["sh", "-c", probe_command(sys.executable)], capture_output=True,
                            text=True, check=True).stdout
    wrapper.write_text(f"#!/bin/sh\nif [ \"$1\" = -c ]; then printf %s {shlex.quote(answer)}; "
                       f"exit 0; fi\nexec {sys.executable} {SCRIPT} \"$@\"\n")
    wrapper.chmod(0o755)
    (profiles / "hostile.yaml").write_text(yaml.safe_dump(
        {"name": "hostile", "python": str(wrapper), "launcher": "none"}))
    sites = [{"name": "honest", "profile": "hostile", "ranks": 1,
              "data": {"path": "data/alpha", "synthetic": "alpha", "synthetic_sequences": 32}}]
    sites += [{"name": f"h{i:02d}", "profile": "hostile", "ranks": 1,
               "data": {"path": "nothing", "validation": {"path": "nothing-held-out"}}}
              for i in range(len(VARIANTS))]
    spec = {"name": "hostile", "rounds": 1, "model": {"preset": "tiny-test"},
            "training": {"steps": 2, "batch_size": 2, "seq_len": 16},
            "failure": {"min_sites": 1}, "sites": sites}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    coordinator = [xffl_home / "runs", xffl_home / "sites", xffl_home / "registry.db",
                   xffl_home / "registry.db-wal", xffl_home / "registry.db-shm"]
    for i in range(len(VARIANTS)):  # data the hostile sites never read, there as submit checks
        for folder in ("nothing", "nothing-held-out"):
            write_shards(xffl_home / "sites" / f"h{i:02d}" / folder, 64)
    before = snapshot(tmp_path, coordinator)

    result = runner.invoke(app, ["submit", str(job), "--wait", "--json", "--timeout", "500"])
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert status["state"] == "completed", status["message"]
    (r1,) = status["rounds"]
    by_site = {s["site"]: s for s in r1["sites"]}
    assert by_site["honest"]["state"] == "completed"
    admitted = ["honest"]
    for i, (attack, reason) in enumerate(VARIANTS):
        row = by_site[f"h{i:02d}"]
        what = variant(i, attack, reason)
        if reason is None:  # it delivered nothing: the round went on without it
            assert row["state"] == "failed" and row["reason"], (what, row)
        elif reason == ADMITTED:
            assert row["state"] == "completed", (what, row)
            admitted.append(f"h{i:02d}")
        else:
            assert row["state"] == "rejected", (what, row)
            assert reason in row["reason"], (what, row["reason"])

    # the global model is the honest update, bit for bit (FedAvg of one update), which is
    # not the previous global (a round that kept it would fail here)
    run_dir = Path(status["run_dir"])
    glob = load_file(str(run_dir / "rounds" / "1" / "global" / "model.safetensors"))
    honest = load_file(str(run_dir / "rounds" / "1" / "updates" / "honest" / "model.safetensors"))
    before0 = load_file(str(run_dir / "rounds" / "0" / "global" / "model.safetensors"))
    assert glob.keys() == honest.keys()
    assert all(np.array_equal(glob[k], honest[k]) for k in glob)
    assert not any(np.array_equal(before0[k], honest[k]) for k in glob)
    assert sorted(p.name for p in (run_dir / "rounds" / "1" / "updates").iterdir()) == \
        sorted(admitted)
    # the global's config is the coordinator's bytes, not an admitted site's (2.0 for 2)
    assert (run_dir / "rounds" / "1" / "global" / "config.json").read_bytes() == \
        (run_dir / "rounds" / "0" / "global" / "config.json").read_bytes()

    # nothing changed outside the run directory and the sites' folders
    assert snapshot(tmp_path, coordinator) == before
    assert [p.name for p in (xffl_home / "runs").iterdir()] == [run_dir.name]
    assert not list(tmp_path.rglob("ESCAPED")) and not os.path.exists("/ESCAPED")
    assert not os.path.exists("/tmp/xffl-owned")
