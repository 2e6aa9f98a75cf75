"""The plain-JSON reading of a run's profiles agrees with the validated one, and is careful."""

from __future__ import annotations

import json
from pathlib import Path

from xffl.core.layout import RunLayout
from xffl.jobs.registry.profiles_json import may_log_in, slurm_site_names
from xffl.jobs.slurm_view import load_profiles, slurm_sites
from xffl.site_profiles.lookup import bundled_dir, load_profile_file


def _write(run_dir: Path, text: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    RunLayout(run_dir).profiles.write_text(text)


def test_bundled_profiles_read_the_same_both_ways(tmp_path: Path) -> None:
    profiles = {p.stem: load_profile_file(p)
                for p in sorted(bundled_dir().glob("*.yaml"))}
    assert {"local", "leonardo"} <= set(profiles)
    for chosen in (["local"], ["local", "leonardo"], ["lumi", "karolina"]):
        run = tmp_path / "-".join(chosen)
        _write(run, json.dumps({f"site-{n}": profiles[n].model_dump(mode="json")
                                for n in chosen}))
        validated = load_profiles(run)
        assert slurm_site_names(run) == {s for s, p in validated.items() if p.slurm is not None}
        assert may_log_in(run) == bool(slurm_sites(run)) == (chosen != ["local"])


def test_what_cannot_be_read_is_left_to_the_validated_reading(tmp_path: Path) -> None:
    assert not may_log_in(tmp_path / "none") and slurm_site_names(tmp_path / "none") == set()
    for bad in ("{", "[]", '{"a": 1}', '{"a": {"connector": "ssh"}}'):
        _write(tmp_path / "bad", bad)
        assert may_log_in(tmp_path / "bad"), bad
    _write(tmp_path / "bad", "{")
    assert slurm_site_names(tmp_path / "bad") == set()
