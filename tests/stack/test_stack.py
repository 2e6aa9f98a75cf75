"""Tests of the two-facility stack against the real munge, SLURM and sshd daemons."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.stack.fixtures import StackInfo, stack
from tests.stack.stack import CLUSTER_NAMES, first_job_id
from xffl.schedulers.slurm import SLURM

ALPHA, BETA = "alpha", "beta"


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (
        f"rc={result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result.stdout


def test_stack_json_describes_two_clusters(slurm_stack: StackInfo) -> None:
    """stack.json round-trips and names two distinct clusters with distinct ports."""
    info = StackInfo.load(slurm_stack.dir)
    assert info == slurm_stack
    assert set(info.clusters) == {ALPHA, BETA}
    ports = [
        p for c in info.clusters.values() for p in (c.ssh_port, c.slurmctld_port, c.slurmd_port)
    ]
    assert len(set(ports)) == len(ports)
    for c in info.clusters.values():
        assert Path(c.slurm_conf).is_file()
        assert c.partition == info.partition == "debug"
    known = Path(info.known_hosts).read_text()
    for c in info.clusters.values():
        assert f"[127.0.0.1]:{c.ssh_port} ssh-ed25519 " in known


@pytest.mark.parametrize("cluster", [ALPHA, BETA])
def test_sinfo_over_ssh(slurm_stack: StackInfo, cluster: str) -> None:
    """Each login port answers sinfo with the debug partition."""
    out = _ok(slurm_stack.ssh(cluster, "sinfo -h -o %P"))
    assert out.split() == ["debug*"]


def test_each_port_talks_to_its_cluster(slurm_stack: StackInfo) -> None:
    """`scontrol show config` reports alpha on one port and beta on the other."""
    for cluster in (ALPHA, BETA):
        out = _ok(slurm_stack.ssh(cluster, "scontrol show config | grep ClusterName"))
        assert out.split() == ["ClusterName", "=", cluster]


def test_a_login_reads_the_sites_home_not_the_test_runners(slurm_stack: StackInfo) -> None:
    """HOME of every session is D/site-home, so the shell reads that home's dotfiles: a marker
    in its .bashrc is printed (bash run by sshd reads ~/.bashrc), the runner's is not read."""
    home = Path(slurm_stack.dir) / "site-home"
    (home / ".bashrc").write_text("XFFL_SITE_RC=read\n")
    try:
        for cluster in (ALPHA, BETA):
            out = _ok(slurm_stack.ssh(cluster, 'echo "$HOME ${XFFL_SITE_RC:-unread}"'))
            assert out.split() == [str(home), "read"]
    finally:
        (home / ".bashrc").unlink()


@pytest.mark.slow
def test_sbatch_wait_completes_on_alpha_only(slurm_stack: StackInfo) -> None:
    """A 2-task job submitted via alpha's port completes and is recorded by alpha only."""
    alpha = slurm_stack.clusters[ALPHA]
    before_alpha = len(slurm_stack.jobcomp_records(ALPHA))
    before_beta = len(slurm_stack.jobcomp_records(BETA))
    # -n 2: a plain `sbatch --wrap 'srun -n 2 ...'` gets a 1-CPU allocation and its srun fails
    # with "More processors requested than permitted", as on any SLURM cluster.
    cmd = (
        f"sbatch --wait --parsable -n 2 --job-name xffl-test -D {alpha.work_dir} "
        f"-o {alpha.work_dir}/%x-%j.out --wrap 'srun -n 2 hostname'"
    )
    out = _ok(slurm_stack.ssh(ALPHA, cmd, timeout=120))
    job_id = out.strip().split(";")[0]
    assert job_id.isdigit(), out

    def records() -> list[dict[str, str]]:
        return [
            r for r in slurm_stack.jobcomp_records(ALPHA)[before_alpha:] if r.get("JobId") == job_id
        ]

    deadline = time.monotonic() + 10  # the record is normally written before sbatch returns
    while not records() and time.monotonic() < deadline:
        time.sleep(0.1)
    recs = records()
    assert len(recs) == 1, slurm_stack.jobcomp_records(ALPHA)[before_alpha:]
    assert recs[0]["Name"] == "xffl-test"
    assert recs[0]["JobState"] == "COMPLETED"
    assert recs[0]["NodeList"] == alpha.node
    assert not [
        r for r in slurm_stack.jobcomp_records(BETA)[before_beta:] if r.get("Name") == "xffl-test"
    ]
    lines = Path(alpha.work_dir, f"xffl-test-{job_id}.out").read_text().split()
    assert len(lines) == 2
    # sacct -c reads the same jobcomp file.
    sacct = _ok(slurm_stack.ssh(ALPHA, f"sacct -c -n -P -j {job_id} -o JobName,State"))
    assert "xffl-test|COMPLETED" in sacct.split()


def test_wrong_host_key_is_refused(slurm_stack: StackInfo, tmp_path: Path) -> None:
    """With a known_hosts entry holding another key, the client refuses the server."""
    other = tmp_path / "other_key"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    other_pub = " ".join(other.with_name("other_key.pub").read_text().split()[:2])
    port = slurm_stack.clusters[ALPHA].ssh_port
    bad_known = tmp_path / "known_hosts"
    bad_known.write_text(f"[127.0.0.1]:{port} {other_pub}\n")
    r = slurm_stack.ssh(ALPHA, "true", known_hosts=str(bad_known), timeout=30)
    assert r.returncode == 255
    assert "Host key verification failed" in r.stderr


def test_unknown_host_is_refused(slurm_stack: StackInfo, tmp_path: Path) -> None:
    """With an empty known_hosts and StrictHostKeyChecking=yes, the client refuses too."""
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    r = slurm_stack.ssh(BETA, "true", known_hosts=str(empty), timeout=30)
    assert r.returncode == 255
    assert "Host key verification failed" in r.stderr


@pytest.mark.slow
def test_slurmctld_outage_and_recovery(slurm_stack: StackInfo) -> None:
    """stop_slurmctld makes beta's controller unreachable; start_slurmctld brings it back."""
    try:
        assert stack.stop_slurmctld(slurm_stack.dir, BETA)
        # `scontrol ping` answers at once; sinfo/squeue/sbatch retry ~9 s before failing.
        r = slurm_stack.ssh(BETA, "scontrol ping", timeout=60)
        assert r.returncode != 0
        assert "DOWN" in r.stdout
        # alpha is unaffected
        assert _ok(slurm_stack.ssh(ALPHA, "sinfo -h -o %P")).split() == ["debug*"]
    finally:
        stack.start_slurmctld(slurm_stack.dir, BETA)
    assert _ok(slurm_stack.ssh(BETA, "sinfo -h -o %P")).split() == ["debug*"]
    assert not stack.problems(slurm_stack)


def test_stack_instances_never_share_a_rendezvous_port() -> None:
    """Every cluster of every instance shares 127.0.0.1: the MASTER_PORT SLURM's ranks derive
    from their job id must differ between any two of them for their first 1000 jobs (with
    instances 100000 job ids apart alone, the n-th jobs of two instances took one port)."""
    owner: dict[int, tuple[int, int]] = {}
    for inst in range(10):
        for cluster in range(len(CLUSTER_NAMES)):
            for n in range(1000):
                job = first_job_id(inst, cluster) + n
                ranks = SLURM.ranks({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0",
                                     "SLURM_NTASKS": "2", "SLURM_JOB_ID": str(job),
                                     "MASTER_ADDR": "127.0.0.1"})
                assert ranks is not None
                assert owner.setdefault(ranks.master_port, (inst, cluster)) == (inst, cluster)
