"""A site's bytes never become the global's, and no single update stops a round.

The global's config file is the coordinator's (the round's incoming global's bytes), never an
update's, even when the update's config is equal to it as a JSON value (``2.0`` for ``2``);
what an update may hold is decided by the global's kind (a checksummed ``evil.pth`` or a
listed ``slurm_job.json`` is a rejection); metric names xffl does not know, counts no job
could reach and a ``slurm_job.json`` with huge integers are each a rejection or ignored, in
every case a verdict, never an exception out of the admit step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.aggregator.conftest import write_checkpoint
from xffl.aggregator.exchange import CONFIG_FILE, INDEX_FILE, Manifest, read_manifest, sha256_file
from xffl.aggregator.kinds import WHOLE_MODEL
from xffl.aggregator.reported import Bounds
from xffl.aggregator.running import RunningAggregate
from xffl.aggregator.engine import run_strategy
from xffl.core.errors import CheckpointError
from xffl.core.layout import RunLayout
from xffl.jobs.registry.states import SiteState
from xffl.training.slurm_job import read_record
from xffl.workflows.steps.admit import SIDE_FILES, admit

CONFIG = {"hidden_size": 8, "rope_theta": 10000.0, "tie_word_embeddings": False}


def _global(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "global", {"w": torch.ones(4)}, kind="global",
                            site=None, round=0, config=CONFIG)


def _update(tmp_path: Path, glob: Path, site: str, **fields: object) -> Path:
    return write_checkpoint(tmp_path / site, {"w": torch.full((4,), 2.0)}, site=site, round=1,
                            parent=read_manifest(glob).digest(), num_samples=4,
                            config=CONFIG, **fields)  # type: ignore[arg-type]


def _rewrite(update: Path, name: str, text: str) -> None:
    """Write ``name`` into an update and list it in its manifest with its right checksum."""
    (update / name).write_text(text)
    data = json.loads((update / "manifest.json").read_text())
    data["files"][name] = sha256_file(update / name)
    (update / "manifest.json").write_text(json.dumps(data))


def test_the_globals_config_is_the_coordinators_not_a_sites(tmp_path: Path) -> None:
    glob = _global(tmp_path)
    own = (glob / "config.json").read_bytes()
    equal = json.dumps({k: float(v) if type(v) is int else v for k, v in CONFIG.items()},
                       indent=3)
    assert json.loads(equal) == CONFIG and equal.encode() != own  # 8.0 == 8 as JSON values
    ups = [_update(tmp_path, glob, "a-hostile"), _update(tmp_path, glob, "b-honest")]
    _rewrite(ups[0], "config.json", equal)
    layout = RunLayout(tmp_path / "run")
    for up in ups:  # equal as a value: admitted (its bytes are never used)
        verdict, _ = admit(layout, up.name, 1, glob, up)
        assert verdict.state == SiteState.COMPLETED, verdict.reason

    for strategy in ("fedavg", "fedavgm"):  # the two ways a global is written
        out = tmp_path / f"out-{strategy}"
        run_strategy(strategy, ups, glob, out, run_id="run-1", round=1,
                     parent_digest=read_manifest(glob).digest())
        assert (out / "config.json").read_bytes() == own, strategy
    # without a global to take them from, the coordinator's own serialisation of the value
    run_strategy("fedavg", ups[:1], None, tmp_path / "no-reference")
    written = (tmp_path / "no-reference" / "config.json").read_bytes()
    assert written != (ups[0] / "config.json").read_bytes()
    assert json.loads(written) == CONFIG
    # the running mean (xffl simulate) likewise
    running = RunningAggregate(read_manifest(glob).tensors, own)
    for up in ups:
        running.add(up, 1.0)
    running.write(tmp_path / "running", run_id="run-1", round=1, parent=None)
    assert (tmp_path / "running" / "config.json").read_bytes() == own


@pytest.mark.parametrize(("name", "text"), [
    ("evil.pth", "import os; os.system('touch /tmp/xffl-owned')\n"),
    ("slurm_job.json", json.dumps({"job_id": "12"})),
    ("model-00001-of-00001.safetensors", ""),  # a shard beside a one-file model
    ("generation_config.json", "{}"),
])
def test_files_the_globals_kind_never_holds_are_a_rejection(tmp_path: Path, name: str,
                                                            text: str) -> None:
    glob = _global(tmp_path)
    up = _update(tmp_path, glob, "hostile")
    _rewrite(up, name, text)
    verdict, manifest = admit(RunLayout(tmp_path / "run"), "hostile", 1, glob, up)
    assert (verdict.state, manifest) == (SiteState.REJECTED, None)
    assert verdict.reason == f"the manifest lists {name!r}, which a model update never holds"


@pytest.mark.parametrize("name", ["model-00001-of-00002.safetensors\n",
                                  "\nmodel-00001-of-00002.safetensors",
                                  "model-00001-of-00002.safetensors/x"])
def test_a_shard_name_is_matched_whole(name: str) -> None:
    """HEAD's pattern ended in ``$``, which also matches before a final newline."""
    names = {INDEX_FILE, CONFIG_FILE, "model-00002-of-00002.safetensors", name}
    WHOLE_MODEL.check_listed(names - {name})
    with pytest.raises(CheckpointError, match="which a model update never holds"):
        WHOLE_MODEL.check_listed(names)


def _edit(update: Path, **changes: object) -> None:
    data = json.loads((update / "manifest.json").read_text())
    data.update(changes)
    (update / "manifest.json").write_text(json.dumps(data))


def test_counts_and_metric_names_no_job_can_report_are_rejections(tmp_path: Path) -> None:
    glob = _global(tmp_path)
    layout = RunLayout(tmp_path / "run")
    unbounded = Bounds(side_files=SIDE_FILES)  # no bound from the job at all
    cases = [
        ({"num_samples": 10**15}, "num_samples is 1000000000000000, more than the 4 the"),
        ({"num_tokens": 2**53 + 1}, "num_tokens is 9007199254740993, more than the "
                                    "9007199254740992"),
        ({"metrics": {"loss": 1.0, "backdoor": 1.0}},
         "it reports 1 metric(s) xffl does not know (first: 'backdoor')"),
        ({"metrics": {f"m{i}": 1.0 for i in range(1000)}}, "it reports 1000 metric(s)"),
    ]
    for i, (changes, reason) in enumerate(cases):
        up = _update(tmp_path, glob, f"s{i}")
        _edit(up, **changes)
        bounds = Bounds(max_tokens=64, max_samples=4, side_files=SIDE_FILES) if i == 0 else \
            unbounded
        verdict, _ = admit(layout, f"s{i}", 1, glob, up, bounds)
        assert verdict.state == SiteState.REJECTED, (changes, verdict)
        assert reason in verdict.reason, verdict.reason
    up = _update(tmp_path, glob, "digits")  # 400 digits: no float holds it
    text = (up / "manifest.json").read_text().replace('"num_samples": 4', '"num_samples": '
                                                      + "9" * 400)
    (up / "manifest.json").write_text(text)
    verdict, _ = admit(layout, "digits", 1, glob, up, unbounded)
    assert verdict.state == SiteState.REJECTED
    assert "num_samples is a 400-digit number" in verdict.reason


def test_a_slurm_record_with_huge_integers_is_ignored(tmp_path: Path) -> None:
    glob = _global(tmp_path)
    up = _update(tmp_path, glob, "site")
    (up / "slurm_job.json").write_text(json.dumps(
        {"job_id": "12", "queue_wait_s": 10**30, "exit_code": 0}))
    assert read_record(up) is None  # counts as absent: nothing reaches the registry
    (up / "slurm_job.json").write_text(json.dumps(
        {"job_id": "12", "queue_wait_s": 12.5, "exit_code": 0}))
    assert read_record(up) == {"job_id": "12", "queue_wait_s": 12.5, "exit_code": 0}
    verdict, manifest = admit(RunLayout(tmp_path / "run"), "site", 1, glob, up)
    assert verdict.state == SiteState.COMPLETED and isinstance(manifest, Manifest)


def test_hardware_a_site_reports_is_checked_as_its_words(tmp_path: Path) -> None:
    """The device's name and GPU count of a manifest's ``extra`` reach `xffl status`, the
    report and the registry: a megabyte of name, control characters, a count that is no
    count and an MFU above the device's peak are each a rejection; a plain report is
    recorded in the verdict."""
    glob = _global(tmp_path)
    layout = RunLayout(tmp_path / "run")
    unbounded = Bounds(side_files=SIDE_FILES)
    cases = [
        ({"extra": {"device": "x" * (1 << 20)}}, "its device 'xxxx"),
        ({"extra": {"device": "NVIDIA\x1b[2J\x1b[31mH100"}}, "printable characters"),
        ({"extra": {"device": "H100\nround 2: completed"}}, "printable characters"),
        ({"extra": {"device": ["H100"]}}, "printable characters"),
        ({"extra": {"gpus": True}}, "its gpus True is not a whole number"),
        ({"extra": {"gpus": -1}}, "its gpus -1 is not a whole number"),
        ({"metrics": {"mfu": 50.0}}, "metric 'mfu' is 50.0; a device never runs faster"),
        ({"metrics": {"peak_memory_gib": -3.0}}, "metric 'peak_memory_gib' is -3.0"),
    ]
    for i, (changes, reason) in enumerate(cases):
        up = _update(tmp_path, glob, f"h{i}")
        _edit(up, **changes)
        verdict, _ = admit(layout, f"h{i}", 1, glob, up, unbounded)
        assert verdict.state == SiteState.REJECTED, (changes, verdict)
        assert reason in verdict.reason, verdict.reason
        assert len(verdict.reason) < 300
    up = _update(tmp_path, glob, "fine")
    _edit(up, extra={"device": "NVIDIA H100 80GB HBM3", "gpus": 4},
          metrics={"loss": 2.0, "mfu": 0.41, "tflops": 405.5, "tokens_per_s_per_gpu": 3400.0,
                   "peak_memory_gib": 61.2, "save_seconds": 12.5})
    verdict, _ = admit(layout, "fine", 1, glob, up, unbounded)
    assert verdict.state == SiteState.COMPLETED, verdict.reason
    row = verdict.site_round()
    assert (row.device, row.gpus, row.mfu, row.tflops, row.tokens_per_s_per_gpu,
            row.peak_memory_gib, row.save_seconds) == ("NVIDIA H100 80GB HBM3", 4, 0.41,
                                                       405.5, 3400.0, 61.2, 12.5)

