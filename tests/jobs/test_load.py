"""Job spec validation: each error names the file, the line and the field path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import QUICKSTART
from xffl.core.errors import InvalidInput
from xffl.jobs.spec.load import load_job


def _write(tmp_path: Path, data: dict) -> Path:
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    return f


def _quickstart() -> dict:
    return yaml.safe_load(QUICKSTART.read_text())


def test_quickstart_is_valid() -> None:
    loaded = load_job(QUICKSTART)
    assert [s.name for s in loaded.spec.sites] == ["alpha", "beta"]
    assert loaded.profiles["alpha"].name == "local"
    assert loaded.spec.rounds == 3


def test_wrong_type_names_field_and_line(tmp_path: Path) -> None:
    data = _quickstart()
    data["training"]["steps"] = "many"
    f = _write(tmp_path, data)
    with pytest.raises(InvalidInput) as info:
        load_job(f)
    line = f.read_text().splitlines().index("  steps: many") + 1
    assert info.value.lines == [
        f"{f}:{line}: job spec field training.steps: input should be a valid integer, "
        "unable to parse string as an integer (got 'many'); fix the value."
    ]


def test_unknown_key_suggests_the_right_one(tmp_path: Path) -> None:
    data = _quickstart()
    data["sites"][1]["rank"] = 2
    f = _write(tmp_path, data)
    with pytest.raises(InvalidInput) as info:
        load_job(f)
    assert len(info.value.lines) == 1
    assert "job spec field sites[1].rank: unknown key 'rank'; did you mean 'ranks'?" in (
        info.value.lines[0])
    assert info.value.lines[0].startswith(f"{f}:")


def test_missing_profile_suggests(tmp_path: Path) -> None:
    data = _quickstart()
    data["sites"][0]["profile"] = "locl"
    f = _write(tmp_path, data)
    with pytest.raises(InvalidInput) as info:
        load_job(f)
    msg = info.value.lines[0]
    assert msg.startswith(f"{f}:")
    assert "sites[0].profile" in msg and "'locl' not found; did you mean 'local'?" in msg


def test_duplicate_site_names(tmp_path: Path) -> None:
    data = _quickstart()
    data["sites"][1]["name"] = "alpha"
    with pytest.raises(InvalidInput, match="site name 'alpha' appears twice"):
        load_job(_write(tmp_path, data))


@pytest.mark.parametrize("bad", ["Alpha", "a b", "a;rm -rf /", "../x", "a$(id)", "x" * 40, ""])
def test_names_that_could_inject_are_refused(tmp_path: Path, bad: str) -> None:
    data = _quickstart()
    data["sites"][0]["name"] = bad
    with pytest.raises(InvalidInput, match=r"sites\[0\]\.name"):
        load_job(_write(tmp_path, data))


def test_missing_required_field(tmp_path: Path) -> None:
    data = _quickstart()
    del data["rounds"]
    with pytest.raises(InvalidInput, match=r"job spec field rounds: is required but missing"):
        load_job(_write(tmp_path, data))


def test_profile_from_job_folder(tmp_path: Path) -> None:
    (tmp_path / "site_profiles").mkdir()
    (tmp_path / "site_profiles" / "mine.yaml").write_text(
        "name: mine\nlauncher: none\nworkdir: /tmp/x\n")
    data = _quickstart()
    data["sites"][0]["profile"] = "mine"
    loaded = load_job(_write(tmp_path, data))
    assert loaded.profiles["alpha"].launcher == "none"


def test_bad_profile_names_profile_file(tmp_path: Path) -> None:
    (tmp_path / "site_profiles").mkdir()
    prof = tmp_path / "site_profiles" / "mine.yaml"
    prof.write_text("name: mine\nlauncher: mpirun\n")
    data = _quickstart()
    data["sites"][0]["profile"] = "mine"
    with pytest.raises(InvalidInput) as info:
        load_job(_write(tmp_path, data))
    assert info.value.lines[0].startswith(f"{prof}:2: site profile field launcher:")


def test_strategy_params_are_checked(tmp_path: Path) -> None:
    data = _quickstart()
    data["aggregation"] = {"strategy": "fedadam", "params": {"eta": 0.01, "beta": 0.5}}
    with pytest.raises(InvalidInput) as info:
        load_job(_write(tmp_path, data))
    assert "aggregation.params: fedadam has no parameter 'beta'" in info.value.lines[0]
    data["aggregation"]["params"] = {"eta": 0.01}
    assert load_job(_write(tmp_path, data)).spec.aggregation.params == {"eta": 0.01}


def test_tensor_parallel_must_divide_ranks_and_heads(tmp_path: Path) -> None:
    data = _quickstart()
    data["training"]["tensor_parallel"] = 2
    data["sites"][1]["ranks"] = 3
    f = _write(tmp_path, data)
    with pytest.raises(InvalidInput) as info:
        load_job(f)
    line = f.read_text().splitlines().index("  ranks: 3") + 1
    assert info.value.lines == [
        f"{f}:{line}: job spec field sites[1].ranks: 3 ranks cannot be split into "
        "tensor-parallel groups of 2; use a multiple of 2."
    ]
    data["sites"][1]["ranks"] = 4
    data["training"]["tensor_parallel"] = 8  # the tiny preset has 4 attention heads
    data["sites"][0]["ranks"] = data["sites"][1]["ranks"] = 8
    with pytest.raises(InvalidInput) as info:
        load_job(_write(tmp_path, data))
    assert len(info.value.lines) == 1
    assert "job spec field training.tensor_parallel: tensor_parallel 8 does not divide the " \
        "model's num_attention_heads (4); choose a divisor." in info.value.lines[0]
    data["training"]["tensor_parallel"] = 2
    assert load_job(_write(tmp_path, data)).spec.training.tensor_parallel == 2


def test_ddp_with_tensor_parallel_is_refused(tmp_path: Path) -> None:
    data = _quickstart()
    data["training"].update(tensor_parallel=2, data_parallel="ddp")
    with pytest.raises(InvalidInput) as info:
        load_job(_write(tmp_path, data))
    assert "training.data_parallel: data_parallel ddp does not combine with tensor_parallel" in (
        info.value.lines[0])
