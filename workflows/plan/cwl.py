"""The CWL documents of a plan, as Python data: tools, the round workflow, the cyclic main.

``main.cwl`` loops (cwltool:Loop, no JavaScript engine) over ``round.cwl``. In a round every
site's ``train_<site>`` step trains at its facility, ``admit_<site>`` checks that site's
update on the coordinator as soon as it arrives (so transfers overlap the other sites'
training), and ``aggregate`` folds the admitted updates into the next global model and
answers the loop (``cwl.output.json``: model, next_round, go and each site's job file for
the next round). After the loop, when the job evaluates its final model
(``evaluation.final``), every site's ``final_evaluate_<site>`` step evaluates the loop's last
global with the site's evaluate tool (``tools/evaluate_<site>.cwl``, the one ``xffl evaluate``
runs) and ``final_validation`` combines their numbers on the coordinator; they run only when
the loop ended the run (``over``: its last round, or an early stop), not after a cron tick's
one round. Names are restricted by the schemas (:mod:`xffl.core.names`), so no user
value can inject into a CWL id, a path or a command line.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from xffl.core.names import slurm_job_name
from xffl.jobs.report.numbers import GLOBAL  # the evaluate tool's name for the global model
from xffl.workflows.plan.deployments import SLURM_NAME_OPTION

LOOP_NS = "http://commonwl.org/cwltool#"
CWL_VERSION = "v1.2"
LOOP_STEP = "rounds"
FINAL_STEP = "final_validation"  # the coordinator's step that combines the final evaluation
FINAL_FILE = "final-validation.json"  # what it writes, in the run directory and as its output


def train_step(site: str) -> str:
    """The id of a site's training step in round.cwl."""
    return f"train_{site}"


def admit_step(site: str) -> str:
    """The id of a site's admission step in round.cwl."""
    return f"admit_{site}"


def final_evaluate_step(site: str) -> str:
    """The id of a site's evaluation of the final model in main.cwl (a step of main itself)."""
    return f"final_evaluate_{site}"


def final_site_steps(site: str) -> list[str]:
    """The StreamFlow steps whose failure is the site's in the final evaluation: its
    evaluation, the transfer of its file to the coordinator."""
    return [f"/{final_evaluate_step(site)}", f"/{FINAL_STEP}/__transfer__/evaluation_{site}"]


def step_path(step: str) -> str:
    """The step's name inside StreamFlow (the loop step's sub-workflow)."""
    return f"/{LOOP_STEP}/{step}"


def site_steps(site: str) -> list[str]:
    """The StreamFlow steps whose failure is the site's: its training, the transfer back."""
    return [step_path(train_step(site)), f"{step_path(admit_step(site))}/__transfer__/update"]


def train_tool(*, run_id: str, site: str, python: str, launcher: str, ranks: int, data: str,
               keep: str, env: dict[str, str], slurm: bool,
               time_limit: float | None, lora: bool = False) -> dict[str, Any]:
    """The CommandLineTool that trains one round at ``site`` and outputs ``update/``.

    At a SLURM site the launcher gets the round's job name (``--slurm-job-name``): it renames
    the job, which StreamFlow submits under the site's prefix, and records it in
    ``update/slurm_job.json``. ``keep`` is the folder at the site where the launcher keeps
    the site's last update, so a round run again from the same global is not trained again.
    ``lora``: the tool also takes the frozen base model (``base``), which StreamFlow brings
    to the site once and links in later rounds; ``model`` is then the global adapter.
    """
    own = ["--ranks", str(ranks), "--launcher", launcher, "--keep", keep]
    if slurm:
        own += [SLURM_NAME_OPTION, slurm_job_name(run_id, site, "$(inputs.round)")]
    requirements: dict[str, Any] = {
        "EnvVarRequirement": {"envDef": {"PYTHONUNBUFFERED": "1", **env}}}
    if time_limit is not None:  # failure.round_timeout: a deadline, queue wait included
        requirements["ToolTimeLimit"] = {"timelimit": math.ceil(time_limit)}
    return {
        "cwlVersion": CWL_VERSION,
        "class": "CommandLineTool",
        "doc": f"Train one round at site {site} and write update/ (safetensors + manifest).",
        "requirements": requirements,
        "baseCommand": [python, "-m", "xffl.training.launch"],
        "arguments": [
            *own, "--",
            "--job", "$(inputs.job.path)", "--round", "$(inputs.round)",
            "--model", "$(inputs.model.path)", "--data", data, "--out", "update",
            *(["--base", "$(inputs.base.path)"] if lora else []),
        ],
        "inputs": {"round": "int", "model": "Directory", "job": "File",
                   **({"base": "Directory"} if lora else {})},
        "outputs": {"update": {"type": "Directory", "outputBinding": {"glob": "update"}}},
    }


def coordinator_tool(module: str, doc: str, arguments: list[str], inputs: dict[str, Any],
                     outputs: dict[str, Any]) -> dict[str, Any]:
    """A CommandLineTool that runs one of xffl's steps on the coordinator, with this Python:
    ``python -m xffl.workflows.steps STEP``, in the run's warm step server when it listens
    (:mod:`xffl.workflows.steps.handoff`)."""
    package, _, step = module.rpartition(".")
    return {"cwlVersion": CWL_VERSION, "class": "CommandLineTool", "doc": doc,
            "baseCommand": [sys.executable, "-m", package, step], "arguments": arguments,
            "inputs": inputs, "outputs": outputs}


def _bound(kind: str, prefix: str) -> dict[str, Any]:
    """A tool input of type ``kind`` passed as ``prefix VALUE``."""
    return {"type": kind, "inputBinding": {"prefix": prefix}}


def admit_tool(run_dir: str) -> dict[str, Any]:
    """The CommandLineTool that admits (or rejects) one site's update on the coordinator (the
    job's exchange and LoRA rules it reads from the run's ``job.json``)."""
    return coordinator_tool(
        "xffl.workflows.steps.admit",
        "Check one site's update against the round's global model; output it with a "
        "verdict (accepted, rejected or failed, and why).",
        ["--run-dir", run_dir],
        {"site": _bound("string", "--site"), "round": _bound("int", "--round"),
         "model": _bound("Directory", "--previous"), "update": _bound("Directory?", "--update"),
         "max_tokens": _bound("long?", "--max-tokens"),
         "max_samples": _bound("long?", "--max-samples"),
         "max_val_samples": _bound("long?", "--max-val-samples"),
         "val_seq_len": _bound("long?", "--val-seq-len")},
        {"update": "Directory?", "verdict": "File"})


def aggregate_tool(run_dir: str, sites: list[str], final: bool = False) -> dict[str, Any]:
    """The CommandLineTool that aggregates a round on the coordinator and answers the loop.

    ``final``: the plan evaluates the final model, so the step also answers ``last_round``
    (the round it aggregated) and ``over`` (whether the run ends with it).

    What the job asks of aggregation the step reads from the run's ``job.json``. Each site's
    inputs are bound under the coordinator's own name for it
    (``--update=SITE=PATH``), never under a name an update gives itself.
    """
    per_site: dict[str, Any] = {}
    for s in sites:
        for name, kind in (("update", "Directory?"), ("verdict", "File"), ("job", "File")):
            per_site[f"{name}_{s}"] = {
                "type": kind, "inputBinding": {"prefix": f"--{name}={s}=", "separate": False}}
    return coordinator_tool(
        "xffl.workflows.steps.aggregate",
        "Aggregate the admitted updates into rounds/<r>/global, record the round, and "
        "decide on the next one (cwl.output.json: model, next_round, go, job files).",
        ["--run-dir", run_dir, "--sites", ",".join(sites)],
        {"round": _bound("int", "--round"), "max_rounds": _bound("int", "--max-rounds"),
         "model": _bound("Directory", "--previous"), **per_site},
        {"model": "Directory", "next_round": "int", "go": "boolean",
         **({"last_round": "int", "over": "boolean"} if final else {}),
         **{f"job_{s}": "File" for s in sites}})


def round_workflow(sites: list[str], bounds: dict[str, tuple[int | None, ...]],
                   lora: bool = False, final: bool = False) -> dict[str, Any]:
    """One round: train at every site, admit each update, aggregate.

    ``bounds``: each site's (max tokens, max samples, max held-out sequences, targets of a
    held-out sequence) its admission checks the update's report against (None: no bound;
    for the last two, no validation).
    ``lora``: the sites also take the frozen ``base``. ``final``: the round also outputs
    ``last_round`` and ``over`` (for the final model's evaluation after the loop).
    """
    base = {"base": "base"} if lora else {}
    ends = ["last_round", "over"] if final else []
    steps: dict[str, Any] = {}
    for s in sites:
        limits = {name: {"default": value} for name, value
                  in zip(("max_tokens", "max_samples", "max_val_samples", "val_seq_len"),
                         bounds[s],
                         strict=True)
                  if value is not None}
        steps[train_step(s)] = {
            "run": f"tools/train_{s}.cwl",
            "in": {"round": "round", "model": "model", "job": f"job_{s}", **base},
            "out": ["update"],
        }
        steps[admit_step(s)] = {
            "run": "tools/admit.cwl",
            "in": {"site": {"default": s}, "round": "round", "model": "model",
                   "update": f"{train_step(s)}/update", **limits},
            "out": ["update", "verdict"],
        }
    steps["aggregate"] = {
        "run": "tools/aggregate.cwl",
        "in": {"round": "round", "max_rounds": "max_rounds", "model": "model",
               **{f"update_{s}": f"{admit_step(s)}/update" for s in sites},
               **{f"verdict_{s}": f"{admit_step(s)}/verdict" for s in sites},
               **{f"job_{s}": f"job_{s}" for s in sites}},
        "out": ["model", "next_round", "go", *ends, *(f"job_{s}" for s in sites)],
    }
    return {
        "cwlVersion": CWL_VERSION,
        "class": "Workflow",
        "doc": "One federated round: train at every site, admit each update on the "
        "coordinator, aggregate.",
        "inputs": {"round": "int", "go": "boolean", "max_rounds": "int", "model": "Directory",
                   **{f"job_{s}": "File" for s in sites},
                   **({"base": "Directory"} if lora else {})},
        "outputs": {
            "model": {"type": "Directory", "outputSource": "aggregate/model"},
            "next_round": {"type": "int", "outputSource": "aggregate/next_round"},
            "go": {"type": "boolean", "outputSource": "aggregate/go"},
            **{name: {"type": kind, "outputSource": f"aggregate/{name}"}
               for name, kind in zip(ends, ("int", "boolean"), strict=False)},
            **{f"job_{s}": {"type": "File", "outputSource": f"aggregate/job_{s}"}
               for s in sites},
        },
        "steps": steps,
    }


def final_validation_tool(run_dir: str, sites: list[str]) -> dict[str, Any]:
    """The CommandLineTool that combines the sites' evaluations of the final model on the
    coordinator (each site's file bound under the coordinator's name for it)."""
    return coordinator_tool(
        "xffl.workflows.steps.final_validation",
        "Combine every site's held-out loss of the final global model into "
        "final-validation.json (and the registry); a site whose evaluation failed is left out.",
        ["--run-dir", run_dir, "--sites", ",".join(sites)],
        {"round": _bound("int", "--round"),
         **{f"evaluation_{s}": {"type": "File?", "inputBinding": {
             "prefix": f"--evaluation={s}=", "separate": False}} for s in sites}},
        {"validation": {"type": "File?", "outputBinding": {"glob": FINAL_FILE}}})


def final_steps(sites: list[str]) -> dict[str, Any]:
    """main.cwl's steps after the loop: every site evaluates the loop's last global with its
    last job file, the coordinator combines the numbers; all only when the run is ``over``."""
    when = "$(inputs.over)"
    ends = {"round": f"{LOOP_STEP}/last_round", "over": f"{LOOP_STEP}/over"}
    steps: dict[str, Any] = {
        final_evaluate_step(s): {
            "run": f"tools/evaluate_{s}.cwl", "when": when,
            "in": {**ends, f"model_{GLOBAL}": f"{LOOP_STEP}/model", "job": f"{LOOP_STEP}/job_{s}"},
            "out": ["evaluation"]} for s in sites}
    steps[FINAL_STEP] = {
        "run": f"tools/{FINAL_STEP}.cwl", "when": when,
        "in": {**ends, **{f"evaluation_{s}": f"{final_evaluate_step(s)}/evaluation"
                          for s in sites}},
        "out": ["validation"]}
    return steps


def main_workflow(sites: list[str], lora: bool = False, final: bool = False) -> dict[str, Any]:
    """The cyclic workflow: round.cwl again while the aggregate step says ``go``.

    ``lora``: a LoRA job's frozen ``base`` model enters every round unchanged (it is not
    one of the loop's fed-back values). ``final``: then the final model's evaluation
    (:func:`final_steps`).
    """
    jobs = {f"job_{s}": f"job_{s}" for s in sites}
    base = {"base": "base"} if lora else {}
    ends = ["last_round", "over"] if final else []
    return {
        "cwlVersion": CWL_VERSION,
        "class": "Workflow",
        "doc": "Federated training: rounds of round.cwl from first_round until the aggregate "
        "step stops the loop (after max_rounds, or when a round fails).",
        "$namespaces": {"cwltool": LOOP_NS},
        "requirements": {"SubworkflowFeatureRequirement": {}},
        "inputs": {"first_round": "int", "max_rounds": "int", "model": "Directory",
                   **{f"job_{s}": "File" for s in sites},
                   **({"base": "Directory"} if lora else {})},
        "outputs": {
            "model": {"type": "Directory", "outputSource": f"{LOOP_STEP}/model"},
            "next_round": {"type": "int", "outputSource": f"{LOOP_STEP}/next_round"},
            # an output of the workflow, so that a runner waits for it (StreamFlow ends a
            # workflow, cancelling what still runs, once its outputs are complete)
            **({FINAL_STEP: {"type": "File?", "outputSource": f"{FINAL_STEP}/validation"}}
               if final else {}),
        },
        "steps": {
            LOOP_STEP: {
                "run": "round.cwl",
                "in": {"round": "first_round", "go": {"default": True},
                       "max_rounds": "max_rounds", "model": "model", **jobs, **base},
                "out": ["model", "next_round", "go", *ends, *jobs],
                "requirements": {
                    "cwltool:Loop": {
                        "loopWhen": "$(inputs.go)",
                        "loop": {"round": "next_round", "model": "model", "go": "go", **jobs},
                        "outputMethod": "last",
                    }
                },
            },
            **(final_steps(sites) if final else {}),
        },
    }
