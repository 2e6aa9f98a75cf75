"""The summary at the top of `xffl report`'s page: what ran, for how long, and how well."""

from __future__ import annotations

import html
from typing import Any

from xffl.jobs.report.numbers import ReportData

SUMMARY_ID = "summary"  # the page's element the layout test reads


def duration(seconds: float | None) -> str:
    """Seconds in words a person reads at a glance: ``42 s``, ``3 min 05 s``, ``2 h 07 min``."""
    if seconds is None:
        return "-"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def final_text(final: dict[str, Any] | None) -> str:
    """The final model's held-out loss in words (``not measured`` without one)."""
    if final is None:
        return "not measured (the run's events say why)"
    sites = ", ".join(f"{s} {v:.4f}" for s, v in final["sites"].items())
    return (f"{final['val_loss']:.4f}: the global after round {final['round']} on every "
            f"site's held-out data, the mean over their targets (median across sites "
            f"{final['val_loss_median']:.4f}; {sites})")


def summary_html(data: ReportData) -> str:
    """The summary table: model, sites, rounds, the final model's loss, wall time."""
    rows = [("model", data.model or "-"),
            ("sites", "; ".join(data.site_setup) or ", ".join(data.sites)),
            ("rounds", f"{data.rounds_done} of {data.rounds_total} completed ({data.state})"),
            ("final model's held-out loss", final_text(data.final_loss)),
            ("wall time", f"{duration(data.wall_s)} from submit to "
                          + ("the end" if data.state in ("completed", "failed", "cancelled")
                             else "now"))]
    body = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                     for k, v in rows)
    return f'<table id="{SUMMARY_ID}" class="summary">\n{body}\n</table>'
