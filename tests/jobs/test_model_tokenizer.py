"""model.tokenizer: resolved from the job file's folder; a folder without a tokenizer is
refused at validate with the file, line and field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import QUICKSTART
from xffl.core.errors import InvalidInput
from xffl.jobs.spec.load import load_job
from xffl.training.sft_demo import write_tokenizer


def _job(folder: Path, tokenizer: str) -> Path:
    data = yaml.safe_load(QUICKSTART.read_text())
    data["model"]["tokenizer"] = tokenizer
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump(data, sort_keys=False))
    return job


def test_a_relative_tokenizer_is_the_job_folders(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    write_tokenizer(tmp_path / "jobs" / "tok")
    monkeypatch.chdir(tmp_path)  # not where the job file is
    loaded = load_job(_job(tmp_path / "jobs", "tok"))
    assert loaded.spec.model.tokenizer == str(tmp_path / "jobs" / "tok")


@pytest.mark.parametrize(("make", "what"), [(False, "is not a folder"),
                                            (True, "holds no tokenizer.json or "
                                                   "tokenizer_config.json")])
def test_a_folder_without_a_tokenizer_is_refused(tmp_path: Path, make: bool,
                                                 what: str) -> None:
    if make:
        (tmp_path / "tok").mkdir()
    job = _job(tmp_path, "tok")
    with pytest.raises(InvalidInput) as info:
        load_job(job)
    line = job.read_text().splitlines().index("  tokenizer: tok") + 1
    assert info.value.lines == [
        f"{job}:{line}: job spec field model.tokenizer: {tmp_path / 'tok'} {what}; point it "
        "at the model's tokenizer folder (the one `xffl data prepare --tokenizer` took)."]
