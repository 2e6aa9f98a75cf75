"""The final model's held-out loss, as the plan's last step on the coordinator.

After main.cwl's ``rounds`` loop, every site's ``final_evaluate_<site>`` step evaluates the
loop's last global (the global alone) on the site's held-out data with the site's evaluate
tool, and ``python -m xffl.workflows.steps.final_validation --run-dir D --round R --sites a,b
--evaluation=a=FILE ...`` combines what came back, as Flower's final evaluation after its
last round. Each site's file is untrusted input, read as every cross-site evaluation's is
(:mod:`xffl.workflows.steps.evaluate_result`: the global's loss alone, at most the job's
evaluation budget of held-out sequences, each of ``seq_len`` targets), and the sites' losses
are combined as every round's validation is (:func:`xffl.workflows.steps.early_stop.combine`):
the mean over all the sites' held-out targets, and the median across the sites' own losses.
The result is written to ``final-validation.json`` (in the run directory, and as the step's
output, which main.cwl outputs); in a registered run (``run.json``) it is
also recorded in the registry, where ``xffl status`` and ``xffl report`` read it. A site whose
evaluation failed (xffl's failure manager gave it up: its file is absent) or whose file is
rejected is left out and named, with its reason; the step itself fails for no site, and
whatever goes wrong in it leaves the run's rounds done (it says why, and ends well).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import asdict
from pathlib import Path

from xffl.core.errors import first_line
from xffl.core.files import write_json
from xffl.core.layout import RunLayout, registration
from xffl.core.startup import collect_less
from xffl.jobs.registry.attempts import read_attempts
from xffl.jobs.registry.records import FinalLoss
from xffl.jobs.report.numbers import GLOBAL
from xffl.jobs.spec.schema import JobSpec
from xffl.workflows.steps.bounds import report_bounds
from xffl.workflows.steps.early_stop import combine
from xffl.workflows.steps.evaluate_result import (
    EvaluationRejected,
    SiteEvaluation,
    parse_evaluation,
)
from xffl.workflows.steps.tool import step_parser

EVENT = "final evaluation"  # the registry event that says what became of it
NOT_MEASURED = "the final model's held-out loss was not measured"
WITHOUT = ", without "


def skipped(spec: JobSpec) -> str | None:
    """Why a run's final model is not evaluated, or None when it is."""
    if not spec.evaluation.final:
        return "not asked for (evaluation.final: false)"
    if spec.training.lora is not None:
        return "a LoRA adapter, which the evaluation does not load"
    if any(s.data.validation is None for s in spec.sites):
        return "not every site has held-out data (data.validation)"
    return None


def final_of(rnd: int, results: list[SiteEvaluation]) -> FinalLoss | None:
    """The federated loss of round ``rnd``'s global from the sites' results (None: no site
    sent a loss over a target)."""
    fed = combine(rnd, [(r.site, r.losses[GLOBAL], r.samples, r.tokens) for r in results])
    if fed is None or fed.val_loss_median is None:
        return None
    return FinalLoss(round=rnd, val_loss=fed.val_loss, val_loss_median=fed.val_loss_median,
                     val_samples=fed.val_samples, val_tokens=fed.val_tokens, sites=fed.sites,
                     site_tokens=fed.site_tokens)


def read_site(layout: RunLayout, spec: JobSpec, site: str,
              path: Path | None) -> SiteEvaluation | str:
    """``site``'s result, or why there is none (its failed attempts, its file's rejection)."""
    if path is None:
        attempts = read_attempts(layout, 0, site, final=True)
        why = attempts.reason if attempts is not None else "no evaluation file came back"
        return f"the evaluation at the site failed: {why}"
    found = [s for s in spec.sites if s.name == site]
    _, _, budget, seq_len = report_bounds(spec, found[0])
    # the runner stages the file as a link (cwltool does): that one link is the runner's and
    # is followed; the file it leads to is read as any site's file is (a link the site made
    # is refused, never followed: nothing a site sends names a path here)
    if path.is_symlink():
        path = path.parent / os.readlink(path)  # an absolute target replaces the parent
    try:
        return parse_evaluation(path, site, [GLOBAL], budget or 0, seq_len or 0)
    except EvaluationRejected as exc:
        return f"its evaluation file was rejected: {exc}"


def note(final: FinalLoss | None, failed: dict[str, str]) -> str:
    """One sentence: the final loss (or that it was not measured), and the missing sites."""
    lost = "; ".join(f"site {s}: {why}" for s, why in failed.items())
    if final is None:
        return NOT_MEASURED + (
            f" ({lost})" if lost else ": no site's held-out data has a target")
    return f"the final model's held-out loss is {final.val_loss:.4f}" + (
        f"{WITHOUT}{lost}" if lost else "")


def partial(message: str) -> bool:
    """Whether a :func:`note` says the final loss is missing or lacks a site."""
    return message.startswith(NOT_MEASURED) or WITHOUT in message


def run_step(args: argparse.Namespace) -> int:
    """Combine the sites' evaluations of the final model; return the exit code (0)."""
    from xffl.jobs.registry.store import Registry

    layout = RunLayout(Path(args.run_dir))
    spec = JobSpec.of_run(layout.root)
    sites = [s for s in args.sites.split(",") if s]
    files: dict[str, Path] = {}
    for pair in args.evaluation:
        site, sep, path = pair.partition("=")
        if not sep or site not in sites or site in files:
            raise SystemExit(f"--evaluation: {pair!r} is not SITE=PATH for a site of {sites}")
        files[site] = Path(path)
    results: list[SiteEvaluation] = []
    failed: dict[str, str] = {}
    for site in sites:
        got = read_site(layout, spec, site, files.get(site))
        if isinstance(got, str):
            failed[site] = got
        else:
            results.append(got)
    final = final_of(args.round, results)
    if final is not None:
        write_json(layout.final_validation, asdict(final))
        write_json(Path.cwd() / layout.final_validation.name, asdict(final))  # the step's output
    reg = registration(layout)
    if reg is not None:
        registry = Registry(reg.registry)
        if final is not None:
            registry.record_final(reg.run_id, final)
        registry.event(reg.run_id, EVENT, note(final, failed))
    print(note(final, failed), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the plan's final validation tool."""
    collect_less()  # before the imports it makes (see xffl.core.startup)
    parser = step_parser("xffl.workflows.steps.final_validation")
    parser.add_argument("--sites", required=True, help="the plan's sites, comma-separated")
    parser.add_argument("--evaluation", action="append", default=[], help="SITE=FILE")
    args = parser.parse_args(argv)
    try:
        return run_step(args)
    except Exception as exc:  # the rounds are done whatever happens here: say it, end well
        message = f"{NOT_MEASURED}: {first_line(exc)}"
        print(message, file=sys.stderr)
        with contextlib.suppress(Exception):
            from xffl.jobs.registry.store import Registry

            reg = registration(RunLayout(Path(args.run_dir)))
            if reg is not None:
                Registry(reg.registry).event(reg.run_id, EVENT, message)
        return 0


if __name__ == "__main__":
    sys.exit(main())
