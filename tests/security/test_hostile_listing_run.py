"""A real run on the two-cluster stack with one facility whose ``find`` never stops listing.

Alpha's login is a second sshd of the stack's whose account has a ``find`` first on its
PATH (``ForceCommand``): asked for xffl-ssh's listing of a copy back (its ``-printf`` of
kinds, sizes and names), it prints a 256 MiB listing of distinct names; any other ``find``
is the real one. Alpha trains honestly, its update's copy back is refused at the listing's
cap, and that is alpha's recorded failure of the round: beta's round completes and the run's
global is beta's alone; the site got to send no more than the listing's cap and what the
channel holds. The coordinator's memory is measured in tests/security/test_hostile_reads.py
against a hostile server.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from tests.stack.extra_login import extra_login
from tests.stack.profiles import write_profile
from xffl.aggregator.exchange import verify_checkpoint
from xffl.cli.app import app

runner = CliRunner()

# xffl-ssh's listing has "f %s %P" in its -printf; 256 MiB of "f 1 nNNN" entries, then exit;
# what got into sshd's channel is also written to {sent} (tee stops where the channel closed)
HOSTILE_FIND = r"""#!/bin/sh
case "$*" in
  *"f %s %P"*)
    { printf 'd 0 \0'; seq 0 99999999 | sed 's/^/f 1 n/' | tr '\n' '\0'; } |
      head -c 268435456 | tee -a {sent}
    ;;
  *) exec {real} "$@" ;;
esac
"""


@pytest.fixture
def hostile_find_login(slurm_stack: Any, tmp_path: Path) -> Iterator[int]:
    """The port of an sshd that logs into cluster alpha with the hostile ``find``."""
    alpha = slurm_stack.clusters["alpha"]
    bin_dir = tmp_path / "hostile-bin"
    bin_dir.mkdir()
    (bin_dir / "find").write_text(HOSTILE_FIND.replace("{real}", str(shutil.which("find")))
                                  .replace("{sent}", str(tmp_path / "listing-sent")))
    (bin_dir / "find").chmod(0o755)
    with extra_login(slurm_stack, tmp_path, [
            f"SetEnv SLURM_CONF={alpha.slurm_conf} XFFL_STACK_CLUSTER=alpha",
            f'ForceCommand PATH={bin_dir}:$PATH; export PATH; eval "$SSH_ORIGINAL_COMMAND"',
    ]) as port:
        yield port


def _job(tmp_path: Path, stack: Any, port: int) -> Path:
    """One small round at the two clusters, alpha through the hostile login; one valid
    update is enough for the round (``failure.min_sites: 1``)."""
    profiles = tmp_path / "site_profiles"
    profiles.mkdir()
    known = tmp_path / "known_hosts"
    host_key = " ".join(Path(stack.host_key_pub).read_text().split()[:2])
    known.write_text(Path(stack.known_hosts).read_text() + f"[127.0.0.1]:{port} {host_key}\n")
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    spec.update(name="endless-listing", rounds=1, failure={"min_sites": 1})
    spec["training"].update(steps=2, batch_size=4)
    for site in spec["sites"]:
        site["ranks"] = 1
        name = write_profile(profiles, stack.clusters[site["name"]], stack)
        if site["name"] == "alpha":
            path = profiles / f"{name}.yaml"
            profile = yaml.safe_load(path.read_text())
            profile["connector"].update(port=port, known_hosts=str(known))
            path.write_text(yaml.safe_dump(profile))
        site["profile"] = name
        site["data"]["path"] = str(tmp_path / "data" / site["name"])
        site["data"]["synthetic_sequences"] = 64
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


@pytest.mark.slow
def test_an_endless_listing_is_that_sites_failure_and_the_round_completes(
        tmp_path: Path, slurm_stack: Any, hostile_find_login: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    result = runner.invoke(app, ["submit", str(_job(tmp_path, slurm_stack, hostile_find_login)),
                                 "--wait", "--json"])
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert status["state"] == "completed" and status["rounds_done"] == 1, status["message"]
    (rnd,) = status["rounds"]
    sites = {s["site"]: s for s in rnd["sites"]}
    assert (sites["alpha"]["state"], sites["beta"]["state"]) == ("failed", "completed"), sites
    assert "refused" in sites["alpha"]["reason"] and "more than" in sites["alpha"]["reason"], \
        sites["alpha"]
    run_dir = Path(status["run_dir"])
    assert set(verify_checkpoint(run_dir / "rounds" / "1" / "global").extra["sites"]) == \
        {"beta"}
    # the coordinator read no further than the listing's cap (a few hundred entries for the
    # quickstart's global): the site got that, the channel's 16 MiB window and the pipes'
    # buffers out, not its 256 MiB (HEAD read them all)
    assert (tmp_path / "listing-sent").stat().st_size < 32 << 20
