"""A dropped SSH connection in the middle of a copy, on the real two-cluster stack.

Beta's login is reached through bench/transfer/proxy.py at 2 MB/s, so that copying its
12.6 MB update (or the round's global) takes seconds; in one round of a run of beta alone
the test SIGKILLs the sshd session process serving the global's copy out (``dd`` of it at
the site), then the one serving the update's copy back (``head`` of it there). Each drop
waits on events, not on time: once the coordinator's progress file shows a megabyte moved,
the proxy is stopped (SIGSTOP: the copy holds still, partway, however slow the machine),
``xffl watch`` and ``xffl status`` are read until they show it, the session is killed and
the proxy goes on (SIGCONT). With the default failure policy (``failure.retries`` 0) the
round completes, beta's SLURM job ran once, each copy resumed
(the update back from what had arrived), and both copies hold the bytes they copied (the
site's global is the coordinator's, the coordinator's update the site's).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from tests.stack.profiles import write_profile
from tests.stack.sessions import kill_session, session_serving
from xffl.aggregator.exchange import verify_checkpoint
from xffl.cli.app import app
from xffl.core.layout import RunLayout
from xffl.jobs.inflight import copies_in_flight
from xffl.jobs.registry.store import Registry

runner = CliRunner()
PROXY = Path(__file__).resolve().parents[2] / "bench" / "transfer" / "proxy.py"
RATE = 2_000_000  # bytes/s each way: the 12.6 MB update takes ~6 s, a command's kB ~1 ms


def _job(tmp_path: Path, stack: Any, name: str, beta_port: int | None = None) -> Path:
    profiles = tmp_path / "site_profiles"
    profiles.mkdir(exist_ok=True)
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    spec.update(name=name, rounds=1)
    # a wider MLP: a 12.6 MB update, far more than the socket buffers on the way hold
    spec["model"]["overrides"] = {"intermediate_size": 8192}
    spec["training"].update(steps=2, batch_size=4)
    # beta alone: its copies are under test, and a second site would only add its training
    # and its own (unthrottled) copies
    spec["sites"] = [site for site in spec["sites"] if site["name"] == "beta"]
    for site in spec["sites"]:
        site["ranks"] = 1
        site["profile"] = write_profile(profiles, stack.clusters[site["name"]], stack)
        site["data"]["path"] = str(tmp_path / "data" / site["name"])
        site["data"]["synthetic_sequences"] = 64
    if beta_port is not None:  # beta through the proxy: its port, its host key there
        known = tmp_path / "known_hosts"
        key = Path(stack.host_key_pub).read_text().split()[:2]
        known.write_text(f"[127.0.0.1]:{beta_port} {' '.join(key)}\n")
        path = profiles / f"{spec['sites'][0]['profile']}.yaml"
        profile = yaml.safe_load(path.read_text())
        profile["connector"].update(port=beta_port, known_hosts=str(known))
        profile["connector"]["transfer"] = {"retry_delay": 1}
        path.write_text(yaml.safe_dump(profile))
    job = tmp_path / f"{name}.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


@dataclass(frozen=True)
class Proxy:
    """The rate-capped proxy in front of beta's login port: its port and its process."""

    port: int
    proc: subprocess.Popen[str]


@pytest.fixture
def slow_beta(slurm_stack: Any) -> Iterator[Proxy]:
    """A 2 MB/s proxy in front of beta's login port."""
    proc = subprocess.Popen([sys.executable, str(PROXY),
                             str(slurm_stack.clusters["beta"].ssh_port), "0", str(RATE)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield Proxy(int(proc.stdout.readline()), proc)
    finally:
        proc.send_signal(signal.SIGCONT)  # in case a failed drop left it stopped
        proc.kill()
        proc.wait(timeout=10)


XFFL = str(Path(sys.executable).parent / "xffl")


def _status_in_flight(direction: str, deadline: float) -> list[str]:
    """What `xffl status` and `xffl status --json` print once both show beta's copy in
    ``direction`` in flight with some bytes moved (read again until then), or the last they
    printed."""
    printed: list[str] = []
    while time.monotonic() < deadline:
        procs = [subprocess.Popen([XFFL, "status", "last", "--no-live", *opts],
                                  stdout=subprocess.PIPE, text=True)
                 for opts in ([], ["--json"])]
        printed = [p.communicate(timeout=60)[0] for p in procs]
        with contextlib.suppress(ValueError):
            copies = json.loads(printed[1])["copies"]
            if any(c["direction"] == direction and c["bytes"] > 0 for c in copies) \
                    and "copies in flight" in printed[0]:
                break
    return printed


def _watched(line: str, deadline: float) -> str:
    """What `xffl watch` printed until a line matched ``line`` (or until ``deadline``)."""
    watch = subprocess.Popen([XFFL, "watch", "last", "--timeout", "120"],
                             stdout=subprocess.PIPE, text=True)
    assert watch.stdout is not None
    printed: list[str] = []
    timer = threading.Timer(max(0.0, deadline - time.monotonic()), watch.kill)
    timer.start()
    try:
        for text in watch.stdout:  # one line per poll (0.5 s) while the run goes on
            printed.append(text)
            if re.search(line, text):
                break
    finally:
        timer.cancel()
        watch.kill()
        watch.wait(timeout=60)
    return "".join(printed)


MOVED = 1_000_000  # bytes: more than a checkpoint's JSON files, a 13th of the update


def _moving(direction: str, deadline: float) -> None:
    """Wait until the last run's coordinator reports beta's copy in ``direction`` with MOVED
    bytes moved (its progress file, rewritten every half second while the copy runs): the
    model's file is then partway, ~0.5 s into its ~6 s at the proxy's rate."""
    while time.monotonic() < deadline:
        runs = Registry().list_runs()
        if runs and any(c.site == "beta" and c.direction == direction and c.bytes >= MOVED
                        for c in copies_in_flight(runs[0].run_dir)):
            return
        time.sleep(0.05)
    raise AssertionError(f"beta's copy {direction} never showed {MOVED} bytes moved")


WATCHED = {"in": r"copy-out to beta: [\d.]+ of 12\.8 MB, [\d.]+ MB/s",
           "out": r"copy-back from beta: [\d.]+ of 12\.8 MB, [\d.]+ MB/s"}


def _run_with_drops(tmp_path: Path, stack: Any, proxy: Proxy, name: str,
                    drops: Sequence[tuple[tuple[str, ...], str]]
                    ) -> tuple[dict[str, Any], list[str], list[list[str]]]:
    """Submit the job (beta through the proxy); for each ``(words, direction)`` of ``drops``
    in turn, once a command with ``words`` runs and the copy has moved bytes, stop the proxy
    (the copy holds still), read `xffl watch`, `xffl status` and `xffl status --json` until
    they show it, kill the session serving that command and let the proxy go on; (the run's
    status, the killed sessions' command lines, what `xffl watch`, `xffl status` and `xffl
    status --json` printed meanwhile, a list per drop)."""
    killed: list[str] = []
    seen: list[list[str]] = []

    def drop() -> None:
        for words, direction in drops:
            deadline = time.monotonic() + 240
            # the session, not the command: the command may have handed its last bytes to
            # sshd before the kill, and sshd holds them until the proxy takes them
            while (session := session_serving(*words)) is None:
                assert time.monotonic() < deadline, f"no command with {words} ran"
                time.sleep(0.02)
            _moving(direction, time.monotonic() + 120)
            proxy.proc.send_signal(signal.SIGSTOP)
            try:  # the frozen copy: watched and shown side by side, the freeze kept short
                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    watch = pool.submit(_watched, WATCHED[direction], time.monotonic() + 120)
                    status = pool.submit(_status_in_flight, direction, time.monotonic() + 120)
                    watched, shown = watch.result(timeout=180), status.result(timeout=180)
                killed.append(kill_session(session))
            finally:
                proxy.proc.send_signal(signal.SIGCONT)
            seen.append([watched, *shown])

    killer = threading.Thread(target=drop, daemon=True)
    killer.start()
    result = runner.invoke(app, ["submit", str(_job(tmp_path, stack, name, proxy.port)),
                                 "--wait", "--json"])
    killer.join(timeout=120)
    assert len(killed) == len(seen) == len(drops), ("a copy was never seen in flight", killed)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), killed, seen


def _files(folder: Path) -> dict[str, str]:
    """The SHA-256 of every file in ``folder`` (by name)."""
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.iterdir()) if f.is_file()}


def _check_progress(seen: list[str], direction: str, line: str) -> None:
    """`xffl watch` printed ``line`` (bytes so far of the 12.8 MB, MB/s); `xffl status`
    showed beta's copy in flight in its table and in --json: bytes so far, MB/s, ETA."""
    watched, table, data = seen
    assert re.search(line, watched), watched
    what = "update back" if direction == "out" else "global out"
    assert re.search(rf"^beta\t{what}\t[\d.]+\t12\.8\t[\d.]+\t\d+$", table, re.M), table
    (copy,) = [c for c in json.loads(data)["copies"] if c["direction"] == direction]
    assert copy["site"] == "beta" and 0 < copy["bytes"] < copy["total"], copy
    assert 12.7e6 < copy["total"] < 12.9e6 and copy["mb_s"] > 0 and copy["eta_s"] > 0, copy


def _check(status: dict[str, Any], stack: Any) -> str:
    """The run completed, beta's job ran once, its global verifies; the run's log."""
    assert status["state"] == "completed" and status["rounds_done"] == 1, status["message"]
    (r,) = status["rounds"]
    assert {s["site"]: s["state"] for s in r["sites"]} == {"beta": "completed"}
    assert {s["site"]: s["attempts"] for s in r["sites"]} == {"beta": 1}
    name = f"xffl-{status['run_id']}-beta-r1"
    jobs = [rec["JobState"] for rec in stack.jobcomp_records("beta") if rec.get("Name") == name]
    assert jobs == ["COMPLETED"]
    run_dir = Path(status["run_dir"])
    assert set(verify_checkpoint(run_dir / "rounds" / "1" / "global").extra["sites"]) == {"beta"}
    # the registry kept each finished copy of beta's: the global out, the update back, each
    # with its bytes (the 12.8 MB, JSON files included), seconds and MB/s; none in flight
    assert status["copies"] == []
    moved = {t["direction"]: t for t in status["transfers"]
             if t["site"] == "beta" and t["round"] == 1 and (t["bytes"] or 0) > 12e6}
    assert set(moved) == {"in", "out"}, status["transfers"]
    for t in moved.values():
        assert t["bytes"] < 12.9e6 and t["seconds"] > 0, t
        assert t["mb_s"] == pytest.approx(t["bytes"] / t["seconds"] / 1e6, rel=1e-9), t
    return RunLayout(run_dir).streamflow_log.read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.waits
def test_a_copy_out_and_a_copy_back_survive_killed_sshd_sessions(
        tmp_path: Path, slurm_stack: Any, slow_beta: Proxy,  # type: ignore[no-untyped-def]
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One round, two drops at beta: the global's copy out (``dd`` there), then the
    update's copy back (``head`` of it there; its path names the update folder, so the
    hashing of the global's prefix when the copy out resumes is not taken for it)."""
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    work = slurm_stack.clusters["beta"].work_dir
    status, sessions, (seen_out, seen_back) = _run_with_drops(
        tmp_path, slurm_stack, slow_beta, "drops",
        ((("dd of=", work, "model.safetensors"), "in"),
         (("head -c", work, "/update/model.safetensors"), "out")))
    assert all("@" in session for session in sessions)
    # `xffl watch` and `xffl status` showed each copy in flight: bytes so far, MB/s, ETA
    _check_progress(seen_out, "in", WATCHED["in"])
    _check_progress(seen_back, "out", WATCHED["out"])
    log = _check(status, slurm_stack)
    # the copy out was tried again ...
    retried = re.search(r"copy of '(\S+/global)' to '(\S+)' at the site dropped .*; attempt 2 "
                        r"of 6", log)
    assert retried, log[-3000:]
    # ... and the copy back went on from what had arrived (a prefix whose SHA-256 matched
    # at the site)
    resumed = re.findall(r"RESUMING copy of '(\S+/update)' from the site: 'model\.safetensors' "
                         r"bytes 0\+(\d+) from (\d+)", log)
    assert resumed and 0 < int(resumed[0][2]) < int(resumed[0][1]), (sessions, log[-3000:])
    # both arrived whole: the site's global is the coordinator's round-0 global, and the
    # update the coordinator admitted is the one the site wrote, byte for byte (the stack's
    # site folders are on this machine)
    run_dir = Path(status["run_dir"])
    sent = run_dir / "rounds" / "0" / "global"
    assert Path(retried[1]).resolve() == sent.resolve(), retried[0]
    for there, here in ((Path(retried[2]), sent),
                        (Path(resumed[0][0]), run_dir / "rounds" / "1" / "updates" / "beta")):
        files = _files(here)
        assert "model.safetensors" in files and _files(there) == files, (there, here)
