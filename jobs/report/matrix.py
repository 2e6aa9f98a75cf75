"""The report's cross-site validation heat map (matplotlib, Agg, no display).

Rows are the sites whose held-out data was evaluated, columns the models (the round's
global, then every site's update), each cell annotated with its mean token loss. Only the
latest evaluated round is drawn; the PNG carries the drawn matrix as JSON in its
``Description`` text chunk, so a program can read it back from the picture.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

EMPTY_NOTE = "no cross-site evaluation yet: run `xffl evaluate RUN`"
DPI = 100


def _plain(text: str) -> str:
    """Text shown literally by matplotlib (a ``$`` would start mathtext)."""
    return text.replace("$", r"\$")


def plot_cross_site(matrix: dict[str, Any], run_id: str, path: Path) -> None:
    """Draw a cross-site loss matrix (:func:`cross_site_matrix`) as a heat map at ``path``."""
    sites, models = matrix["sites"], matrix["models"]
    width = max(6.0, min(30.0, 1.1 * len(models) + 3.0))
    height = max(3.5, min(30.0, 0.6 * len(sites) + 2.2))
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if not sites:
        ax.text(0.5, 0.5, EMPTY_NOTE, transform=ax.transAxes, ha="center", va="center",
                fontsize=12, color="#555555")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(_plain(f"{run_id}: cross-site validation"))
    else:
        values = [[math.nan if v is None else v for v in row] for row in matrix["losses"]]
        image = ax.imshow(values, cmap="viridis_r", aspect="auto")
        known = [v for row in values for v in row if not math.isnan(v)]
        middle = (min(known) + max(known)) / 2 if known else 0.0
        for i, row in enumerate(values):
            for j, value in enumerate(row):
                text = "n/a" if math.isnan(value) else f"{value:.3f}"
                # light text on the dark end of the colour map (high losses)
                colour = "white" if not math.isnan(value) and value > middle else "black"
                ax.text(j, i, text, ha="center", va="center", fontsize=9, color=colour)
        ax.set_xticks(range(len(models)), [_plain(m) for m in models],
                      rotation=90 if len(models) > 8 else 0)
        ax.set_yticks(range(len(sites)), [_plain(s) for s in sites])
        ax.set_xlabel("model (the round's global, each site's update)")
        ax.set_ylabel("held-out data of site")
        fig.colorbar(image, ax=ax, label="mean token loss")
        ax.set_title(_plain(f"{run_id}: cross-site validation, round {matrix['round']}"))
    fig.savefig(path, format="png", metadata={"Description": json.dumps(matrix,
                                                                          sort_keys=True)})
