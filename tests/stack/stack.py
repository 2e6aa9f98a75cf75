"""Two-facility test stack on 127.0.0.1: munge, SLURM clusters alpha and beta, one sshd (stdlib).

Usage::

    python tests/stack/stack.py up [--dir D]      # idempotent; fast when already healthy
    python tests/stack/stack.py status [--dir D]  # exit 0 when healthy
    python tests/stack/stack.py env [--dir D]     # shell exports (eval "$(... env)")
    python tests/stack/stack.py down [--dir D] [--purge]
    python tests/stack/stack.py stop-ctld|start-ctld CLUSTER [--dir D]

Everything lives under the state directory D (default ``$XFFL_STACK_DIR`` or
``<tempdir>/xffl-stack``); ``D/stack.json`` describes the running stack for tests.
``XFFL_STACK_INSTANCE=N`` (N > 0) makes another stack beside it (``<tempdir>/xffl-stack-N``,
ports and job ids of its own), so parallel test workers each get their own two clusters.
An SSH connection to port ``clusters[name].ssh_port`` runs with ``SLURM_CONF`` of that cluster,
so each port behaves like the login node of one facility, and with ``HOME`` at ``D/site-home``
(a facility account's home, empty): the shell sshd starts reads that home's dotfiles, not
those of whoever runs the tests (a developer's ``~/.bashrc`` that runs ``pyenv init`` cost
0.1 CPU-s per remote command, hundreds of them per test run).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
HOST = "127.0.0.1"
PARTITION = "debug"
CLUSTER_NAMES = ("alpha", "beta")
# Ports of instance 0: (slurmctld, slurmd, ssh) per cluster. Override with --ports /
# XFFL_STACK_PORTS; instance N adds 100 N to the SLURM ports and 10 N to the SSH ports.
BASE_PORTS: dict[str, tuple[int, int, int]] = {
    "alpha": (16817, 16818, 2222),
    "beta": (16827, 16828, 2223),
}


def instance() -> int:
    """Which stack of this machine: $XFFL_STACK_INSTANCE, 0 by default."""
    return int(os.environ.get("XFFL_STACK_INSTANCE") or 0)


def default_ports() -> dict[str, tuple[int, int, int]]:
    """This instance's ports."""
    n = instance()
    return {c: (ctld + 100 * n, slurmd + 100 * n, ssh + 10 * n)
            for c, (ctld, slurmd, ssh) in BASE_PORTS.items()}
DEFAULT_TIMEOUT = 30.0
REQUIRED_BINARIES = (
    "munged",
    "mungekey",
    "slurmctld",
    "slurmd",
    "sinfo",
    "scontrol",
    "sshd",
    "ssh",
    "ssh-keygen",
)
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")
HEALTHY_NODE_STATES = {"idle", "mixed", "allocated", "completing"}


class StackError(RuntimeError):
    """Raised when the stack cannot be brought up, or a daemon misbehaves."""


# --------------------------------------------------------------------------- data model


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """One SLURM cluster of the stack (one facility) and its SSH login port."""

    name: str
    ssh_port: int
    slurmctld_port: int
    slurmd_port: int
    node: str
    cpus: int
    partition: str
    dir: str
    slurm_conf: str
    jobcomp: str
    state_dir: str
    spool_dir: str
    work_dir: str
    slurmctld_pid_file: str
    slurmd_pid_file: str
    slurmctld_log: str
    slurmd_log: str


@dataclasses.dataclass(frozen=True)
class StackInfo:
    """Everything a test needs to talk to the stack; the contents of ``stack.json``."""

    version: int
    dir: str
    host: str
    user: str
    partition: str
    ssh_key: str
    ssh_pubkey: str
    known_hosts: str
    host_key_pub: str
    ssh_home: str
    sshd_config: str
    sshd_pid_file: str
    sshd_log: str
    munge_socket: str
    munge_key: str
    munged_pid_file: str
    munged_log: str
    clusters: dict[str, ClusterInfo]
    user_ca: str = ""  # private key of the CA sshd trusts for user certificates (ssh-keygen -s)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StackInfo:
        """Build from the parsed ``stack.json``."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields and k != "clusters"}
        clusters = {name: ClusterInfo(**c) for name, c in data["clusters"].items()}
        return cls(clusters=clusters, **kwargs)

    @classmethod
    def load(cls, state_dir: str | os.PathLike[str]) -> StackInfo:
        """Read ``D/stack.json``."""
        return cls.from_dict(json.loads((Path(state_dir) / "stack.json").read_text()))

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (what ``stack.json`` holds)."""
        return dataclasses.asdict(self)

    @property
    def cluster_names(self) -> list[str]:
        """Cluster names in a stable order (alpha, beta)."""
        return list(self.clusters)

    def ssh_argv(
        self,
        cluster: str,
        command: str | None = None,
        *,
        known_hosts: str | None = None,
        extra: Sequence[str] = (),
    ) -> list[str]:
        """OpenSSH client argv logging into ``cluster``'s port with strict host key checking.

        ``command`` runs in the session's HOME (``D/site-home``; sshd starts it in the
        account's own, the test runner's): what it writes without a path, such as the
        ``slurm-N.out`` of a job submitted with ``--wrap``, stays in the stack."""
        c = self.clusters[cluster]
        argv = [
            "ssh",
            "-F",
            "/dev/null",
            "-i",
            self.ssh_key,
            "-p",
            str(c.ssh_port),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            f"UserKnownHostsFile={known_hosts or self.known_hosts}",
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "ConnectTimeout=10",
            "-o",
            "LogLevel=ERROR",
            *extra,
            f"{self.user}@{self.host}",
        ]
        if command is not None:
            argv.append(f"cd && {command}")
        return argv

    def _shared_connection(self) -> tuple[str, ...]:
        """ssh options that share one connection per cluster (none when the socket's path
        would pass the 104 bytes a UNIX socket's name holds)."""
        path = f"{self.dir}/ssh-%C"  # %C: 40 hex digits of host, port and user
        if len(path) + 40 > 100:
            return ()
        return ("-o", "ControlMaster=auto", "-o", f"ControlPath={path}",
                "-o", "ControlPersist=10")

    def ssh(
        self,
        cluster: str,
        command: str,
        *,
        timeout: float = 60.0,
        known_hosts: str | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` on ``cluster``'s login port through the ``ssh`` client.

        With the stack's own known hosts, the calls to a cluster share one connection (an
        OpenSSH control master, kept 10 s after its last use): a fresh login costs the client
        ~80 ms of CPU for its key exchange, a command on the shared connection ~6, and tests
        poll squeue this way every half second. A call with other known hosts logs in afresh,
        so that its host key is checked."""
        return subprocess.run(
            self.ssh_argv(cluster, command, known_hosts=known_hosts,
                          extra=self._shared_connection() if known_hosts is None else ()),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
        )

    def slurm_env(self, cluster: str) -> dict[str, str]:
        """Environment for running SLURM client commands locally against ``cluster``."""
        return _slurm_env(self.clusters[cluster].slurm_conf)

    def jobcomp_records(self, cluster: str) -> list[dict[str, str]]:
        """Parsed ``jobcomp/filetxt`` records (one dict per finished job) of ``cluster``."""
        return parse_jobcomp(self.clusters[cluster].jobcomp)

    def wait_job(self, cluster: str, job_id: str, timeout: float) -> dict[str, str]:
        """The jobcomp record of ``job_id`` once it ended (polled every 0.2 s; ``sbatch
        --wait`` looks after 2, 10 and 42 s, so an 11 s job kept it 42 s)."""
        deadline = time.monotonic() + timeout
        while True:
            for record in self.jobcomp_records(cluster):
                if record.get("JobId") == job_id:
                    return record
            if time.monotonic() > deadline:
                raise StackError(f"job {job_id} of {cluster} did not end in {timeout:g} s")
            time.sleep(0.2)


def parse_jobcomp(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """Parse a ``jobcomp/filetxt`` file into ``KEY=VALUE`` dicts; a missing file gives []."""
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        rec: dict[str, str] = {}
        for token in line.split():
            key, sep, value = token.partition("=")
            if sep:
                rec[key] = value
        if rec:
            records.append(rec)
    return records


# --------------------------------------------------------------------------- helpers


def default_dir() -> Path:
    """The state directory: ``$XFFL_STACK_DIR``, else ``<tempdir>/xffl-stack[-N]``."""
    env = os.environ.get("XFFL_STACK_DIR")
    suffix = f"-{instance()}" if instance() else ""
    return Path(env) if env else Path(tempfile.gettempdir()) / f"xffl-stack{suffix}"


def which(name: str) -> str | None:
    """Locate a binary on PATH or in the sbin directories (which may be off a user's PATH)."""
    found = shutil.which(name)
    if found:
        return found
    for d in SBIN_DIRS:
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def missing_binaries() -> list[str]:
    """Binaries the stack needs that are not installed."""
    return [b for b in REQUIRED_BINARIES if which(b) is None]


def _bin(name: str) -> str:
    path = which(name)
    if path is None:
        raise StackError(f"{name} not found; run scripts/install-system-deps.sh (as root)")
    return path


def _slurm_env(conf: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))
    }
    env["SLURM_CONF"] = conf
    env["PATH"] = os.pathsep.join([env.get("PATH", "/usr/bin:/bin"), *SBIN_DIRS])
    return env


def _tail(path: str | os.PathLike[str], lines: int = 25) -> str:
    try:
        data = Path(path).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return f"   ({path}: no such file)"
    return "\n".join(f"   | {line}" for line in data[-lines:]) or f"   ({path}: empty)"


def _read_pid(pid_file: str | os.PathLike[str]) -> int | None:
    try:
        text = Path(pid_file).read_text().strip()
        return int(text.split()[0]) if text else None
    except (FileNotFoundError, ValueError):
        return None


def _proc_alive(pid: int, expect: str) -> bool:
    """True when ``pid`` runs (not a zombie) and its argv[0] basename starts with ``expect``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    state = stat.rpartition(")")[2].split()[0]
    if state in ("Z", "X"):
        return False
    argv0 = cmdline.split(b"\0", 1)[0].decode(errors="replace").split()
    if not argv0:
        return False
    return os.path.basename(argv0[0].rstrip(":")).startswith(expect)


def daemon_pid(pid_file: str | os.PathLike[str], expect: str) -> int | None:
    """PID of the daemon recorded in ``pid_file`` when it is running, else None."""
    pid = _read_pid(pid_file)
    if pid is not None and _proc_alive(pid, expect):
        return pid
    return None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _free_port(avoid: set[int]) -> int:
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if port not in avoid and port < 60000:
            return port
    raise StackError("could not find a free TCP port")


def _ssh_banner(port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            s.settimeout(timeout)
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def _run(
    argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 15.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def _launch(argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> int:
    """Start a self-daemonizing program; its early stdout/stderr go to ``log``."""
    with open(log, "ab") as out:
        out.write(f"--- {time.strftime('%F %T')} {shlex.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=30,
            start_new_session=True,
            check=False,
        )
    return proc.returncode


def _wait_for(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
        interval = min(interval * 1.5, 0.5)


def _write_if_changed(path: Path, text: str, mode: int = 0o644) -> bool:
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    tmp.replace(path)
    return True


# --------------------------------------------------------------------------- layout


def _parse_ports(spec: str) -> dict[str, tuple[int, int, int]]:
    """Parse ``alpha=CTLD:SLURMD:SSH,beta=...`` (or ``auto``) into a port table."""
    out: dict[str, tuple[int, int, int]] = {}
    for part in spec.split(","):
        name, _, ports = part.strip().partition("=")
        nums = tuple(int(p) for p in ports.split(":"))
        if name not in CLUSTER_NAMES or len(nums) != 3:
            raise StackError(f"bad port spec {part!r}; want alpha=CTLD:SLURMD:SSH,beta=...")
        out[name] = (nums[0], nums[1], nums[2])
    return {**default_ports(), **out}


def _auto_ports() -> dict[str, tuple[int, int, int]]:
    used: set[int] = set()
    table = {}
    for name in CLUSTER_NAMES:
        ports = []
        for _ in range(3):
            p = _free_port(used)
            used.add(p)
            ports.append(p)
        table[name] = (ports[0], ports[1], ports[2])
    return table


def _cluster_info(d: Path, name: str, ports: tuple[int, int, int]) -> ClusterInfo:
    cdir = d / name
    return ClusterInfo(
        name=name,
        slurmctld_port=ports[0],
        slurmd_port=ports[1],
        ssh_port=ports[2],
        node=f"{name}-n1",
        cpus=2,
        partition=PARTITION,
        dir=str(cdir),
        slurm_conf=str(cdir / "slurm.conf"),
        jobcomp=str(cdir / "jobcomp.txt"),
        state_dir=str(cdir / "state"),
        spool_dir=str(cdir / "spool"),
        work_dir=str(cdir / "work"),
        slurmctld_pid_file=str(cdir / "slurmctld.pid"),
        slurmd_pid_file=str(cdir / "slurmd.pid"),
        slurmctld_log=str(cdir / "slurmctld.log"),
        slurmd_log=str(cdir / "slurmd.log"),
    )


def _layout(d: Path, ports: dict[str, tuple[int, int, int]]) -> StackInfo:
    sshdir = d / "ssh"
    return StackInfo(
        version=SCHEMA_VERSION,
        dir=str(d),
        host=HOST,
        user=_user(),
        partition=PARTITION,
        ssh_key=str(sshdir / "id_ed25519"),
        ssh_pubkey=str(sshdir / "id_ed25519.pub"),
        known_hosts=str(sshdir / "known_hosts"),
        host_key_pub=str(sshdir / "ssh_host_ed25519_key.pub"),
        ssh_home=str(d / "home"),
        sshd_config=str(sshdir / "sshd_config"),
        sshd_pid_file=str(sshdir / "sshd.pid"),
        sshd_log=str(sshdir / "sshd.log"),
        munge_socket=str(d / "munge" / "munge.socket"),
        munge_key=str(d / "munge" / "munge.key"),
        munged_pid_file=str(d / "munge" / "munged.pid"),
        munged_log=str(d / "munge" / "munged.log"),
        clusters={n: _cluster_info(d, n, ports[n]) for n in CLUSTER_NAMES},
        user_ca=str(sshdir / "user_ca"),
    )


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def first_job_id(instance_number: int, cluster_index: int) -> int:
    """The first SLURM job id of a cluster of a stack instance (see _slurm_conf)."""
    return 1 + 10000 * cluster_index + 101000 * instance_number


def _slurm_conf(info: StackInfo, c: ClusterInfo) -> str:
    lines = [
        "# Generated by tests/stack/stack.py -- do not edit",
        f"ClusterName={c.name}",
        # Real facilities are different hosts; here every cluster of every instance shares
        # 127.0.0.1, so their job ids and the MASTER_PORT derived from them (20000 + id %
        # 20000, xffl.schedulers.slurm) must not meet: 100000 apart alone is 0 apart modulo
        # 20000 (two instances' n-th jobs took the same port), so each instance is also
        # shifted by 1000 ports (clusters by 10000): no two of instances 0-9 meet before
        # one of them has run 1000 jobs
        f"FirstJobId={first_job_id(instance(), CLUSTER_NAMES.index(c.name))}",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={c.slurmctld_port}",
        f"SlurmdPort={c.slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={info.munge_socket}",
        f"StateSaveLocation={c.state_dir}",
        f"SlurmdSpoolDir={c.spool_dir}",
        f"SlurmctldPidFile={c.slurmctld_pid_file}",
        f"SlurmdPidFile={c.slurmd_pid_file}",
        f"SlurmctldLogFile={c.slurmctld_log}",
        f"SlurmdLogFile={c.slurmd_log}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={c.jobcomp}",
        "ReturnToService=2",
        "MinJobAge=300",
        "KillWait=5",
        "MailProg=/bin/true",
        # Trust the CPU count below even on a runner with fewer cores.
        "SlurmdParameters=config_overrides",
        f"NodeName={c.node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={c.slurmd_port} "
        f"CPUs={c.cpus} RealMemory=2000 State=UNKNOWN",
        f"PartitionName={c.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def _root_locked(user: str) -> bool:
    try:
        for line in Path("/etc/shadow").read_text().splitlines():
            fields = line.split(":")
            if fields[0] == user:
                return fields[1].startswith("!")
    except (OSError, IndexError):
        pass
    return False


def _site_home(info: StackInfo) -> Path:
    """The HOME of the stack's SSH sessions (see the module doc)."""
    return Path(info.dir) / "site-home"


def _sshd_config(info: StackInfo) -> str:
    sshdir = Path(info.sshd_config).parent
    # Without PAM, sshd refuses accounts whose password is locked ("!"); use PAM then.
    use_pam = "yes" if _root_locked(info.user) else "no"
    lines = [
        "# Generated by tests/stack/stack.py -- do not edit",
        *(f"Port {c.ssh_port}" for c in info.clusters.values()),
        f"ListenAddress {HOST}",
        f"HostKey {sshdir / 'ssh_host_ed25519_key'}",
        f"PidFile {info.sshd_pid_file}",
        f"AuthorizedKeysFile {sshdir / 'authorized_keys'}",
        # logins with OpenSSH certificates signed by the stack's user CA (2FA facilities)
        f"TrustedUserCAKeys {sshdir / 'user_ca.pub'}",
        "AllowTcpForwarding yes",  # jump-host (ProxyJump) logins through the stack
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        f"UsePAM {use_pam}",
        "StrictModes no",
        "PrintMotd no",
        "UseDNS no",
        "X11Forwarding no",
        "Subsystem sftp /usr/lib/openssh/sftp-server",
        "MaxSessions 100",
        "MaxStartups 100:30:200",
        "LogLevel INFO",
    ]
    for c in info.clusters.values():
        lines += [
            f"Match LocalPort {c.ssh_port}",
            f"    SetEnv SLURM_CONF={c.slurm_conf} XFFL_STACK_CLUSTER={c.name} "
            f"HOME={_site_home(info)}",
        ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- health


def _node_state(c: ClusterInfo) -> str:
    r = _run(
        ["sinfo", "-h", "-N", "-n", c.node, "-o", "%T"], env=_slurm_env(c.slurm_conf), timeout=10
    )
    return r.stdout.strip() if r.returncode == 0 else f"sinfo failed: {r.stderr.strip()}"


def _munge_ok(info: StackInfo) -> bool:
    munge, unmunge = which("munge"), which("unmunge")
    if not munge or not unmunge:
        return Path(info.munge_socket).exists()
    cred = _run([munge, "-n", "-S", info.munge_socket], timeout=5)
    if cred.returncode != 0:
        return False
    r = subprocess.run(
        [unmunge, "-S", info.munge_socket],
        input=cred.stdout,
        text=True,
        capture_output=True,
        timeout=5,
        check=False,
    )
    return r.returncode == 0


def problems(info: StackInfo) -> list[str]:
    """What is wrong with a stack (empty list when healthy)."""
    out = []
    if daemon_pid(info.munged_pid_file, "munged") is None:
        out.append("munged is not running")
    for c in info.clusters.values():
        if daemon_pid(c.slurmctld_pid_file, "slurmctld") is None:
            out.append(f"{c.name}: slurmctld is not running")
        if daemon_pid(c.slurmd_pid_file, "slurmd") is None:
            out.append(f"{c.name}: slurmd is not running")
    if daemon_pid(info.sshd_pid_file, "sshd") is None:
        out.append("sshd is not running")
    if out:
        return out
    for c in info.clusters.values():
        state = _node_state(c)
        if state not in HEALTHY_NODE_STATES:
            out.append(f"{c.name}: node {c.node} state is {state!r}")
        if not _ssh_banner(c.ssh_port):
            out.append(f"{c.name}: no SSH banner on {HOST}:{c.ssh_port}")
    return out


def status(state_dir: str | os.PathLike[str] | None = None) -> tuple[StackInfo | None, list[str]]:
    """Load ``stack.json`` and check the daemons: (info or None, problems)."""
    d = Path(state_dir) if state_dir else default_dir()
    try:
        info = StackInfo.load(d)
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError) as exc:
        return None, [f"no usable {d / 'stack.json'}: {exc}"]
    return info, problems(info)


# --------------------------------------------------------------------------- start / stop


def _keys(info: StackInfo) -> None:
    sshdir = Path(info.sshd_config).parent
    sshdir.mkdir(parents=True, exist_ok=True)
    keygen = _bin("ssh-keygen")
    host_key = sshdir / "ssh_host_ed25519_key"
    ca = sshdir / "user_ca"
    for key, comment in ((host_key, "xffl-stack-host"), (Path(info.ssh_key), "xffl-stack-client"),
                         (ca, "xffl-stack-user-ca")):
        if not key.exists() or not key.with_name(key.name + ".pub").exists():
            key.unlink(missing_ok=True)
            r = _run([keygen, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)])
            if r.returncode != 0:
                raise StackError(f"ssh-keygen failed for {key}: {r.stderr.strip()}")
        key.chmod(0o600)
    pub = Path(info.ssh_pubkey).read_text().strip()
    _write_if_changed(sshdir / "authorized_keys", pub + "\n", 0o600)
    host_pub = " ".join(Path(info.host_key_pub).read_text().split()[:2])
    known = "".join(
        f"[{h}]:{c.ssh_port} {host_pub}\n"
        for c in info.clusters.values()
        for h in (HOST, "localhost")
    )
    _write_if_changed(Path(info.known_hosts), known)
    # A HOME for clients (e.g. asyncssh/StreamFlow) that only read ~/.ssh/known_hosts.
    home_ssh = Path(info.ssh_home) / ".ssh"
    home_ssh.mkdir(parents=True, exist_ok=True)
    home_ssh.chmod(0o700)
    _write_if_changed(home_ssh / "known_hosts", known)
    _write_if_changed(home_ssh / "id_ed25519", Path(info.ssh_key).read_text(), 0o600)
    _write_if_changed(home_ssh / "id_ed25519.pub", pub + "\n")


def _munge_key(info: StackInfo) -> None:
    mdir = Path(info.munge_socket).parent
    mdir.mkdir(parents=True, exist_ok=True)
    mdir.chmod(0o755)  # clients must reach the socket: the directory needs o+x
    key = Path(info.munge_key)
    if not key.exists():
        r = _run([_bin("mungekey"), "-c", "-k", str(key)])
        if r.returncode != 0 or not key.exists():
            raise StackError(f"mungekey failed: {r.stderr.strip()}")
    key.chmod(0o600)


def _fail(what: str, logs: Iterable[str | os.PathLike[str]], detail: str = "") -> StackError:
    parts = [f"{what}{': ' + detail if detail else ''}"]
    for log in logs:
        parts.append(f"  last lines of {log}:\n{_tail(log)}")
    return StackError("\n".join(parts))


def _check_port(port: int, who: str) -> None:
    if not _port_free(port):
        raise StackError(
            f"{who}: TCP port {port} is already in use by another program; "
            "stop it or choose other ports (--ports / XFFL_STACK_PORTS / --auto-ports)"
        )


def _start_munged(info: StackInfo, timeout: float) -> None:
    if daemon_pid(info.munged_pid_file, "munged"):
        return
    Path(info.munge_socket).unlink(missing_ok=True)
    mdir = Path(info.munge_socket).parent
    launch_log = mdir / "launch.log"
    rc = _launch(
        [
            _bin("munged"),
            f"--key-file={info.munge_key}",
            f"--socket={info.munge_socket}",
            f"--pid-file={info.munged_pid_file}",
            f"--log-file={info.munged_log}",
            f"--seed-file={mdir / 'munged.seed'}",
        ],
        launch_log,
    )
    if rc != 0 or not _wait_for(
        lambda: daemon_pid(info.munged_pid_file, "munged") and _munge_ok(info), timeout
    ):
        raise _fail("munged did not start", [info.munged_log, launch_log], f"exit status {rc}")


def start_slurmctld(
    state_dir: str | os.PathLike[str] | None,
    cluster: str,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    wait_idle: bool = True,
    nudge: bool = True,
) -> None:
    """Start ``cluster``'s slurmctld (no-op when running); wait until its node responds.

    A restarted controller shows the node as ``unknown`` until it pings slurmd (~4 s);
    ``nudge`` sends slurmd a SIGHUP so that it registers at once.
    """
    info = StackInfo.load(state_dir or default_dir())
    c = info.clusters[cluster]
    _start_slurmctld(info, c, timeout, nudge=nudge)
    if wait_idle:
        _wait_node(c, timeout)


def _start_slurmctld(info: StackInfo, c: ClusterInfo, timeout: float, nudge: bool = True) -> None:
    if daemon_pid(c.slurmctld_pid_file, "slurmctld"):
        return
    slurmd = daemon_pid(c.slurmd_pid_file, "slurmd")
    _check_port(c.slurmctld_port, f"{c.name} slurmctld")
    launch_log = Path(c.dir) / "launch.log"
    env = _slurm_env(c.slurm_conf)
    rc = _launch([_bin("slurmctld"), "-f", c.slurm_conf], launch_log, env)

    def ready() -> bool:
        if not daemon_pid(c.slurmctld_pid_file, "slurmctld"):
            return False
        r = _run(["scontrol", "ping"], env=env, timeout=5)
        return r.returncode == 0 and "UP" in r.stdout

    if rc != 0 or not _wait_for(ready, timeout):
        raise _fail(
            f"{c.name}: slurmctld did not start", [c.slurmctld_log, launch_log], f"exit status {rc}"
        )
    if nudge and slurmd is not None:  # let a running slurmd register now, not at the next ping
        with contextlib.suppress(ProcessLookupError):
            os.kill(slurmd, signal.SIGHUP)


def _start_slurmd(info: StackInfo, c: ClusterInfo, timeout: float) -> None:
    if daemon_pid(c.slurmd_pid_file, "slurmd"):
        return
    _check_port(c.slurmd_port, f"{c.name} slurmd")
    launch_log = Path(c.dir) / "launch.log"
    rc = _launch(
        [_bin("slurmd"), "-f", c.slurm_conf, "-N", c.node], launch_log, _slurm_env(c.slurm_conf)
    )
    if rc != 0 or not _wait_for(lambda: daemon_pid(c.slurmd_pid_file, "slurmd"), timeout):
        raise _fail(
            f"{c.name}: slurmd did not start", [c.slurmd_log, launch_log], f"exit status {rc}"
        )


def _wait_node(c: ClusterInfo, timeout: float, states: set[str] | None = None) -> None:
    want = states or HEALTHY_NODE_STATES
    last = ""

    def ok() -> bool:
        nonlocal last
        last = _node_state(c)
        return last in want

    if not _wait_for(ok, timeout):
        raise _fail(
            f"{c.name}: node {c.node} not ready within {timeout:.0f}s",
            [c.slurmd_log, c.slurmctld_log],
            f"state {last!r}",
        )


def _start_sshd(info: StackInfo, timeout: float) -> None:
    if daemon_pid(info.sshd_pid_file, "sshd"):
        return
    for c in info.clusters.values():
        _check_port(c.ssh_port, f"sshd ({c.name})")
    Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)  # privilege separation dir
    sshd = _bin("sshd")
    if not os.path.isabs(sshd):
        sshd = os.path.abspath(sshd)
    test = _run([sshd, "-t", "-f", info.sshd_config])
    if test.returncode != 0:
        raise StackError(f"sshd rejects {info.sshd_config}: {test.stderr.strip()}")
    launch_log = Path(info.sshd_config).parent / "launch.log"
    rc = _launch([sshd, "-f", info.sshd_config, "-E", info.sshd_log], launch_log)
    ports = [c.ssh_port for c in info.clusters.values()]
    if rc != 0 or not _wait_for(
        lambda: daemon_pid(info.sshd_pid_file, "sshd") and all(_ssh_banner(p) for p in ports),
        timeout,
    ):
        raise _fail("sshd did not start", [info.sshd_log, launch_log], f"exit status {rc}")


def _stop(pid_file: str, expect: str, timeout: float) -> bool:
    """SIGTERM the daemon in ``pid_file``, SIGKILL after ``timeout``; True if one was running."""
    pid = daemon_pid(pid_file, expect)
    if pid is None:
        Path(pid_file).unlink(missing_ok=True)
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if not _wait_for(lambda: not _proc_alive(pid, expect), timeout):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: not _proc_alive(pid, expect), 5)
    Path(pid_file).unlink(missing_ok=True)
    return True


def stop_slurmctld(
    state_dir: str | os.PathLike[str] | None, cluster: str, *, timeout: float = 15.0
) -> bool:
    """Stop ``cluster``'s slurmctld (a controller outage); True if it was running."""
    info = StackInfo.load(state_dir or default_dir())
    return _stop(info.clusters[cluster].slurmctld_pid_file, "slurmctld", timeout)


def _resolve_ports(d: Path, ports: str | None, auto_ports: bool) -> dict[str, tuple[int, int, int]]:
    spec = ports or os.environ.get("XFFL_STACK_PORTS")
    if spec and spec != "auto":
        return _parse_ports(spec)
    if not auto_ports and spec != "auto":
        with contextlib.suppress(Exception):  # reuse the ports of an earlier `up` in this dir
            old = StackInfo.load(d)
            return {
                n: (c.slurmctld_port, c.slurmd_port, c.ssh_port) for n, c in old.clusters.items()
            }
        return default_ports()
    with contextlib.suppress(Exception):
        old = StackInfo.load(d)
        if not problems(old):
            return {
                n: (c.slurmctld_port, c.slurmd_port, c.ssh_port) for n, c in old.clusters.items()
            }
    return _auto_ports()


def up(
    state_dir: str | os.PathLike[str] | None = None,
    *,
    ports: str | None = None,
    auto_ports: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
) -> StackInfo:
    """Bring the stack up (idempotent; returns at once when healthy) and write ``stack.json``."""
    d = Path(state_dir or default_dir()).resolve()
    if os.geteuid() != 0:
        raise StackError("the stack must run as root (slurmd, sshd root login)")
    missing = missing_binaries()
    if missing:
        raise StackError(f"missing {', '.join(missing)}; run scripts/install-system-deps.sh")
    info = _layout(d, _resolve_ports(d, ports, auto_ports))
    json_path = d / "stack.json"
    with contextlib.suppress(Exception):
        old = StackInfo.load(d)
        if old == info and not problems(info):
            return info
        if old != info:  # different ports/layout: restart everything from the new configs
            down(d)
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o755)
    _munge_key(info)
    _keys(info)
    for c in info.clusters.values():
        for sub in (c.state_dir, c.spool_dir, c.work_dir):
            Path(sub).mkdir(parents=True, exist_ok=True)
        Path(c.work_dir).chmod(0o700)  # as `xffl profiles check` wants a facility's workdir
        if _write_if_changed(Path(c.slurm_conf), _slurm_conf(info, c)):
            _stop(c.slurmd_pid_file, "slurmd", 15)
            _stop(c.slurmctld_pid_file, "slurmctld", 15)
    _site_home(info).mkdir(mode=0o700, exist_ok=True)
    if _write_if_changed(Path(info.sshd_config), _sshd_config(info)):
        _stop(info.sshd_pid_file, "sshd", 10)
    _write_if_changed(json_path, json.dumps(info.to_dict(), indent=2) + "\n")

    _start_munged(info, timeout)
    for c in info.clusters.values():
        _start_slurmctld(info, c, timeout)
        _start_slurmd(info, c, timeout)
    _start_sshd(info, timeout)
    for c in info.clusters.values():
        _wait_node(c, timeout)
    left = problems(info)
    if left:
        raise StackError("stack started but is unhealthy: " + "; ".join(left))
    return info


def down(
    state_dir: str | os.PathLike[str] | None = None, *, purge: bool = False, timeout: float = 15.0
) -> list[str]:
    """Stop every daemon of the stack (bounded wait); ``purge`` also deletes the directory."""
    d = Path(state_dir or default_dir()).resolve()
    stopped = []
    try:
        info: StackInfo | None = StackInfo.load(d)
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
        info = None
    if info is not None:
        if _stop(info.sshd_pid_file, "sshd", timeout):
            stopped.append("sshd")
        for c in info.clusters.values():
            if _stop(c.slurmd_pid_file, "slurmd", timeout):
                stopped.append(f"{c.name}/slurmd")
            if _stop(c.slurmctld_pid_file, "slurmctld", timeout):
                stopped.append(f"{c.name}/slurmctld")
        if _stop(info.munged_pid_file, "munged", timeout):
            stopped.append("munged")
    if purge and d.exists():
        if info is None and not (d / "munge").exists():
            raise StackError(f"{d} does not look like a stack directory; not deleting it")
        shutil.rmtree(d)
    return stopped


def env_lines(info: StackInfo) -> list[str]:
    """Shell ``export`` lines describing the stack (alpha is the default SLURM_CONF)."""
    q = shlex.quote
    lines = [
        f"export XFFL_STACK_DIR={q(info.dir)}",
        f"export XFFL_STACK_JSON={q(str(Path(info.dir) / 'stack.json'))}",
        f"export XFFL_STACK_SSH_KEY={q(info.ssh_key)}",
        f"export XFFL_STACK_KNOWN_HOSTS={q(info.known_hosts)}",
        f"export XFFL_STACK_SSH_HOME={q(info.ssh_home)}",
    ]
    for c in info.clusters.values():
        up_ = c.name.upper()
        lines += [
            f"export XFFL_STACK_{up_}_SSH_PORT={c.ssh_port}",
            f"export XFFL_STACK_{up_}_SLURM_CONF={q(c.slurm_conf)}",
            f"export XFFL_STACK_{up_}_JOBCOMP={q(c.jobcomp)}",
            f"export XFFL_STACK_SSH_{up_}={q(shlex.join(info.ssh_argv(c.name)))}",
        ]
    first = next(iter(info.clusters.values()))
    lines.append(f"export SLURM_CONF={q(first.slurm_conf)}")
    return lines


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(prog="stack.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--dir", default=None, help="state directory (default: %(default)s)")
        return p

    p_up = add("up", "start the stack (idempotent)")
    p_up.add_argument("--ports", help="alpha=CTLD:SLURMD:SSH,beta=CTLD:SLURMD:SSH or 'auto'")
    p_up.add_argument("--auto-ports", action="store_true", help="pick free ports")
    p_up.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT)
    p_up.add_argument(
        "--install",
        action="store_true",
        help="run scripts/install-system-deps.sh first when binaries are missing",
    )
    p_down = add("down", "stop every daemon of the stack")
    p_down.add_argument("--purge", action="store_true", help="also delete the state directory")
    add("env", "print shell exports")
    add("status", "check the daemons (exit 1 when unhealthy)")
    for name in ("stop-ctld", "start-ctld"):
        p = add(name, f"{name.split('-')[0]} one cluster's slurmctld")
        p.add_argument("cluster", choices=CLUSTER_NAMES)
    args = ap.parse_args(argv)
    d = Path(args.dir) if args.dir else default_dir()

    try:
        if args.cmd == "up":
            if args.install and missing_binaries():
                script = Path(__file__).resolve().parents[2] / "scripts" / "install-system-deps.sh"
                subprocess.run(["bash", str(script)], check=True, timeout=900)
            t0 = time.monotonic()
            info = up(d, ports=args.ports, auto_ports=args.auto_ports, timeout=args.timeout)
            ports = ", ".join(f"{c.name} ssh={c.ssh_port}" for c in info.clusters.values())
            print(
                f"stack up in {time.monotonic() - t0:.2f}s: {info.dir} ({ports})", file=sys.stderr
            )
        elif args.cmd == "down":
            stopped = down(d, purge=args.purge)
            print("stopped: " + (", ".join(stopped) or "nothing"), file=sys.stderr)
        elif args.cmd == "env":
            print("\n".join(env_lines(StackInfo.load(d))))
        elif args.cmd == "status":
            info_, probs = status(d)
            if probs:
                print("UNHEALTHY:\n  " + "\n  ".join(probs))
                return 1
            assert info_ is not None
            for c in info_.clusters.values():
                print(
                    f"{c.name}: ssh {HOST}:{c.ssh_port}, node {c.node} {_node_state(c)}, "
                    f"SLURM_CONF={c.slurm_conf}"
                )
            print("healthy")
        elif args.cmd == "stop-ctld":
            print("stopped" if stop_slurmctld(d, args.cluster) else "was not running")
        elif args.cmd == "start-ctld":
            start_slurmctld(d, args.cluster)
            print("started")
    except (StackError, FileNotFoundError, subprocess.CalledProcessError) as exc:
        print(f"stack.py {args.cmd}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
