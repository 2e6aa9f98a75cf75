"""Write a run's report: draw it into a temporary folder, then publish the files at once."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from xffl.core.errors import InvalidInput
from xffl.jobs.registry.records import RunRecord
from xffl.jobs.registry.store import Registry
from xffl.jobs.report.numbers import ReportData, assemble
from xffl.jobs.report.render import render_all


def _publish(out: Path, render: Callable[[Path], list[str]]) -> list[Path]:
    """Render into a temporary folder, then move the files into ``out`` all at once.

    A new ``out`` appears by one rename; in an existing one each file is replaced by a
    rename (the HTML last). A failure while rendering leaves ``out`` as it was.
    """
    out = out.absolute()
    if out.exists() and not out.is_dir():
        raise InvalidInput(f"{out} exists and is not a directory; give another one with -o.")
    fresh = not out.exists()
    try:
        (out.parent if fresh else out).mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".xffl-report-", dir=out.parent if fresh else out))
    except OSError as exc:
        raise InvalidInput(f"cannot write the report to {out}: {exc.strerror or exc}; "
                           "give another directory with -o.") from exc
    try:
        names = render(tmp)
        for name in names:
            with (tmp / name).open("rb") as f:
                os.fchmod(f.fileno(), 0o600)  # owner-only whatever the caller's umask
                os.fsync(f.fileno())
        if fresh:  # mkdtemp made it 0700, owner-only as the report stays
            try:
                os.rename(tmp, out)
                tmp = out
            except OSError:  # created meanwhile: fall back to moving the files one by one
                out.mkdir(mode=0o700, parents=True, exist_ok=True)
                fresh = False
        if not fresh:
            for name in names:
                os.replace(tmp / name, out / name)
            tmp.rmdir()
    except BaseException:
        if tmp != out:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / name for name in names]


def write_report(registry: Registry, run: RunRecord,
                 out_dir: Path | None = None) -> tuple[ReportData, dict[str, Path]]:
    """Write report.html, validation.png, loss.png, breakdown.png and throughput.png for ``run``.

    The default folder is ``<run_dir>/report``. Returns the numbers and each written file.
    """
    data = assemble(registry, run)
    out = Path(out_dir) if out_dir is not None else Path(run.run_dir) / "report"
    paths = _publish(out, lambda tmp: render_all(data, tmp))
    return data, {p.stem if p.suffix == ".png" else "html": p for p in paths}
