"""The scheduler seam: SLURM implements the whole protocol, the registry names what it knows,
and SLURM's dialect (its commands and variables) lives in ``schedulers/`` and nowhere else."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from tests.conftest import REPO
from xffl.core.errors import ExitCode, InvalidInput
from xffl.schedulers.base import Ranks, Scheduler
from xffl.schedulers.registry import SCHEDULERS, current, scheduler, step_ranks
from xffl.schedulers.slurm import SLURM, Slurm

PROTOCOL_METHODS = sorted(n for n, v in vars(Scheduler).items()
                          if callable(v) and not n.startswith("_"))


def test_the_protocol_covers_the_dialect() -> None:
    """Batch options and lines, the login node's commands and parsers, the job's variables,
    end time and record: each is a method of the protocol."""
    covered = sorted(["batch_options", "name_directive", "directives", "list_command",
                      "parse_list", "job_ids_command", "cancel_command", "estimate_command",
                      "parse_estimate", "in_job", "ranks", "end_time", "job_start"])
    assert covered == PROTOCOL_METHODS


@pytest.mark.parametrize("method", PROTOCOL_METHODS)
def test_slurm_implements_each_method_with_the_protocols_signature(method: str) -> None:
    assert isinstance(SLURM, Scheduler)
    want = inspect.signature(getattr(Scheduler, method))
    got = inspect.signature(getattr(Slurm, method))
    assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == \
        [(p.name, p.kind, p.default) for p in want.parameters.values()]
    assert got.return_annotation == want.return_annotation


def test_the_registry_names_slurm_and_refuses_an_unknown_scheduler() -> None:
    assert scheduler("slurm") is SLURM and SCHEDULERS == {"slurm": SLURM}
    with pytest.raises(InvalidInput) as caught:
        scheduler("pbs", where="profiles/hpc.yaml: scheduler")
    assert caught.value.message == ("profiles/hpc.yaml: scheduler: unknown scheduler 'pbs'; "
                                    "use one of slurm.")
    assert caught.value.exit_code == ExitCode.INVALID_INPUT


def test_the_job_a_process_runs_in_is_its_schedulers() -> None:
    assert current({}) is None
    assert current({"SLURM_JOB_ID": "7"}) is SLURM
    batch = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}  # no job step
    assert step_ranks(batch) is None
    task = {**batch, "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
            "SLURM_TASKS_PER_NODE": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "29400"}
    assert step_ranks(task) == (SLURM, Ranks(rank=1, world_size=2, local_rank=1,
                                             local_world_size=2, master_addr="n1",
                                             master_port=29400))


def test_the_login_commands_come_from_one_place() -> None:
    """The squeue listing and its parser agree: the clock first, then SQUEUE_FORMAT's fields."""
    assert SLURM.list_command().startswith("date +%Y-%m-%dT%H:%M:%S; squeue -h -u")
    jobs = SLURM.parse_list("2026-11-26T10:00:00\n"
                            "12|xffl-r-a-r1|RUNNING|2026-11-26T09:59:00|2026-11-26T09:59:30|"
                            "0:30|n1\n"
                            "13|xffl-r-a-r2|PENDING|2026-11-26T09:58:00|N/A|0:00|\n"
                            "x;rm|evil|RUNNING|||0:01|n1\n")
    assert [(j.job_id, j.state, j.nodes, j.queue_wait_s, j.run_s) for j in jobs] == [
        ("12", "RUNNING", "n1", 30.0, 30.0), ("13", "PENDING", "", 120.0, 0.0)]
    assert SLURM.directives(2, 8, "00:10:00", SLURM.batch_options(
        {"partition": "gpu", "qos": None, "mem": "0"}, ["--exclusive"])) == [
        "#SBATCH --nodes=2", "#SBATCH --ntasks=8", "#SBATCH --time=00:10:00",
        "#SBATCH --partition=gpu", "#SBATCH --mem=0", "#SBATCH --exclusive"]


# SLURM's commands and variables, as they appear in code (docstrings and comments may name them)
DIALECT = re.compile(r"\b(squeue|scancel|scontrol|sacct|sbatch --test-only|SLURM_[A-Z_]+)\b")
# what still names them outside schedulers/, each SLURM's by nature
ELSEWHERE = {
    "jobs/cancel.py",  # its messages name scancel and squeue to the user
    "jobs/slurm_view.py",  # its messages: "squeue failed", "no job in squeue"
    "jobs/report/estimates.py",  # the registry's source column: "sbatch --test-only"
    "training/threads.py",  # SLURM_CPUS_PER_TASK, SLURM_JOB_NUM_NODES: srun's ranks
    "cli/logs.py",  # scontrol show job's StdOut: where the round's job wrote its log
    "site_profiles/checks.py",  # `xffl profiles check`'s SLURM rows (sbatch, squeue, sinfo)
    "site_profiles/schema.py",  # the profile's slurm section: "seconds between squeue polls"
    "training/launch.py",  # --slurm-job-name's help: "renamed with scontrol"
}


def _strings(file: Path) -> list[str]:
    """The string constants of ``file`` that are not docstrings."""
    tree = ast.parse(file.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef
                          | ast.ClassDef)
            and node.body and isinstance(node.body[0], ast.Expr)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docs]


def test_slurms_dialect_lives_in_schedulers() -> None:
    found = {str(f.relative_to(REPO))
             for pkg in ("core", "aggregator", "training", "site_profiles", "jobs",
                         "workflows", "cli")
             for f in (REPO / pkg).rglob("*.py")
             if any(DIALECT.search(text) for text in _strings(f))}
    assert found - ELSEWHERE == set()
    assert ELSEWHERE - found == set()  # a file that no longer names it leaves the list


class _PbsOnPaper(Slurm):
    """A second scheduler's entry as PBS would write it: only its connector and words differ
    here (the rest of its dialect is not what this test is about)."""

    name = "pbs"
    streamflow_connector = "streamflow.deployment.connector.queue_manager:PBSConnector"
    job_word = "PBS job"
    cancelled_word = "qdel'ed"


def test_a_second_schedulers_connector_comes_from_its_entry_alone() -> None:
    """xffl-<scheduler> is built from the registry entry over StreamFlow's own connector of the
    scheduler: a PBS entry gets upstream's PBSConnector with the deadline mixed in, its
    schema (upstream's, ``late`` and ``inflight``) and its words, with no line of
    connectors.py of its own."""
    import json

    from streamflow.deployment.connector.queue_manager import PBSConnector, SlurmConnector

    from xffl.workflows.extensions.connectors import (
        QUEUE_CONNECTORS,
        XfflQueueConnector,
        queue_connector_class,
    )
    from xffl.workflows.extensions.deadline import DeadlineMixin
    from xffl.workflows.extensions.job_end import OneTripSlurmConnector

    assert set(QUEUE_CONNECTORS) == set(SCHEDULERS)
    slurm = QUEUE_CONNECTORS["slurm"]
    assert slurm.__mro__[1:5] == (XfflQueueConnector, DeadlineMixin, OneTripSlurmConnector,
                                  SlurmConnector)
    pbs = queue_connector_class(_PbsOnPaper())
    assert pbs.__name__ == "XfflPBSConnector"
    assert pbs.__mro__[1:4] == (XfflQueueConnector, DeadlineMixin, PBSConnector)
    assert (pbs.JOB_WORD, pbs.CANCELLED) == ("PBS job", "qdel'ed")
    schema = json.loads(pbs.get_schema())
    upstream = json.loads(PBSConnector.get_schema())
    assert schema["$id"] == "https://xffl.dev/schemas/streamflow/xffl_pbs.json"
    assert set(schema["properties"]) == set(upstream["properties"]) | {"late", "inflight"}
    assert "qdel'ed" in schema["properties"]["late"]["properties"]["maxRounds"]["description"]


def test_an_entry_naming_no_queue_manager_is_refused() -> None:
    from xffl.workflows.extensions.connectors import queue_connector_class

    class _Wrong(_PbsOnPaper):
        streamflow_connector = "streamflow.deployment.connector.local:LocalConnector"

    with pytest.raises(TypeError, match="is not a StreamFlow queue manager"):
        queue_connector_class(_Wrong())
