"""The run directory's layout: the one place that names the files of a plan and of a run.

A run directory is also a plan directory: ``xffl render`` writes the plan files below, and
``xffl submit`` writes the same plan plus ``run.json`` (the run's registration) into
``$XFFL_HOME/runs/<run>``. Every module that reads or writes a run's files asks this module
for the path, so the layout can be read in one place::

    main.cwl  round.cwl  tools/*.cwl   inputs.yml  streamflow.yml     the plan (CWL + StreamFlow)
    jobs/<site>.json                   each site's TrainJob (its configured budget)
    sbatch/<site>.sh  sbatch/<site>.j2 hand-run batch script, StreamFlow's batch template
    profiles.json                      the sites' resolved profiles (status, cancel, logs)
    rounds/0/global                    the seeded initial model
    rounds/<r>/global                  the global model after round r
    rounds/<r>/updates/<site>          the updates aggregated in round r (coordinator's names)
    rounds/<r>/attempts/<site>.json    a site's failed attempts in round r (failure manager)
    rounds/<r>/jobs/<site>.json        a site's balanced TrainJob for round r
    rounds/<r>/validation.json         the federated validation loss of round r's incoming global
    late/<site>.json                   a site's SLURM job left running at a round deadline
    rounds/<r>/adopted/<site>.json     that job, adopted by round r (its update admitted late)
    rounds/<r>/inflight/<site>.json    a site's SLURM job of round r, submitted, outcome not seen
    stopped.json                       why the run stopped early (training.stop_when)
    job.yaml  job.json  run.json       the spec as submitted, as resolved, the registration
    executions/<name>.yml              inputs of a resumed or one-round execution of main.cwl
    evaluate.cwl  tools/evaluate_<site>.cwl  streamflow-evaluate.yml   cross-site evaluation
    executions/evaluate-r<r>.yml       its inputs for round r (`xffl evaluate`)
    executions/evaluate-r<r>/<site>    a kept update as it is sent: the global's config bytes
    streamflow/evaluate.db  streamflow-evaluate.log  streamflow/outputs/<name>   its records
    streamflow/sqlite.db  streamflow/work  streamflow.log  supervisor.log  round.lock
    transfers/<site>-<direction>.json  a copy in flight's progress (xffl's data manager)
    report/  cron.log                  `xffl report`'s default folder, the cron ticks' output
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from xffl.core.files import read_json


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run (or rendered plan) directory."""

    root: Path

    @property
    def main(self) -> Path:
        """The cyclic workflow (cwltool:Loop over round.cwl)."""
        return self.root / "main.cwl"

    @property
    def round_cwl(self) -> Path:
        """One round: train at every site, admit each update, aggregate."""
        return self.root / "round.cwl"

    @property
    def tools(self) -> Path:
        """The CommandLineTools of the plan."""
        return self.root / "tools"

    @property
    def inputs(self) -> Path:
        """The job order of a whole run of main.cwl."""
        return self.root / "inputs.yml"

    @property
    def streamflow(self) -> Path:
        """The StreamFlow configuration file."""
        return self.root / "streamflow.yml"

    @property
    def profiles(self) -> Path:
        """The resolved site profiles (spec overrides applied)."""
        return self.root / "profiles.json"

    @property
    def job_yaml(self) -> Path:
        """The job spec as submitted."""
        return self.root / "job.yaml"

    @property
    def job_json(self) -> Path:
        """The job spec as resolved (validated, defaults filled in)."""
        return self.root / "job.json"

    @property
    def registration(self) -> Path:
        """``run.json``: the run id and registry of a submitted run (absent in a render)."""
        return self.root / "run.json"

    @property
    def initial_model(self) -> Path:
        """The round-0 global checkpoint the loop starts from."""
        return self.global_dir(0)

    @property
    def base_model(self) -> Path:
        """A LoRA job's frozen base model, which every site receives once per execution."""
        return self.round_dir(0) / "base"

    @property
    def streamflow_db(self) -> Path:
        """StreamFlow's database of this run's executions."""
        return self.root / "streamflow" / "sqlite.db"

    @property
    def coordinator_workdir(self) -> Path:
        """Working folders of the steps on the coordinator (same filesystem as rounds/)."""
        return self.root / "streamflow" / "work"

    @property
    def streamflow_log(self) -> Path:
        """StreamFlow's log of the run's executions."""
        return self.root / "streamflow.log"

    @property
    def supervisor_log(self) -> Path:
        """The supervisor process's own output."""
        return self.root / "supervisor.log"

    @property
    def lock(self) -> Path:
        """The round lock: one execution of a run at a time."""
        return self.root / "round.lock"

    @property
    def transfers(self) -> Path:
        """The progress files of the copies in flight, one per site and direction."""
        return self.root / "transfers"

    def transfer_progress(self, site: str, direction: str) -> Path:
        """The progress of ``site``'s copy in ``direction`` (in, out) while it runs."""
        return self.transfers / f"{site}-{direction}.json"

    @property
    def report(self) -> Path:
        """`xffl report`'s default folder."""
        return self.root / "report"

    @property
    def cron_log(self) -> Path:
        """The output of the run's cron ticks (`xffl schedule`)."""
        return self.root / "cron.log"

    def job_file(self, site: str) -> Path:
        """A site's configured TrainJob."""
        return self.root / "jobs" / f"{site}.json"

    def tool(self, name: str) -> Path:
        """tools/<name>.cwl."""
        return self.tools / f"{name}.cwl"

    def batch_script(self, site: str) -> Path:
        """The batch script of a SLURM site, to submit by hand."""
        return self.root / "sbatch" / f"{site}.sh"

    def batch_template(self, site: str) -> Path:
        """The batch template StreamFlow fills with each round's command."""
        return self.root / "sbatch" / f"{site}.j2"

    def round_dir(self, rnd: int) -> Path:
        """rounds/<rnd>."""
        return self.root / "rounds" / str(rnd)

    def global_dir(self, rnd: int) -> Path:
        """The global model after round ``rnd`` (0: the initial model)."""
        return self.round_dir(rnd) / "global"

    def kept_update(self, rnd: int, site: str) -> Path:
        """Where the update of ``site`` aggregated in round ``rnd`` is kept."""
        return self.round_dir(rnd) / "updates" / site

    def rejected_update(self, rnd: int, site: str) -> Path:
        """Where ``site``'s update rejected in round ``rnd`` is kept a while (for a look)."""
        return self.round_dir(rnd) / "rejected" / site

    def attempts_file(self, rnd: int, site: str) -> Path:
        """The failure manager's record of ``site``'s failed attempts in round ``rnd``."""
        return self.round_dir(rnd) / "attempts" / f"{site}.json"

    def final_attempts_file(self, site: str) -> Path:
        """The failure manager's record of ``site``'s failed evaluation of the final model."""
        return self.root / "final-attempts" / f"{site}.json"

    def round_job(self, rnd: int, site: str) -> Path:
        """``site``'s TrainJob as balanced for round ``rnd``."""
        return self.round_dir(rnd) / "jobs" / f"{site}.json"

    def late_job(self, site: str) -> Path:
        """``site``'s SLURM job left running at a round deadline, until a round adopts it."""
        return self.root / "late" / f"{site}.json"

    def adopted_job(self, rnd: int, site: str) -> Path:
        """The late SLURM job of ``site`` whose update round ``rnd`` took."""
        return self.round_dir(rnd) / "adopted" / f"{site}.json"

    def inflight_job(self, rnd: int, site: str) -> Path:
        """``site``'s SLURM job of round ``rnd`` from its submission until its step ends."""
        return self.round_dir(rnd) / "inflight" / f"{site}.json"

    def validation_file(self, rnd: int) -> Path:
        """The federated validation loss of the global model round ``rnd`` started from."""
        return self.round_dir(rnd) / "validation.json"

    @property
    def final_validation(self) -> Path:
        """The final model's held-out loss: every site's evaluation of the last global."""
        return self.root / "final-validation.json"

    @property
    def stopped(self) -> Path:
        """Why the run stopped before its last round (training.stop_when), when it did."""
        return self.root / "stopped.json"

    def execution_inputs(self, name: str) -> Path:
        """The job order of one execution of main.cwl that is not the whole run."""
        return self.root / "executions" / f"{name}.yml"

    @property
    def evaluate_cwl(self) -> Path:
        """The cross-site evaluation workflow: every site evaluates a round's models."""
        return self.root / "evaluate.cwl"

    @property
    def streamflow_evaluate(self) -> Path:
        """The StreamFlow configuration of the cross-site evaluation."""
        return self.root / "streamflow-evaluate.yml"

    @property
    def evaluate_db(self) -> Path:
        """StreamFlow's database of the evaluations (the run's own is left as it was)."""
        return self.root / "streamflow" / "evaluate.db"

    @property
    def evaluate_log(self) -> Path:
        """StreamFlow's log of the evaluations."""
        return self.root / "streamflow-evaluate.log"

    def evaluate_inputs(self, rnd: int) -> Path:
        """The job order of the cross-site evaluation of round ``rnd``."""
        return self.execution_inputs(f"evaluate-r{rnd}")

    def evaluate_update(self, rnd: int, site: str) -> Path:
        """``site``'s kept update of round ``rnd`` as the cross-site evaluation sends it."""
        return self.root / "executions" / f"evaluate-r{rnd}" / site

    def workflow_outputs(self, name: str) -> Path:
        """Where the outputs of the StreamFlow workflow ``name`` are collected."""
        return self.root / "streamflow" / "outputs" / name


@dataclass(frozen=True)
class Registration:
    """What makes a plan directory a registered run: its id and its registry file."""

    run_id: str
    registry: Path

    def write(self, layout: RunLayout) -> None:
        """Write run.json into the plan directory."""
        layout.registration.write_text(json.dumps(
            {"run_id": self.run_id, "registry": str(self.registry)}, indent=2) + "\n")


def registration(layout: RunLayout) -> Registration | None:
    """The run's registration, or None for a plan that was only rendered."""
    data = read_json(layout.registration)
    if data is None:
        return None
    return Registration(run_id=str(data["run_id"]), registry=Path(data["registry"]))
