"""``python -m xffl.aggregator``: the same command as ``xffl aggregate``, as a module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from xffl.aggregator.__main__ import main
from xffl.aggregator.exchange import read_manifest, verify_checkpoint
from xffl.aggregator.shards import MODEL_FILE


def _t(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((4, 3)).astype(np.float32)}


def test_cli_reports_used_and_rejected(
    make_update: Any, write_ckpt: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    g0 = write_ckpt(tmp_path / "g0", _t(0), kind="global", site=None, round=0)
    parent = read_manifest(g0).digest()
    a = make_update("alpha", _t(1), round=1, parent=parent, num_samples=3)
    b = make_update("beta", _t(2), round=1, parent=parent, num_samples=1)
    late = make_update("gamma", _t(3), round=0, parent=parent)
    out = tmp_path / "g1"
    code = main(["-o", str(out), "--round", "1", "--previous", str(g0), str(a), str(b),
                 str(late)])
    text = capsys.readouterr().out
    assert code == 0
    assert "used     alpha" in text and "weight 0.7500" in text
    assert "rejected gamma" in text and "round 0, expected round 1" in text
    m = verify_checkpoint(out)
    assert m.kind == "global" and m.round == 1 and m.parent == parent
    assert set(m.extra["sites"]) == {"alpha", "beta"}

    code = main(
        [
            "-o",
            str(tmp_path / "g2"),
            "--json",
            "--weight",
            "alpha=1",
            "--weight",
            "beta=1",
            str(a),
            str(b),
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and [u["weight"] for u in report["used"]] == [0.5, 0.5]


def test_cli_exit_codes(
    make_update: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = make_update("alpha", _t(1), round=3)
    assert main(["-o", str(tmp_path / "g"), "--round", "4", str(a)]) == 1
    assert "0 update(s) accepted" in capsys.readouterr().err
    assert not (tmp_path / "g").exists()
    assert main(["-o", str(tmp_path / "g"), "--weight", "alpha", str(a)]) == 2
    assert "expected SITE=NUMBER" in capsys.readouterr().err
    assert main(["-o", str(tmp_path / "g"), "--strategy", "fedsgd", str(a)]) == 2
    assert "unknown strategy 'fedsgd'" in capsys.readouterr().err
    assert main(["-o", str(tmp_path / "g")]) == 2  # no UPDATE


def test_module_runs_as_a_program(make_update: Any, tmp_path: Path) -> None:
    a = make_update("alpha", _t(1))
    proc = subprocess.run(
        [sys.executable, "-m", "xffl.aggregator", "-o", str(tmp_path / "g"), str(a)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "fedavg of 1 update(s), round 1" in proc.stdout
    assert (tmp_path / "g" / MODEL_FILE).is_file()


def test_max_shard_size_splits_the_global(
    make_update: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(5)
    t = {k: rng.standard_normal((10, 10)).astype(np.float32) for k in ("a", "b", "c")}
    ups = [str(make_update(s, t, num_samples=1 + i)) for i, s in enumerate(("alpha", "beta"))]
    assert main(["-o", str(tmp_path / "one"), "--json", *ups]) == 0  # default 5GB: one file
    assert json.loads(capsys.readouterr().out)["global"]["files"] == [
        "config.json", MODEL_FILE
    ]
    assert main(["-o", str(tmp_path / "sharded"), "--max-shard-size", "0.7KB", "--json", *ups]) == 0
    files = json.loads(capsys.readouterr().out)["global"]["files"]
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]  # 400 bytes each
    assert files == ["config.json", *shards, "model.safetensors.index.json"]
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": 1200},
                     "weight_map": {"a": shards[0], "b": shards[1], "c": shards[2]}}
    verify_checkpoint(tmp_path / "sharded")
    assert main(["-o", str(tmp_path / "bad"), "--max-shard-size", "lots", *ups]) == 2
    assert "max shard size 'lots'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
