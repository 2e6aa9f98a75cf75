"""The cache of seeded initial models: a second run takes the first one's round 0 without
torch, under its own manifest; an entry that does not verify is never used."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import QUICKSTART
from xffl.aggregator.exchange import read_manifest, verify_checkpoint
from xffl.core.layout import RunLayout
from xffl.jobs.spec.load import load_job
from xffl.training.config import ModelSpec
from xffl.workflows.plan import init_cache
from xffl.workflows.plan.compile import write_initial_model

SECOND_RUN = """
import json, sys
from pathlib import Path
from xffl.core.layout import RunLayout
from xffl.jobs.spec.load import load_job
from xffl.workflows.plan.compile import write_initial_model
write_initial_model(RunLayout(Path(sys.argv[1])), load_job(Path(sys.argv[2])).spec, "run-2")
print(json.dumps("torch" in sys.modules))
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of this test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    return tmp_path / "xdg-cache" / "xffl" / "init"


def _model_bytes(model_dir: Path) -> dict[str, bytes]:
    files = verify_checkpoint(model_dir).files
    return {name: (model_dir / name).read_bytes() for name in files}


def test_a_second_run_takes_the_cached_model_without_torch(tmp_path: Path, cache: Path) -> None:
    spec = load_job(QUICKSTART).spec
    first = RunLayout(tmp_path / "run1")
    write_initial_model(first, spec, "run-1")  # built with torch, then cached
    (entry,) = cache.iterdir()
    assert stat.S_IMODE(cache.stat().st_mode) & 0o077 == 0  # owner-only
    assert read_manifest(entry).run_id == "run-1"

    second = tmp_path / "run2"
    done = subprocess.run([sys.executable, "-c", SECOND_RUN, str(second), str(QUICKSTART)],
                          capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout.splitlines()[-1]) is False  # no torch in that process
    reused = RunLayout(second).initial_model
    manifest = verify_checkpoint(reused)
    assert manifest.run_id == "run-2" and manifest.round == 0 and manifest.kind == "global"
    assert manifest.digest() == verify_checkpoint(first.initial_model).digest()
    assert _model_bytes(reused) == _model_bytes(first.initial_model)


def test_an_entry_that_does_not_verify_is_rebuilt(tmp_path: Path, cache: Path) -> None:
    spec = load_job(QUICKSTART).spec
    write_initial_model(RunLayout(tmp_path / "run1"), spec, "run-1")
    good = _model_bytes(RunLayout(tmp_path / "run1").initial_model)
    (entry,) = cache.iterdir()
    weights = entry / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # a flipped bit in the last weight: the checksum no longer matches
    weights.unlink()  # (the run's copy is a hard link of it: replace, do not write through)
    weights.write_bytes(bytes(data))
    assert not init_cache.reuse(entry.name, tmp_path / "refused", "run-x")
    assert not (tmp_path / "refused").exists()
    later = RunLayout(tmp_path / "run2")
    write_initial_model(later, spec, "run-2")  # built again, correct, and the entry replaced
    assert _model_bytes(later.initial_model) == good
    verify_checkpoint(entry)


def test_what_is_cached_and_by_what() -> None:
    tiny = ModelSpec(preset="tiny")
    key = init_cache.init_key(tiny, 0, None)
    assert key is not None and key == init_cache.init_key(ModelSpec(preset="tiny"), 0, None)
    others = [init_cache.init_key(tiny, 1, None), init_cache.init_key(tiny, 0, 1 << 20),
              init_cache.init_key(ModelSpec(preset="tiny-test"), 0, None),
              init_cache.init_key(ModelSpec(preset="tiny", overrides={"num_hidden_layers": 1}),
                                  0, None)]
    assert len({key, *others}) == 5
    # weights from files or from a user's code are not xffl's to version: never cached
    assert init_cache.init_key(ModelSpec(preset="tiny", init="/ckpt"), 0, None) is None
    assert init_cache.init_key(ModelSpec(preset="tiny", entry_point="pkg.mod:fn"), 0, None) is None
