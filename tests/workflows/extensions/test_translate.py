"""StreamFlow's static check of a plan parses each tool file once with xffl's adapter; upstream
parses a step's file once per port of the step, so round.cwl (a step per site) is parsed
once per site by the loop step (a port per site): time grows with the square of the sites."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cwl_utils.parser
import cwl_utils.parser.utils as parser_utils
import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from xffl.cli.app import app
from xffl.workflows.extensions.translate import install

runner = CliRunner()


def _plan(tmp_path: Path, sites: int) -> Path:
    spec = yaml.safe_load(QUICKSTART.read_text())
    template = spec["sites"][0]
    spec["sites"] = [{**template, "name": f"s{i}"} for i in range(sites)]
    job = tmp_path / f"job{sites}.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    out = tmp_path / f"plan{sites}"
    result = runner.invoke(app, ["render", str(job), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return out


def _parses(plan: Path, checker: Callable[[Any], None],
            monkeypatch: pytest.MonkeyPatch) -> tuple[Counter[str], list[str]]:
    """How often the static checks of main.cwl and round.cwl parse each file (they raise on
    a type mismatch, so passing is their verdict), and the steps they checked."""
    docs = [cwl_utils.parser.load_document_by_uri(plan / name)
            for name in ("main.cwl", "round.cwl")]
    count: Counter[str] = Counter()
    real = cwl_utils.parser.load_document_by_uri

    def counting(path: Any, *args: Any, **kwargs: Any) -> Any:
        count[Path(str(path)).name] += 1
        return real(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(cwl_utils.parser, "load_document_by_uri", counting)
        for doc in docs:
            checker(doc)
    seen = sorted(str(s.id).split("#")[-1] for doc in docs for s in doc.steps)
    return count, seen


def test_each_tool_file_is_parsed_once_per_check(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    install()
    upstream = parser_utils.static_checker.__wrapped__  # type: ignore[attr-defined]
    rounds = {}
    for sites in (2, 3):
        plan = _plan(tmp_path, sites)
        before, steps = _parses(plan, upstream, monkeypatch)
        after, same_steps = _parses(plan, parser_utils.static_checker, monkeypatch)
        assert same_steps == steps
        # xffl: round.cwl once (the loop step's run), each tool file once
        files = {"round.cwl", *(p.name for p in (plan / "tools").iterdir())}
        assert after == dict.fromkeys(files, 1), (sites, after)
        rounds[sites] = before["round.cwl"]
        assert set(before) == files and all(n >= 1 for n in before.values())
    # upstream: round.cwl once per port of the loop step, which has two ports per site (its
    # job in and out): one more site, two more parses of a round.cwl one site longer
    assert rounds[3] >= rounds[2] + 2, rounds
