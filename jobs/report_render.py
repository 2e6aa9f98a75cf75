"""Draw `xffl report`: three PNG plots (matplotlib, Agg, no display) and one HTML page.

The HTML embeds the plots (base64), so ``report.html`` can be moved or mailed on its own;
the PNG files beside it are the same pictures. Every text that comes from the registry or
the job spec is escaped (``html.escape``) in the page and never read as mathtext in a plot.
"""

from __future__ import annotations

import base64
import html
import io
import json
import time
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from xffl.jobs.report.matrix import plot_cross_site
from xffl.jobs.report.numbers import ReportData, RoundRow, SiteRow, fmt, megabytes
from xffl.jobs.report.summary import summary_html

# the parts of a site's round, bottom to top, with their colours
SEGMENTS = (("queue_wait_s", "queue wait (SLURM)", "#9e9e9e"),
            ("startup_s", "start-up", "#9467bd"),
            ("train_s", "training", "#1f77b4"),
            ("transfer_s", "transfer", "#ff7f0e"),
            ("other_s", "other (scheduling, polling, checks)", "#bcbd22"),
            ("aggregate_s", "aggregation", "#2ca02c"))
NO_DATA = "no completed round yet"
DPI = 100


def _plain(text: str) -> str:
    """Text shown literally by matplotlib (a ``$`` would start mathtext)."""
    return text.replace("$", r"\$")


def _figure(width: float = 7.5, height: float = 4.2) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _note_empty(ax: Axes, note: str = NO_DATA) -> None:
    ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center",
            fontsize=12, color="#555555")
    ax.set_xticks([])
    ax.set_yticks([])


def _round_ticks(ax: Axes, rounds: list[int]) -> None:
    ax.set_xticks(sorted(set(rounds)))
    ax.grid(True, alpha=0.3)


def _site_series(data: ReportData, key: str) -> dict[str, tuple[list[int], list[float]]]:
    """Per site: the rounds where ``key`` is known and its values there."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for rnd in data.rounds:
        for s in rnd.sites:
            value = getattr(s, key)
            if value is not None:
                xs, ys = series.setdefault(s.site, ([], []))
                xs.append(rnd.round)
                ys.append(float(value))
    return {site: series[site] for site in data.site_names() if site in series}


def loss_series(data: ReportData, key: str = "loss",
                overall: str = "global") -> dict[str, list[list[float]]]:
    """A loss plot's curves: per site and ``overall`` (the rounds' own ``key``), the [round,
    value] points."""
    curves = {site: [[float(x), y] for x, y in zip(xs, ys, strict=True)]
              for site, (xs, ys) in _site_series(data, key).items()}
    glob = [[float(r.round), float(v)] for r in data.rounds
            if (v := getattr(r, key)) is not None]
    return {**curves, overall: glob} if glob else curves


def _plot_curves(data: ReportData, path: Path, key: str, overall: str, ylabel: str,
                 title: str, empty: str = NO_DATA) -> None:
    """Each site's ``key`` and the rounds' own (black, named ``overall``), per round.

    The PNG also carries the plotted points as JSON in its ``Description`` text chunk
    (:func:`loss_series`), so a program can read the curves back from the picture.
    """
    fig, ax = _figure()
    curves = loss_series(data, key, overall)
    if not curves:
        _note_empty(ax, empty)
    else:
        for name, points in curves.items():
            xs, ys = [x for x, _ in points], [y for _, y in points]
            if name == overall:
                ax.plot(xs, ys, marker="s", color="black", linewidth=2.5, label=overall)
            else:
                ax.plot(xs, ys, marker="o", label=_plain(name))
        _round_ticks(ax, [int(x) for points in curves.values() for x, _ in points])
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        ax.legend()
    ax.set_title(_plain(f"{data.run_id}: {title}"))
    fig.savefig(path, format="png", metadata={"Description": json.dumps(curves,
                                                                          sort_keys=True)})


def plot_loss(data: ReportData, path: Path) -> None:
    """Each site's training loss and the global loss (their weighted mean), per round."""
    _plot_curves(data, path, "loss", "global", "training loss", "loss per round")


def plot_validation(data: ReportData, path: Path) -> None:
    """Each site's validation loss of the global model a round started from, and the
    federated one (weighted by the held-out sequences), per round."""
    _plot_curves(data, path, "val_loss", "federated",
                 "validation loss of the round's incoming global", "validation loss per round",
                 empty="no validation numbers: give the sites data.validation")


def _bars(data: ReportData) -> list[tuple[RoundRow, SiteRow]]:
    """The site rounds that can be broken down (their update was delivered and timed)."""
    order = {site: i for i, site in enumerate(data.site_names())}
    return [(r, s) for r in data.rounds
            for s in sorted(r.sites, key=lambda s: order.get(s.site, len(order)))
            if s.delivered_s is not None]


LEGEND_ID = "breakdown-legend"  # the SVG ids the page's layout test measures
BAR_ID = "breakdown-bar"
TEXT_ID = "breakdown-text"


def draw_breakdown(data: ReportData) -> Figure:
    """Stacked bars per site and round: queue wait, start-up, training, transfer, other and
    the round's aggregation; the legend outside the axes, below them, so that it covers no
    bar and no text. In the SVG the legend is the group ``breakdown-legend``, every bar
    segment ``breakdown-bar-<part>-<i>`` and the title and round labels ``breakdown-text-*``."""
    bars = _bars(data)
    fig, ax = _figure(width=max(7.5, min(30.0, 0.45 * len(bars) + 3)))
    if not bars:
        _note_empty(ax)
    else:
        xs = list(range(len(bars)))
        bottoms = [0.0] * len(bars)
        for key, label, colour in SEGMENTS:
            heights = [float((getattr(r, key) if key == "aggregate_s" else getattr(s, key))
                             or 0.0) for r, s in bars]
            drawn = ax.bar(xs, heights, bottom=bottoms, color=colour, label=label, width=0.7)
            for i, patch in enumerate(drawn.patches):
                patch.set_gid(f"{BAR_ID}-{key}-{i}")
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        ax.set_xticks(xs, [_plain(f"r{r.round} {s.site}") for r, s in bars],
                      rotation=90 if len(bars) > 8 else 0, fontsize=8)
        ax.set_ylabel("seconds from the round's start")
        ax.grid(True, axis="y", alpha=0.3)
        fig.legend(loc="outside lower center", ncols=3, fontsize=8).set_gid(LEGEND_ID)
        for i, tick in enumerate(ax.get_xticklabels()):
            tick.set_gid(f"{TEXT_ID}-tick-{i}")
    ax.set_title(_plain(f"{data.run_id}: round-time breakdown per site")).set_gid(
        f"{TEXT_ID}-title")
    return fig


def plot_breakdown(data: ReportData, path: Path) -> None:
    """The round-time breakdown (:func:`draw_breakdown`) as a PNG."""
    draw_breakdown(data).savefig(path, format="png")


def inline_svg(fig: Figure) -> str:
    """``fig`` as an ``<svg>`` element to put into the page (the page's style keeps it
    within its box; its text is drawn as paths: no font or markup of the data's)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    start = text.index("<svg")
    head_end = text.index(">", start)
    return f'{text[start:head_end]} class="plot"{text[head_end:]}'


def plot_throughput(data: ReportData, path: Path) -> None:
    """Each site's training throughput (tokens per second of training), per round."""
    fig, ax = _figure()
    series = _site_series(data, "tokens_per_s")
    if not series:
        _note_empty(ax)
    else:
        for site, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=_plain(site))
        _round_ticks(ax, [x for xs, _ in series.values() for x in xs])
        ax.set_xlabel("round")
        ax.set_ylabel("tokens / s of training")
        ax.set_ylim(bottom=0)
        ax.legend()
    ax.set_title(_plain(f"{data.run_id}: training throughput per site"))
    fig.savefig(path, format="png")


COLUMNS = ("round", "site", "state", "sequences", "tokens", "loss", "train s", "queue wait s",
           "start-up s", "transfer s", "other s", "aggregate s", "tokens/s", "MB in",
           "MB out", "val loss", "val loss of update")
# a page that fits a 1200 px window: wide tables wrap their headers and, if still too wide
# (many columns, long names), scroll inside their own box; plots shrink to the page
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 80em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.box { max-width: 100%; overflow-x: auto; }
table { border-collapse: collapse; font-size: 0.8em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.3em; text-align: right; }
th { background: #f0f0f0; font-weight: 600; } td { white-space: nowrap; }
td.text { text-align: left; }
tr.global td { font-weight: bold; border-bottom: 2px solid #888; }
table.summary { font-size: 1em; } table.summary th, table.summary td { text-align: left; }
table.summary td { white-space: normal; }
.note { color: #555; overflow-wrap: anywhere; }
.reason { color: #a33; font-size: 0.85em; white-space: normal; min-width: 16em; }
img, svg.plot { max-width: 100%; height: auto; border: 1px solid #ddd; }
"""


def _row(values: list[str], extra: str = "", css: str = "") -> str:
    """One table row: the first three columns are text; ``extra`` (HTML) goes into the third."""
    cells = []
    for i, v in enumerate(values):
        if i < 3:
            cells.append(f'<td class="text">{html.escape(v)}{extra if i == 2 else ""}</td>')
        else:
            cells.append(f"<td>{html.escape(v)}</td>")
    attrs = f' class="{css}"' if css else ""
    return f"<tr{attrs}>{''.join(cells)}</tr>"


def _site_row(rnd: RoundRow, s: SiteRow) -> str:
    state = s.state + (f" after {s.attempts} attempts" if s.attempts > 1 else "")
    values = [str(rnd.round), s.site, state, fmt("num_samples", s.num_samples),
              fmt("num_tokens", s.num_tokens), fmt("loss", s.loss), fmt("train_s", s.train_s),
              fmt("queue_wait_s", s.queue_wait_s), fmt("startup_s", s.startup_s),
              fmt("transfer_s", s.transfer_s), fmt("other_s", s.other_s), "",
              fmt("tokens_per_s", s.tokens_per_s), megabytes(s.received_bytes),
              megabytes(s.sent_bytes), fmt("val_loss", s.val_loss),
              fmt("val_loss_update", s.val_loss_update)]
    reason = f'<div class="reason">{html.escape(s.reason)}</div>' if s.reason else ""
    return _row(values, reason)


def table_html(data: ReportData) -> str:
    """The per-round numbers: a row per site and a ``global`` row per round."""
    rows = []
    for rnd in data.rounds:
        rows += [_site_row(rnd, s) for s in rnd.sites]
        values = [str(rnd.round), "global", rnd.state, fmt("num_samples", rnd.num_samples),
                  "", fmt("loss", rnd.loss), "", "", "", "", "",
                  fmt("aggregate_s", rnd.aggregate_s), "", "", "", fmt("val_loss", rnd.val_loss),
                  ""]
        rows.append(_row(values, css="global"))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    body = "\n".join(rows) or f'<tr><td colspan="{len(COLUMNS)}">{NO_DATA}</td></tr>'
    return (f'<div class="box"><table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n'
            "</tbody>\n</table></div>")


HARDWARE_COLUMNS = ("round", "site", "device", "GPUs", "tokens/s per GPU", "TFLOP/s per GPU",
                    "MFU", "peak memory GiB", "save s")


def hardware_html(data: ReportData) -> str:
    """How each site's hardware ran each round: a row per site and round."""
    rows = [_row([str(rnd.round), s.site, s.device or "-", fmt("gpus", s.gpus),
                  fmt("tokens_per_s_per_gpu", s.tokens_per_s_per_gpu), fmt("tflops", s.tflops),
                  fmt("mfu", s.mfu), fmt("peak_memory_gib", s.peak_memory_gib),
                  fmt("save_s", s.save_s)])
            for rnd in data.rounds for s in rnd.sites]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in HARDWARE_COLUMNS)
    body = "\n".join(rows) or f'<tr><td colspan="{len(HARDWARE_COLUMNS)}">{NO_DATA}</td></tr>'
    return (f'<div class="box"><table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n'
            "</tbody>\n</table></div>")


def _img(folder: Path, name: str, alt: str) -> str:
    encoded = base64.b64encode((folder / name).read_bytes()).decode("ascii")
    return (f'<p><img src="data:image/png;base64,{encoded}" alt="{html.escape(alt)}"></p>'
            f'<p class="note">Also as <a href="{name}">{name}</a>.</p>')


def page_html(data: ReportData, folder: Path, breakdown: str) -> str:
    """The whole report page, with the plots in ``folder`` embedded and the breakdown
    (``breakdown``: an inline ``<svg>``)."""
    e = html.escape
    done = [r for r in data.rounds if r.state == "completed"]
    note = "" if done else f'<p class="note">{NO_DATA}: the plots are empty.</p>'
    message = f" — {e(data.message)}" if data.message else ""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>xffl report: {e(data.run_id)}</title>
<style>{STYLE}</style>
</head>
<body>
<h1>xffl run {e(data.run_id)}</h1>
<p>{e(data.state)} — {data.rounds_done}/{data.rounds_total} rounds{message}</p>
{summary_html(data)}
<p class="note">sites: {e(", ".join(data.sites))}; run directory: {e(data.run_dir)};
report written {e(time.strftime("%Y-%m-%d %H:%M:%S"))}.</p>
{note}
<h2>Validation loss per round</h2>
<p class="note">Every round each site evaluates the global model it receives, before
training, on its own held-out data (never trained on, never moved); the federated value is
the mean over all the sites' held-out targets. Round r shows the global model of round
r &minus; 1; the final model (the last round's global) is in the summary above.</p>
{_img(folder, "validation.png", "validation loss per round")}
<h2>Cross-site validation</h2>
<p class="note">The latest `xffl evaluate`: every site's update of that round and the
round's global model, each evaluated on every site's held-out data.</p>
{_img(folder, "cross-site.png", "cross-site validation")}
<h2>Training loss per round</h2>
<p class="note">Each site's mean training loss over the round on its own data, and the
global loss (their weighted mean).</p>
{_img(folder, "loss.png", "loss per round")}
<h2>Round-time breakdown</h2>
<p class="note">Per site and round, from the round's start: SLURM's queue wait (0 without
SLURM), training (the training loop), transfer + orchestration (the rest until the site's
update was in place on the coordinator: moving models, starting jobs and processes,
StreamFlow), then the round's aggregation.</p>
<div>{breakdown}</div>
<p class="note">Also as <a href="breakdown.png">breakdown.png</a>.</p>
<h2>Throughput</h2>
<p class="note">Tokens per second of training at each site.</p>
{_img(folder, "throughput.png", "training throughput per site")}
<h2>Hardware</h2>
<p class="note">Per site and round: the device and its GPUs (0: the site trained on CPUs),
one device's tokens per second and achieved TFLOP/s after the warm-up steps, MFU (the
TFLOP/s over the device's dense bf16 peak; - where the peak is not known), the largest peak
memory of its ranks (GPU memory; on CPUs the resident set) and the seconds writing the update
took.</p>
{hardware_html(data)}
<h2>Per-round numbers</h2>
{table_html(data)}
</body>
</html>
"""


def render_all(data: ReportData, folder: Path) -> list[str]:
    """Write the plots and report.html into ``folder``; return the file names."""
    plot_validation(data, folder / "validation.png")
    plot_cross_site(data.cross_site, data.run_id, folder / "cross-site.png")
    plot_loss(data, folder / "loss.png")
    breakdown = draw_breakdown(data)
    breakdown.savefig(folder / "breakdown.png", format="png")
    plot_throughput(data, folder / "throughput.png")
    (folder / "report.html").write_text(page_html(data, folder, inline_svg(breakdown)),
                                        encoding="utf-8")
    return ["validation.png", "cross-site.png", "loss.png", "breakdown.png", "throughput.png",
            "report.html"]
