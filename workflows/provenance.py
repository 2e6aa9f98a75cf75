"""A Workflow Run RO-Crate of a whole run: StreamFlow's provenance plus xffl's own records.

StreamFlow builds the crate (``streamflow prov``'s CWL Run Crate: the workflow, every step's
execution with its inputs and outputs) from the run's StreamFlow database, which holds every
execution of the run's ``main.cwl`` (the whole run, resumes, cron ticks). Checkpoints are
described, never copied: StreamFlow would zip every model it moved, so no file of a
checkpoint folder (a global or a site's update: a folder with a manifest) and no
``*.safetensors`` is embedded, whatever its size, nor any other file larger than
``embed_limit``; they stay where they are, named by their checksums in the metadata. The
profiles' ``env`` values stay out too: the embedded CWL tools keep each variable's name, its
value replaced by :data:`REDACTED`. xffl then adds what StreamFlow does not know: every
round's global model and every site's update with their sha256 digests, the SLURM job that
trained each update, and the validation numbers (each site's ``val_loss`` and ``val_tokens``,
the federated loss of the global a round started from), from the run registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from xffl.aggregator.exchange import MANIFEST_FILE
from xffl.core.layout import RunLayout
from xffl.jobs.registry.records import RunRecord
from xffl.jobs.registry.store import Registry

METADATA = "ro-crate-metadata.json"
EMBED_LIMIT = 1 << 20
XFFL = "https://xffl.dev/terms#"
REDACTED = "(value left out by xffl provenance)"


def embeddable(src: str, limit: int) -> bool:
    """Whether the crate may hold a copy of the file ``src``: a regular file of at most
    ``limit`` bytes that is no part of a checkpoint (a global's or an update's bytes)."""
    path = Path(src)
    return (path.is_file() and not path.is_symlink() and path.stat().st_size <= limit
            and path.suffix != ".safetensors" and not (path.parent / MANIFEST_FILE).exists())


class _Embedded(dict[str, str]):
    """StreamFlow's map of files to put in the archive, keeping only :func:`embeddable` ones."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, src: str, dst: str) -> None:
        if embeddable(src, self.limit):
            super().__setitem__(src, dst)


def redact_env(cwl: bytes) -> bytes:
    """A CWL document with every EnvVarRequirement's values replaced by :data:`REDACTED`
    (the names kept): the profiles' ``env`` may hold tokens and site paths."""
    doc = yaml.safe_load(cwl)
    changed = False
    for node in _walk(doc):
        if node.get("class") == "EnvVarRequirement" or "EnvVarRequirement" in node:
            holder = node if node.get("class") == "EnvVarRequirement" \
                else node["EnvVarRequirement"]
            defs = holder.get("envDef") if isinstance(holder, dict) else None
            if isinstance(defs, dict):
                holder["envDef"] = dict.fromkeys(defs, REDACTED)
                changed = True
            elif isinstance(defs, list):
                for item in defs:
                    if isinstance(item, dict) and "envValue" in item:
                        item["envValue"] = REDACTED
                        changed = True
    return yaml.safe_dump(doc, sort_keys=False).encode() if changed else cwl


def _walk(node: Any) -> Iterable[dict[str, Any]]:
    """Every mapping in a YAML document, depth first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


async def _streamflow_crate(layout: RunLayout, out: Path, embed_limit: int) -> None:
    """StreamFlow's CWL Run Crate of every execution in the run's database, into ``out``."""
    from xffl.workflows.extensions.lazy_kubernetes import install

    install()  # before StreamFlow's connectors are imported: no Kubernetes client unless used
    from streamflow.core.workflow import Workflow
    from streamflow.persistence.loading_context import DefaultDatabaseLoadingContext
    from streamflow.provenance.run_crate import CWLRunCrateProvenanceManager

    from xffl.workflows.streamflow_run import load_config, open_context

    context, _ = open_context(load_config(layout.streamflow))
    try:
        _recorded_executions_only(context.database)
        db = DefaultDatabaseLoadingContext(database=context.database)
        rows = [w for name in await _workflow_names(context)
                for w in await context.database.get_workflows_by_name(name, last_only=False)]
        workflows = [await Workflow.load(persistent_id=w["id"], loading_context=db)
                     for w in sorted(rows, key=lambda w: int(w["id"]))]
        manager = CWLRunCrateProvenanceManager(context, db, workflows)
        manager.files_map = _Embedded(embed_limit)
        with contextlib.redirect_stdout(sys.stderr):  # StreamFlow prints where it wrote
            await manager.create_archive(outdir=str(out.parent), filename=out.name,
                                         config=str(layout.streamflow), additional_files=None,
                                         additional_properties=None)
    finally:
        await context.close()


def _recorded_executions_only(database: Any) -> None:
    """Leave out of StreamFlow's crate the executions it never finished recording.

    A job the site failure manager gave up at its deadline (a round timeout, or a late job
    left running) keeps an execution row with no status and no times, which StreamFlow's
    ``create_archive`` cannot turn into a CreateAction (``Status(None)``); xffl's own
    entities describe that site's round (its state, its late SLURM job).
    """
    original = database.get_executions_by_step

    async def recorded(step_id: int) -> list[Any]:
        return [row for row in await original(step_id) if row["status"] is not None
                and row["start_time"] is not None and row["end_time"] is not None]

    database.get_executions_by_step = recorded


async def _workflow_names(context: Any) -> list[str]:
    """The names of the workflows in a StreamFlow database, each once."""
    names: list[str] = []
    for row in await context.database.get_workflows_list(None):
        if row["name"] not in names:
            names.append(row["name"])
    return names


def _entity(id_: str, type_: str, **fields: Any) -> dict[str, Any]:
    return {"@id": id_, "@type": type_, **{k: v for k, v in fields.items() if v is not None}}


def xffl_entities(registry: Registry, run: RunRecord) -> list[dict[str, Any]]:
    """Rounds, global models, updates and SLURM jobs of ``run`` as RO-Crate entities."""
    layout = RunLayout(Path(run.run_dir))
    jobs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in registry.slurm_jobs(run.id):
        jobs.setdefault((row["round"], row["site"]), []).append(row)
    entities: list[dict[str, Any]] = []
    for rnd in registry.rounds(run.id):
        global_id = f"#xffl-global-r{rnd.round}"
        updates = []
        for site in rnd.sites:
            update_id = f"#xffl-update-r{rnd.round}-{site.site}"
            job_ids = []
            for job in jobs.get((rnd.round, site.site), []):
                job_id = f"#xffl-slurm-{site.site}-{job['job_id']}"
                job_ids.append({"@id": job_id})
                entities.append(_entity(job_id, "PropertyValue", propertyID="slurm_job_id",
                                        value=job["job_id"], name=job["name"],
                                        description=f"SLURM job at {site.site}: {job['state']}"))
            digest = _manifest_digest(layout.kept_update(rnd.round, site.site))
            entities.append(_entity(
                update_id, "Dataset", name=f"update of {site.site}, round {rnd.round}",
                description=site.reason or None, identifier=job_ids or None,
                **{f"{XFFL}site": site.site, f"{XFFL}state": site.state,
                   f"{XFFL}sha256": digest, f"{XFFL}num_samples": site.num_samples,
                   f"{XFFL}num_tokens": site.num_tokens, f"{XFFL}val_loss": site.val_loss,
                   f"{XFFL}val_tokens": site.val_tokens,
                   **({f"{XFFL}staleness": site.staleness,
                       f"{XFFL}stalenessWeight": site.staleness_weight}
                      if site.staleness is not None else {}),
                   **({f"{XFFL}lateSlurmJob": site.late_job_id}
                      if site.late_job_id is not None else {})}))
            updates.append({"@id": update_id})
        entities.append(_entity(
            global_id, "Dataset", name=f"global model after round {rnd.round}",
            contentUrl=rnd.global_path, isBasedOn=updates,
            **{f"{XFFL}round": rnd.round, f"{XFFL}state": rnd.state,
               f"{XFFL}sha256": rnd.global_digest,
               # the federated validation loss the round measured, of the global before it
               f"{XFFL}incoming_val_loss": rnd.val_loss, f"{XFFL}val_tokens": rnd.val_tokens}))
    return entities


def _manifest_digest(update: Path) -> str | None:
    """The digest of a kept update (None when the round kept none of this site)."""
    from xffl.aggregator.exchange import MANIFEST_FILE, read_manifest

    return read_manifest(update).digest() if (update / MANIFEST_FILE).is_file() else None


def _rewrite(archive: Path, extra: Iterable[dict[str, Any]]) -> None:
    """Add ``extra`` entities to the crate's metadata (mentioned by its root dataset), with
    every embedded CWL document's env values redacted (:func:`redact_env`, the metadata's
    sha1 of each one updated)."""
    tmp = archive.with_suffix(".tmp")
    with zipfile.ZipFile(archive) as src, zipfile.ZipFile(tmp, "w") as dst:
        redacted = {item.filename: redact_env(src.read(item)) for item in src.infolist()
                    if item.filename.endswith(".cwl")}
        for item in src.infolist():
            data = redacted.get(item.filename) or src.read(item)
            if item.filename == METADATA:
                meta = json.loads(data)
                graph = meta["@graph"]
                root = next(e for e in graph if e.get("@id") == "./")
                for entity in graph:
                    if entity.get("@id") in redacted and "sha1" in entity:
                        entity["sha1"] = hashlib.sha1(redacted[entity["@id"]],
                                                      usedforsecurity=False).hexdigest()
                for entity in extra:
                    graph.append(entity)
                    root.setdefault("mentions", []).append({"@id": entity["@id"]})
                data = json.dumps(meta, indent=2, sort_keys=True).encode()
            dst.writestr(item, data)
    tmp.replace(archive)


def write_crate(registry: Registry, run: RunRecord, out: Path,
                embed_limit: int = EMBED_LIMIT) -> Path:
    """Write the run's RO-Crate zip to ``out`` (atomically); return its path."""
    layout = RunLayout(Path(run.run_dir))
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".xffl-crate-") as tmp:
        staged = Path(tmp) / out.name
        asyncio.run(_streamflow_crate(layout, staged, embed_limit))
        _rewrite(staged, xffl_entities(registry, run))
        staged.replace(out)
    return out
