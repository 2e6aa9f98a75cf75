"""`xffl evaluate`: cross-site validation as one StreamFlow workflow. Every site evaluates the
round's global model and every site's update on its own held-out data, at the site (a local
process, a SLURM job); only the numbers come back, and the coordinator reads them as
untrusted input."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import yaml
from typer.testing import CliRunner

from tests.cli.schemas import check
from tests.conftest import QUICKSTART
from tests.stack.profiles import write_profile
from tests.workflows.warm_ranks import warm_profile
from xffl.cli.app import app
from xffl.core.errors import InvalidInput
from xffl.core.layout import RunLayout
from xffl.jobs.registry.records import EvalCell, FinalLoss, RoundRecord
from xffl.jobs.registry.states import RoundState
from xffl.jobs.registry.store import Registry
from xffl.jobs.spec.schema import JobSpec
from xffl.training.checkpoint import init_global
from xffl.training.config import ModelSpec
from xffl.workflows.plan.evaluation import check_evaluable
from xffl.workflows.steps.evaluate_result import EvaluationRejected, parse_evaluation

runner = CliRunner()
MODELS = ["global", "alpha", "beta"]


def _evaluate(*argv: str, code: int = 0) -> dict[str, Any]:
    result = runner.invoke(app, ["evaluate", *argv, "--json"])
    assert result.exit_code == code, result.output
    return check("evaluate", json.loads(result.stdout))


def _held_out(data_dir: Path, seq_len: int, fraction: float, budget: int) -> np.ndarray:
    """A site's held-out windows (seq_len + 1 tokens each) as documented, derived here: the
    first ceil(f n) of the permutation seeded by (sha256("xffl-validation")[:8], n), in
    ascending order, the first ``budget`` of them."""
    meta = json.loads((data_dir / "meta.json").read_text())
    tokens = np.fromfile(data_dir / "train.bin", dtype=np.dtype(meta["dtype"]))
    n = len(tokens) // (seq_len + 1)
    salt = int.from_bytes(hashlib.sha256(b"xffl-validation").digest()[:8], "big")
    held = np.sort(np.random.default_rng([salt, n]).permutation(n)[:math.ceil(fraction * n)])
    return np.stack([tokens[i * (seq_len + 1):(i + 1) * (seq_len + 1)]
                     for i in held[:budget]]).astype(np.int64)


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file() and not p.is_symlink()}


def _seeded_run(tmp_path: Path, spec: dict[str, Any]) -> str:
    """Register ``spec`` as a run whose round 1 is made here, nothing trained: a seeded
    global and one seeded model per site as its kept updates; the run's id."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = runner.invoke(app, ["submit", str(job), "--no-start", "--json"])
    assert result.exit_code == 0, result.output
    run_id = str(json.loads(result.stdout)["run_id"])
    layout = RunLayout(Path(json.loads(result.stdout)["run_dir"]))
    for seed, where in ((1, layout.global_dir(1)), (2, layout.kept_update(1, "alpha")),
                        (3, layout.kept_update(1, "beta"))):
        init_global(run_id, ModelSpec(preset="tiny"), seed, where)
    Registry().finish_round(run_id, RoundRecord(round=1, state=RoundState.COMPLETED))
    return run_id


@dataclass(frozen=True)
class Evaluated:
    """One seeded run (:func:`_seeded_run`; alpha 128 sequences, beta 96, one rank each)
    evaluated three times, in this order: with beta's data folder holding a dataset xffl did
    not generate (``failing``), then, that folder removed, ``--final`` (``final``), then the
    whole matrix (``matrix``); what each printed and what the registry held after it."""

    home: Path
    run_id: str
    run_dir: Path
    failing: dict[str, Any]
    failing_cells: list[EvalCell]
    round_2_code: int  # `xffl evaluate RUN --round 2`, the run having one round
    final_with_round_code: int  # `xffl evaluate RUN --final --round 1`
    final: dict[str, Any]
    final_recorded: FinalLoss | None
    final_cells: list[EvalCell]
    matrix: dict[str, Any]
    matrix_cells: list[EvalCell]
    report: dict[str, Any]  # `xffl report RUN -o DIR --json`, DIR outside the run
    report_png: dict[str, Any]  # the heat map's matrix, from its PNG's Description
    files_before: dict[str, tuple[int, int]]  # the run directory's, before the matrix
    files_after: dict[str, tuple[int, int]]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Evaluated]:
    """The three evaluations of :class:`Evaluated`, with a home of their own."""
    where = tmp_path_factory.mktemp("evaluated")
    home = where / "xffl-home"
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec.update(name="evaluated", rounds=1)
    warm_profile(where / "site_profiles")  # ranks forked from one warm interpreter
    for site, sequences in zip(spec["sites"], (128, 96), strict=True):
        site["ranks"] = 1
        site["profile"] = "warm-local"  # tests/workflows/warm_ranks.py
        site["data"]["synthetic_sequences"] = sequences
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XFFL_HOME", str(home))
        mp.setenv("XDG_CONFIG_HOME", str(where / "config"))
        run_id = _seeded_run(where, spec)
        run_dir = Path(Registry().get_run(run_id).run_dir)
        meta = home / "sites" / "beta" / "data" / "beta" / "meta.json"
        meta.parent.mkdir(parents=True)
        meta.write_text(json.dumps({"dtype": "uint16", "num_tokens": 1, "vocab_size": 256}))
        failing = _evaluate(run_id, code=1)
        failing_cells = Registry().evaluations(run_id)
        round_2_code = runner.invoke(app, ["evaluate", run_id, "--round", "2"]).exit_code

        shutil.rmtree(meta.parent)  # beta generates its own data at its next evaluation
        final_with_round_code = runner.invoke(
            app, ["evaluate", run_id, "--final", "--round", "1"]).exit_code
        final = _evaluate(run_id, "--final")
        final_recorded, final_cells = Registry().final_loss(run_id), Registry().evaluations(run_id)

        before = _files(run_dir)
        began = time.monotonic()
        matrix = _evaluate(run_id)
        print(f"xffl evaluate of a seeded round: {time.monotonic() - began:.1f} s "
              f"(workflow {matrix['wall_s']:.1f} s)")
        matrix_cells = Registry().evaluations(run_id)
        shown = runner.invoke(app, ["report", run_id, "-o", str(where / "report"), "--json"])
        assert shown.exit_code == 0, shown.output
        with PIL.Image.open(where / "report" / "cross-site.png") as png:
            report_png = json.loads(png.text["Description"])
        after = _files(run_dir)
    yield Evaluated(home, run_id, run_dir, failing, failing_cells, round_2_code,
                    final_with_round_code, final, final_recorded, final_cells, matrix,
                    matrix_cells, json.loads(shown.stdout), report_png, before, after)


@pytest.mark.slow
def test_a_failing_site_is_a_failed_row_the_others_are_recorded(evaluated: Evaluated) -> None:
    """alpha generates its synthetic data and evaluates; beta's data folder holds a dataset
    xffl did not generate, so its evaluation fails at the site (exit 1, with beta's own
    sentence) and alpha's row is recorded all the same."""
    data = evaluated.failing
    assert (data["round"], data["sites"], data["models"]) == (1, ["alpha", "beta"], MODELS)
    assert data["losses"][1] is None and data["samples"] == {"alpha": 13}  # ceil(0.1 x 128)
    assert "not generated by xffl" in data["failed"]["beta"], data["failed"]
    assert sorted((c.data_site, c.model) for c in evaluated.failing_cells) == [
        ("alpha", m) for m in sorted(MODELS)]
    # no round 2 yet: refused before anything runs
    assert evaluated.round_2_code == 2


@pytest.mark.slow
def test_evaluate_final_records_the_final_loss_by_hand(evaluated: Evaluated) -> None:
    """`xffl evaluate RUN --final`: both sites evaluate the round's global alone, and the
    federated value is recorded as `xffl status` shows it."""
    assert evaluated.final_with_round_code == 2  # --final measures the last round's global
    data = evaluated.final
    assert (data["models"], data["sites"], data["failed"]) == (["global"], ["alpha", "beta"], {})
    losses = {s: row[0] for s, row in zip(data["sites"], data["losses"], strict=True)}
    final = data["final_loss"]
    # ceil(0.1 x 128) = 13 and ceil(0.1 x 96) = 10 held-out windows, every one of their 64
    # targets
    assert final["site_tokens"] == {"alpha": 13 * 64, "beta": 10 * 64}
    assert final["sites"] == losses and final["round"] == 1
    assert final["val_loss"] == math.fsum(v * t for v, t in zip(
        losses.values(), final["site_tokens"].values(), strict=True)) / (23 * 64)
    recorded = evaluated.final_recorded
    assert recorded is not None and asdict(recorded) == final
    # a final evaluation records no cross-site matrix: the cells are the failing row's
    assert evaluated.final_cells == evaluated.failing_cells
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XFFL_HOME", str(evaluated.home))
        shown = runner.invoke(app, ["status", evaluated.run_id, "--json"])
    assert shown.exit_code == 0, shown.output
    assert check("status", json.loads(shown.stdout))["final_loss"] == final


@pytest.mark.slow
def test_cross_site_matrix_of_a_seeded_round(evaluated: Evaluated) -> None:
    """The whole 2 x 3 matrix, in the registry and the report; every cell recomputed here in
    float64 by transformers from the files, on the held-out windows derived here."""
    import torch
    import transformers

    data, run_id, run_dir = evaluated.matrix, evaluated.run_id, evaluated.run_dir
    spec = yaml.safe_load(QUICKSTART.read_text())
    training = spec["training"]
    assert (data["run_id"], data["round"]) == (run_id, 1)
    assert (data["models"], data["sites"], data["failed"]) == (MODELS, ["alpha", "beta"], {})
    assert [len(row) for row in data["losses"]] == [3, 3]
    # held out: ceil(0.1 x n) of each site's n sequences, all of them within the budget
    # (16 batches of 8)
    assert data["samples"] == {"alpha": 13, "beta": 10}
    # alpha's row again (the failing evaluation's first), replaced: 6 cells of round 1
    assert len(evaluated.matrix_cells) == 6 and {c.round for c in evaluated.matrix_cells} == {1}
    assert {(c.data_site, c.model): (c.loss, c.samples) for c in evaluated.matrix_cells} == {
        (site, m): (row[j], data["samples"][site])
        for site, row in zip(data["sites"], data["losses"], strict=True)
        for j, m in enumerate(MODELS)}

    # the report draws the latest matrix as its heat map, and its JSON carries it
    matrix = {"round": 1, "sites": data["sites"], "models": MODELS, "losses": data["losses"]}
    assert evaluated.report["cross_site"] == matrix and evaluated.report_png == matrix

    # every cell another way: transformers' LLaMA in float64 on the windows derived here,
    # mean token cross-entropy
    layout = RunLayout(run_dir)
    folders = {"global": layout.global_dir(1), "alpha": layout.kept_update(1, "alpha"),
               "beta": layout.kept_update(1, "beta")}
    windows = {site: torch.from_numpy(_held_out(evaluated.home / "sites" / site / "data" / site,
                                                training["seq_len"], 0.1, n))
               for site, n in data["samples"].items()}
    for j, name in enumerate(MODELS):
        model = transformers.LlamaForCausalLM.from_pretrained(
            str(folders[name]), torch_dtype=torch.float64).eval()
        for site, row in zip(data["sites"], data["losses"], strict=True):
            with torch.no_grad():
                logits = model(windows[site][:, :-1]).logits
            reference = float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), windows[site][:, 1:].reshape(-1)))
            # The site computes in fp32 (unit roundoff u = 2^-24): each batch's loss is an
            # fp32 sum of 8 x 64 = 512 token losses, within (512 - 1) u ~ 3.0e-5 of its value
            # (Higham's gamma_{n-1}, worst case); each token loss comes from logits through 2
            # layers whose dot products (length <= 172) are each within 172 u ~ 1.0e-5
            # relative of the sum of |products|, a few such errors per token; the float64
            # reference and the float64 total add nothing visible. rtol 1e-4 covers the sum
            # of these worst cases (5.6e-4 at these losses, ~log 256); the three seeded
            # models are 3e-3 to 1.1e-2 apart on the same random tokens, and beta's update
            # in alpha's column at alpha is off by 3.8e-2 (measured).
            assert row[j] == pytest.approx(reference, rel=1e-4, abs=0), (site, name)

    # the run's own files are as they were: the evaluation only wrote its own (the updates
    # as it sends them, written again: the failing evaluation sent them first)
    ours = {layout.evaluate_cwl, layout.streamflow_evaluate, layout.evaluate_db,
            layout.evaluate_log, layout.evaluate_inputs(1),
            *(layout.tool(f"evaluate_{s}") for s in ("alpha", "beta"))}
    sent = [layout.evaluate_update(1, s) for s in ("alpha", "beta")]

    def theirs(files: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        return {k: v for k, v in files.items() if run_dir / k not in ours
                and not any((run_dir / k).is_relative_to(folder) for folder in sent)}

    before, after = evaluated.files_before, evaluated.files_after
    assert {k: v for k, v in theirs(after).items() if k in before} == theirs(before)
    assert {run_dir / k for k in after} >= ours
    assert all((folder / "config.json").is_file() for folder in sent)


def _spec(**changes: Any) -> JobSpec:
    spec = yaml.safe_load(QUICKSTART.read_text())
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = spec
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
    return JobSpec.model_validate(spec)


@pytest.mark.parametrize(("changes", "says"), [
    ({"training__lora": {"r": 4}}, "LoRA adapter"),
    ({"exchange": {"update": "delta", "dtype": "bf16"}}, "deltas (exchange: delta/bf16)"),
    ({"sites__1__data__validation": None}, "site(s) beta have no held-out data; add "
                                           "data.validation"),
    ({"sites__0__name": "global"}, "a site is named 'global'"),
])
def test_runs_it_cannot_evaluate_are_refused(changes: dict[str, Any], says: str) -> None:
    check_evaluable(_spec())  # the quickstart can be
    with pytest.raises(InvalidInput) as caught:
        check_evaluable(_spec(**changes))
    assert says in caught.value.message and caught.value.exit_code == 2


GOOD = {"format": 1, "site": "beta", "samples": 52, "tokens": 52 * 64,
        "losses": {"global": 4.1, "alpha": 5.0, "beta": 3.9}}


def _write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "evaluation-beta.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_a_good_file_is_read_under_the_coordinators_name(tmp_path: Path) -> None:
    got = parse_evaluation(_write(tmp_path, json.dumps(GOOD)), "beta", MODELS, 128, 64)
    assert (got.site, got.samples, got.tokens, got.losses) == ("beta", 52, 52 * 64,
                                                               GOOD["losses"])


@pytest.mark.parametrize(("text", "reason"), [
    (json.dumps({**GOOD, "note": "hi"}), "field note: Extra inputs are not permitted"),
    (json.dumps(GOOD).replace("4.1", "NaN"), "not JSON: NaN is not a number JSON allows"),
    (json.dumps(GOOD).replace("4.1", "1e999"), "the loss of model global is inf"),
    (json.dumps(GOOD).replace("4.1", "9" * 400), "the loss of model global is 999999999999"
                                                 "... (400 digits)"),
    (json.dumps({**GOOD, "samples": 10**400}), "samples is 100000000000... (401 digits)"),
    (json.dumps({**GOOD, "losses": {**GOOD["losses"], "gamma": 1.0}}),
     "models not sent: 'gamma'"),
    (json.dumps({**GOOD, "losses": {"global": 4.1, "alpha": 5.0}}), "models missing: beta"),
    (json.dumps({**GOOD, "losses": {**GOOD["losses"], "alpha": -0.5}}),
     "the loss of model alpha is -0.5"),
    (json.dumps({**GOOD, "samples": 129}), "samples is 129, outside 1..128"),
    (json.dumps({**GOOD, "samples": 0}), "samples is 0, outside 1..128"),
    (json.dumps({**GOOD, "tokens": 52 * 64 + 1}), "tokens is 3329, outside 0..3328"),
    (json.dumps({**GOOD, "tokens": -1}), "tokens is -1, outside 0..3328"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "tokens"}), "field tokens: Field "
                                                                   "required"),
    (json.dumps({**GOOD, "samples": 52.0}), "field samples: Input should be a valid integer"),
    (json.dumps({**GOOD, "samples": True}), "field samples: Input should be a valid integer"),
    (json.dumps({**GOOD, "losses": {**GOOD["losses"], "beta": "3.9"}}), "field losses.beta"),
    (json.dumps({**GOOD, "format": 2}), "field format"),
    (json.dumps({**GOOD, "site": "alpha"}), "says it is from site 'alpha', not 'beta'"),
    (json.dumps([GOOD]), "field (root)"),
    (b"\xff\xfe{", "not JSON"),
    ("[" * 20_000, "not JSON"),
    (json.dumps(GOOD) + " " * (10 << 20), "bytes, more than the 65536 allowed"),
], ids=["extra-key", "nan", "overflow", "big-int-loss", "big-int-samples", "not-sent",
        "missing", "negative", "over-budget", "zero-samples", "over-targets", "negative-targets",
        "no-targets", "float-samples", "bool-samples",
        "string-loss", "format", "site",
        "not-an-object", "not-utf8", "deep", "10MB"])
def test_a_hostile_file_is_rejected_with_its_reason(tmp_path: Path, text: str | bytes,
                                                    reason: str) -> None:
    with pytest.raises(EvaluationRejected) as caught:
        parse_evaluation(_write(tmp_path, text), "beta", MODELS, 128, 64)
    assert reason in str(caught.value)


def test_a_link_or_a_missing_file_is_rejected(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps(GOOD))
    link = tmp_path / "evaluation-beta.json"
    os.symlink(target, link)
    with pytest.raises(EvaluationRejected, match="unreadable evaluation file"):
        parse_evaluation(link, "beta", MODELS, 128, 64)
    with pytest.raises(EvaluationRejected, match="no evaluation file came back"):
        parse_evaluation(tmp_path / "none.json", "beta", MODELS, 128, 64)


@pytest.mark.slow
def test_evaluation_runs_as_slurm_jobs_at_both_facilities(
        tmp_path: Path, slurm_stack,  # type: ignore[no-untyped-def]
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`xffl evaluate` of a 1-round job on the two SLURM clusters (one rank each): each
    site's evaluation is a SLURM job of its own cluster, named after the run, the site and
    the round, and the numbers came back over SSH. The round is seeded, not trained (as
    in the test above): what is under test is the evaluation's own jobs, and a trained
    round at these clusters would cost a whole run (evaluation after a trained run: the
    quickstart's final evaluation, tests/workflows/test_final_evaluation.py)."""
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)  # asyncssh reads ~/.ssh/known_hosts
    profiles = tmp_path / "site_profiles"
    profiles.mkdir()
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec.update(name="slurmeval", rounds=1)
    for site in spec["sites"]:
        site["ranks"] = 1
        site["profile"] = write_profile(profiles, slurm_stack.clusters[site["name"]],
                                        slurm_stack)
        site["data"].update(path=str(tmp_path / "data" / site["name"]),
                            synthetic_sequences=128, validation={"fraction": 0.1})
    run_id = _seeded_run(tmp_path, spec)
    before = {n: len(slurm_stack.jobcomp_records(n)) for n in ("alpha", "beta")}

    began = time.monotonic()
    data = _evaluate(run_id, "--timeout", "300")
    print(f"xffl evaluate on the SLURM stack: {time.monotonic() - began:.1f} s")
    assert (data["round"], data["models"], data["failed"]) == (1, MODELS, {})
    assert data["samples"] == {"alpha": 13, "beta": 13}  # ceil(0.1 x 128)
    assert all(len(row) == 3 and all(v > 0 for v in row) for row in data["losses"])
    assert len(Registry().evaluations(run_id)) == 6
    for name in ("alpha", "beta"):  # SLURM's own records of each cluster
        deadline = time.monotonic() + 30  # slurmctld writes a record as its job ends
        while True:
            new = slurm_stack.jobcomp_records(name)[before[name]:]
            ours = [r for r in new if r.get("Name") == f"xffl-{run_id}-{name}.eval-r1"]
            if ours or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert len(ours) == 1, new
        assert (ours[0]["JobState"], ours[0]["ProcCnt"]) == ("COMPLETED", "1")
