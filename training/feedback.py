"""Error feedback: what quantization lost from a site's last update, kept at the site.

With ``exchange.error_feedback`` a site adds the residual of its previous round
(``r = v - dequantize(quantize(v))`` where ``v`` was the delta it meant to send) to this
round's delta before quantizing it, so that over rounds the coordinator receives the sum of
the true deltas up to one round's quantization error (Seide et al. 2014; Karimireddy et al.
2019). The residual is site-local state: ``STATE/error-feedback/r<round>.safetensors``
(float32, the model's names and shapes), where STATE is the launcher's ``--keep`` folder
(beside the kept update, handed to the ranks in ``XFFL_SITE_STATE``) or the virtual site's
own folder in ``xffl simulate``. It is never written into the update a site sends.

Round ``r`` reads the newest residual of a round before ``r`` (a site left out of a round
carries its residual on) and writes its own; older ones are removed. A round run again reads
the same residual as its first try, so a retry sends the same update.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from xffl.aggregator.safetensors_io import Array, SafetensorsReader, SafetensorsWriter
from xffl.training.chain_files import SITE_STATE_ENV

FOLDER = "error-feedback"
_NAME = re.compile(r"^r([0-9]{1,9})\.safetensors$")


def state_dir_from_env() -> Path | None:
    """The site's state folder the launcher handed down (None: none)."""
    value = os.environ.get(SITE_STATE_ENV)
    return Path(value) if value else None


def _rounds(folder: Path) -> dict[int, Path]:
    out: dict[int, Path] = {}
    if folder.is_dir():
        for path in folder.iterdir():
            match = _NAME.match(path.name)
            if match and path.is_file():
                out[int(match.group(1))] = path
    return out


class Residuals:
    """The residual carried into round ``round`` and the writer of this round's."""

    def __init__(self, state_dir: Path, round: int,
                 entries: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Open the newest residual before ``round`` (if its names and shapes are the
        model's) and start ``r<round>``'s file with ``entries`` (name, shape), in that order."""
        self.folder = Path(state_dir) / FOLDER
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.round = round
        earlier = {r: p for r, p in _rounds(self.folder).items() if r < round}
        self.carried_round = max(earlier) if earlier else None
        self._reader: SafetensorsReader | None = None
        want = {name: tuple(shape) for name, shape in entries}
        if self.carried_round is not None:
            reader = SafetensorsReader(earlier[self.carried_round])
            if {n: tuple(e.shape) for n, e in reader.entries.items()} == want:
                self._reader = reader
            else:  # another model's: nothing to carry
                reader.close()
        self.path = self.folder / f"r{round}.safetensors"
        self._tmp = self.folder / f".r{round}.tmp-{os.getpid()}"
        self._writer = SafetensorsWriter(
            self._tmp, [(n, "F32", tuple(s)) for n, s in entries],
            {"round": str(round), "carried": str(self.carried_round)})

    def carried(self, name: str, start: int = 0, stop: int | None = None) -> Array | None:
        """The residual of ``name`` carried in (float32, flat; elements ``[start, stop)``),
        or None at the first round."""
        if self._reader is None:
            return None
        out: Array = np.array(self._reader.raw(name, start, stop), dtype=np.float32)
        return out

    def keep(self, name: str, residual: Array) -> None:
        """Write this round's residual of ``name`` (in the order of the entries)."""
        self._writer.write_chunk(name, residual.astype(np.float32).reshape(-1))

    def commit(self) -> None:
        """Finish this round's file; remove residuals older than the one carried in."""
        self._writer.close()
        os.replace(self._tmp, self.path)
        if self._reader is not None:
            self._reader.close()
        for r, path in _rounds(self.folder).items():
            if r < (self.carried_round if self.carried_round is not None else self.round):
                path.unlink(missing_ok=True)

    def abort(self) -> None:
        """Drop this round's unfinished file."""
        if self._reader is not None:
            self._reader.close()
        self._writer.abort()
