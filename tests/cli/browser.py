"""A page's layout as headless Chromium lays it out: element boxes measured in the browser.

A copy of the page gets a small script that, once the page is laid out, measures every
element's bounding box and writes what the tests read as JSON into the DOM;
``chromium --headless --dump-dom`` prints that DOM. Layout, not pixels: a test compares
boxes, never a screenshot.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

LAYOUT_ID = "xffl-layout"
# every element whose box reaches outside the page; the breakdown's legend, bars, title and
# round labels (their SVG ids, xffl.jobs.report.render); the summary's rows; the page's own
# widths
MEASURE = """<script>
(() => {
  const page = document.documentElement.clientWidth;
  const box = (e) => { const r = e.getBoundingClientRect();
                       return [r.left, r.top, r.right, r.bottom]; };
  const wide = [];
  for (const e of document.body.querySelectorAll("*")) {
    const r = e.getBoundingClientRect();
    if (r.width > 0 && (r.left < -0.5 || r.right > page + 0.5)) {
      wide.push({tag: e.tagName, id: e.id, class: e.getAttribute("class"),
                 left: r.left, right: r.right});
    }
  }
  const legend = document.getElementById("breakdown-legend");
  const summary = document.getElementById("summary");
  const out = {
    page: page, scroll_width: document.documentElement.scrollWidth,
    height: document.documentElement.scrollHeight, wide: wide,
    legend: legend ? box(legend) : null,
    bars: [...document.querySelectorAll('[id^="breakdown-bar-"]')].map(
      (e) => ({id: e.id, box: box(e)})),
    texts: [...document.querySelectorAll('[id^="breakdown-text-"]')].map(
      (e) => ({id: e.id, box: box(e)})),
    summary: summary ? [...summary.querySelectorAll("tr")].map(
      (tr) => [tr.cells[0].textContent, tr.cells[1].textContent]) : null,
    summary_top: summary ? box(summary)[1] : null,
    first_heading_top: box(document.querySelector("h2"))[1],
  };
  const pre = document.createElement("pre");
  pre.id = "LAYOUT_ID";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script>""".replace("LAYOUT_ID", LAYOUT_ID)


def chromium() -> str:
    """The Chromium binary; the test fails where CI is set (the install script installs it),
    and is skipped elsewhere."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        why = "chromium is not installed (scripts/install-system-deps.sh installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return found


def _run(argv: list[str]) -> str:
    done = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", "--no-first-run", *argv],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def layout(page: Path, width: int, where: Path) -> dict[str, Any]:
    """``page`` laid out in a ``width`` px wide window: the measurements of MEASURE."""
    copy = where / f"measured-{page.name}"
    text = page.read_text()
    copy.write_text(text.replace("</body>", f"{MEASURE}\n</body>"))
    for name in (p.name for p in page.parent.glob("*.png")):  # the links beside the page
        if not (where / name).exists():
            shutil.copy(page.parent / name, where / name)
    dom = _run([f"--window-size={width},1000", "--dump-dom", copy.as_uri()])
    found = re.search(rf'<pre id="{LAYOUT_ID}">(.*?)</pre>', dom, re.S)
    assert found is not None, dom[-2000:]
    data: dict[str, Any] = json.loads(html.unescape(found.group(1)))
    return data


def screenshot(page: Path, width: int, height: int, out: Path) -> None:
    """A PNG of ``page`` in a ``width`` x ``height`` window (for the docs)."""
    _run([f"--window-size={width},{height}", f"--screenshot={out}", page.as_uri()])


def intersects(a: list[float], b: list[float]) -> bool:
    """Whether two boxes [left, top, right, bottom] share an area (touching is not)."""
    return min(a[2], b[2]) > max(a[0], b[0]) and min(a[3], b[3]) > max(a[1], b[1])
