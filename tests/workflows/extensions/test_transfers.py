"""Which StreamFlow copies the transfer clock times, and that it never fails a round."""

from __future__ import annotations

from pathlib import Path

from streamflow.core.deployment import ExecutionLocation

from xffl.core.layout import RunLayout
from xffl.workflows.extensions.transfers import TransferClock


def _loc(deployment: str) -> ExecutionLocation:
    return ExecutionLocation(name=f"{deployment}-0", deployment=deployment)


def _clock() -> TransferClock:
    """A clock for beta's two deployments and alpha's one (its StreamFlow parts unused)."""
    clock = TransferClock.__new__(TransferClock)
    clock.layout = None
    clock.sites = {"login-beta": "beta", "slurm-beta": "beta", "site-alpha": "alpha"}
    return clock


def test_direction_of_a_copy() -> None:
    clock = _clock()
    coordinator, local = _loc("coordinator"), _loc("__LOCAL__")
    assert clock.direction(coordinator, [_loc("slurm-beta")]) == ("beta", "in")
    assert clock.direction(_loc("login-beta"), [local]) == ("beta", "out")
    assert clock.direction(_loc("site-alpha"), [coordinator, local]) == ("alpha", "out")
    assert clock.direction(coordinator, [local]) is None             # inside the coordinator
    assert clock.direction(_loc("site-alpha"), [_loc("login-beta")]) is None  # site to site
    assert clock.direction(coordinator, [_loc("site-alpha"), _loc("login-beta")]) is None


def test_an_unregistered_plan_records_nothing(tmp_path: Path) -> None:
    clock = _clock()
    clock.record("beta", "in", 1.0, 2.0)  # no run directory: nothing to write, no error
    clock.layout = RunLayout(tmp_path)  # a rendered plan: no run.json
    clock.record("beta", "in", 1.0, 2.0)
    assert list(tmp_path.iterdir()) == []


def test_a_registry_that_cannot_be_written_never_fails_the_transfer(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    (tmp_path / "run.json").write_text(
        f'{{"run_id": "r-1", "registry": "{blocker}/registry.db"}}')
    clock = _clock()
    clock.layout = RunLayout(tmp_path)
    clock.record("beta", "out", 1.0, 2.0)  # logged as a warning, not raised
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-a-dir", "run.json"]


def test_tree_bytes_counts_regular_files_only(tmp_path: Path) -> None:
    from xffl.workflows.extensions.transfers import tree_bytes

    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a").write_bytes(b"x" * 300)
    (tmp_path / "d" / "sub" / "b").write_bytes(b"y" * 45)
    (tmp_path / "big").write_bytes(b"z" * 10_000)
    (tmp_path / "d" / "link").symlink_to(tmp_path / "big")  # a link inside is not followed
    assert tree_bytes(tmp_path / "d") == 345
    assert tree_bytes(tmp_path / "d" / "a") == 300
    # the path itself may be a link: a local site's update, handed back by reference
    (tmp_path / "handed").symlink_to(tmp_path / "d")
    assert tree_bytes(tmp_path / "handed") == 345
    assert tree_bytes(tmp_path / "nowhere") is None
