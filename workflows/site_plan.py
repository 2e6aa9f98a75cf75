"""The per-site round plan: one small CWL workflow per site, which the runner runs every round.

``main.cwl`` describes the whole job as one cyclic workflow, but StreamFlow aborts every step
of a workflow as soon as one fails, so a site that fails would take the others' finished
training down with it. For retries, a quorum (``failure.min_sites``) and round timeouts the
runner therefore runs, every round, one StreamFlow workflow per site (``sites/<site>.cwl``:
the same train tool, bound to the same deployments), all in one StreamFlow context and at
the same time; StreamFlow moves the global model to the site and the update back into
``rounds/<r>/incoming/<site>/a<attempt>/update``, and the runner aggregates what arrived.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from xffl.workflows.plan import CWL_VERSION

SITES_DIR = "sites"
SITES_CONFIG = "streamflow-sites.yml"


def site_workflow(site: str) -> dict[str, Any]:
    """One site's round: the site's train tool as the single step ``/train_<site>``."""
    return {
        "cwlVersion": CWL_VERSION,
        "class": "Workflow",
        "doc": f"One round at site {site}: train the global model, return the update.",
        "inputs": {"round": "int", "model": "Directory", "job": "File"},
        "outputs": {"update": {"type": "Directory", "outputSource": f"train_{site}/update"}},
        "steps": {
            f"train_{site}": {"run": f"../tools/train_{site}.cwl",
                      "in": {"round": "round", "model": "model", "job": "job"},
                      "out": ["update"]},
        },
    }


def workflow_name(run_id: str, site: str) -> str:
    """The key of a site's workflow in streamflow-sites.yml."""
    return f"{run_id}-{site}"


def inputs_file(site: str) -> str:
    """The inputs (settings) file of a site's workflow, relative to the run directory."""
    return f"{SITES_DIR}/{site}.inputs.yml"


def sites_config(run_id: str, base: dict[str, Any], sites: list[str]) -> dict[str, Any]:
    """streamflow-sites.yml: the deployments of streamflow.yml, one workflow per site."""
    targets = {b["step"]: b["target"] for wf in base["workflows"].values()
               for b in wf["bindings"]}
    workflows = {
        workflow_name(run_id, site): {
            "type": "cwl",
            "config": {"file": f"{SITES_DIR}/{site}.cwl", "settings": inputs_file(site)},
            "bindings": [{"step": f"/train_{site}", "target": targets[f"/rounds/train_{site}"]}],
        }
        for site in sites
    }
    return {"version": base["version"], "workflows": workflows,
            "deployments": base["deployments"], "database": base["database"]}


def write_site_plan(out: Path, run_id: str, base: dict[str, Any], sites: list[str]) -> None:
    """Write sites/<site>.cwl, placeholder inputs and streamflow-sites.yml into ``out``."""
    (out / SITES_DIR).mkdir(parents=True, exist_ok=True)
    for site in sites:
        (out / SITES_DIR / f"{site}.cwl").write_text(
            yaml.safe_dump(site_workflow(site), sort_keys=False))
        round_inputs(out, site, 1, Path("../rounds/0/global"))
    (out / SITES_CONFIG).write_text(
        yaml.safe_dump(sites_config(run_id, base, sites), sort_keys=False, width=100))


def round_inputs(root: Path, site: str, rnd: int, model: Path) -> Path:
    """Point a site's workflow at round ``rnd`` and its global ``model``; return the file.

    ``model`` is absolute, or relative to the inputs file (in sites/).
    """
    path = root / inputs_file(site)
    job = f"jobs/{site}.json"
    if rnd >= 2 and (root / job).is_file():  # balanced budgets (training.balance)
        from xffl.workflows.balance import round_job  # torch: only once rounds run

        job = round_job(root, site, rnd, sorted(p.stem for p in (root / "jobs").glob("*.json")))
    data = {"round": rnd, "model": {"class": "Directory", "path": str(model)},
            "job": {"class": "File", "path": f"../{job}"}}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
