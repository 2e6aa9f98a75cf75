"""The forked launcher's warm-up of a LoRA round imports peft once, before the ranks fork."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from xffl.training.__main__ import warm_imports


def test_a_lora_rounds_warm_up_imports_peft(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A round with ``--base`` (a LoRA round) has peft imported by the warm-up, so that each
    forked rank does not import it again (0.4 CPU-s a rank: the sft page's 12 ranks spent
    12.6 CPU-s, then 6.6 with the warm-up's 2.4)."""
    monkeypatch.delitem(sys.modules, "peft", raising=False)
    warm_imports(["--job", "job.json", "--base", str(tmp_path), "--model", str(tmp_path)])
    assert "peft" in sys.modules
