"""The report's cross-site heat map: the latest round's matrix, drawn and carried as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import PIL.Image

from xffl.jobs.registry.records import EvalCell
from xffl.jobs.report.matrix import EMPTY_NOTE, plot_cross_site
from xffl.jobs.report.numbers import cross_site_matrix


def _description(path: Path) -> object:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with PIL.Image.open(path) as png:
        assert png.size[0] > 0 and png.size[1] > 0
        return json.loads(png.text["Description"])


def test_the_latest_round_is_drawn_global_first(tmp_path: Path) -> None:
    cells = [EvalCell(1, "alpha", "global", 9.0, 10)]  # an older round: not drawn
    cells += [EvalCell(2, site, model, loss, 10) for site, model, loss in (
        ("beta", "alpha", 3.5), ("alpha", "beta", 3.25), ("alpha", "global", 2.5),
        ("beta", "global", 2.75), ("alpha", "alpha", 2.0))]  # (beta, beta) is missing
    path = tmp_path / "cross_site.png"
    plot_cross_site(cross_site_matrix(cells), "run-1", path)
    expected = {"round": 2, "sites": ["alpha", "beta"], "models": ["global", "alpha", "beta"],
                "losses": [[2.5, 2.0, 3.25], [2.75, 3.5, None]]}
    assert cross_site_matrix(cells) == expected
    assert _description(path) == expected


def test_no_evaluation_yet_says_how_to_get_one(tmp_path: Path) -> None:
    path = tmp_path / "cross_site.png"
    plot_cross_site(cross_site_matrix([]), "run-1", path)
    assert _description(path) == {"round": None, "sites": [], "models": [], "losses": []}
    assert "xffl evaluate RUN" in EMPTY_NOTE
