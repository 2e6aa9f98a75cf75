"""CLI: `xffl aggregate`, registered in a test-only Typer app."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from tests.aggregator.conftest import write_checkpoint
from tests.conftest import FinishedRun
from xffl.aggregator.exchange import read_manifest, verify_checkpoint
from xffl.aggregator.safetensors_io import SafetensorsReader
from xffl.aggregator.shards import MODEL_FILE
from xffl.cli.aggregate import aggregate

runner = CliRunner()
app = typer.Typer()


@app.callback()
def _root() -> None:
    """Test-only root, so that `aggregate` is a subcommand as in xffl's app."""


app.command()(aggregate)


def _t(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((4, 3), value, dtype=np.float32)}


def _setup(tmp_path: Path) -> tuple[Path, list[Path]]:
    g0 = write_checkpoint(tmp_path / "g0", _t(0.0), kind="global", site=None, round=0)
    parent = read_manifest(g0).digest()
    ups = [
        write_checkpoint(tmp_path / s, _t(v), site=s, round=1, parent=parent, num_samples=n)
        for s, v, n in (("alpha", 1.0, 3), ("beta", 2.0, 1))
    ]
    return g0, ups


def test_fedavg_text_output(tmp_path: Path) -> None:
    g0, ups = _setup(tmp_path)
    out = tmp_path / "g1"
    args = ["aggregate", "--strategy", "fedavg", "-o", str(out), "--previous", str(g0)]
    result = runner.invoke(app, [*args, *map(str, ups)])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and "fedavg of 2 update(s)" in result.output
    verify_checkpoint(out)
    with SafetensorsReader(out / MODEL_FILE) as r:
        np.testing.assert_allclose(r.read("w"), 1.25)


def test_fedadam_json_and_state_files(tmp_path: Path) -> None:
    g0, ups = _setup(tmp_path)
    out = tmp_path / "g1"
    args = [
        "aggregate",
        "--strategy",
        "fedadam",
        "--param",
        "eta=0.5",
        "-o",
        str(out),
        "--previous",
        str(g0),
        "--round",
        "1",
        "--json",
    ]
    result = runner.invoke(app, [*args, *map(str, ups)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["global"]["params"]["eta"] == 0.5
    assert "server_m.safetensors" in report["global"]["files"]
    assert [u["site"] for u in report["used"]] == ["alpha", "beta"]


def test_bad_input_exit_codes(tmp_path: Path) -> None:
    _, ups = _setup(tmp_path)
    out = str(tmp_path / "g1")
    bad_param = runner.invoke(app, ["aggregate", "-o", out, "--param", "eta", str(ups[0])])
    assert bad_param.exit_code == 2 and "KEY=NUMBER" in bad_param.stderr
    no_prev = runner.invoke(app, ["aggregate", "--strategy", "fedyogi", "-o", out, str(ups[0])])
    assert no_prev.exit_code == 2 and "previous global" in no_prev.stderr
    wrong_round = runner.invoke(app, ["aggregate", "-o", out, "--round", "2", str(ups[0])])
    assert wrong_round.exit_code == 1 and "0 update(s) accepted" in wrong_round.stderr
    # a path that is no directory is the user's typo, not a failed run
    missing = runner.invoke(app, ["aggregate", "-o", out, str(ups[0]), str(tmp_path / "nope")])
    assert missing.exit_code == 2, missing.output
    assert missing.stderr == f"error: update {tmp_path / 'nope'}: no such directory; give the " \
        "update checkpoint directories the sites sent back.\n"
    assert not (tmp_path / "g1").exists()


def test_max_shard_size_option(tmp_path: Path) -> None:
    t = {k: np.full((10, 10), v, dtype=np.float32) for k, v in (("a", 1.0), ("b", 2.0))}
    ups = [write_checkpoint(tmp_path / s, t, site=s) for s in ("alpha", "beta")]
    out = tmp_path / "g1"
    args = ["aggregate", "-o", str(out), "--max-shard-size", "400", "--json", *map(str, ups)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert json.loads(result.stdout)["global"]["files"] == [
        "config.json", *shards, "model.safetensors.index.json"
    ]
    assert verify_checkpoint(out).tensors == read_manifest(ups[0]).tensors
    bad = runner.invoke(app, ["aggregate", "-o", str(tmp_path / "g2"), "--max-shard-size",
                              "5 gigs", str(ups[0])])
    assert bad.exit_code == 2 and "max shard size '5 gigs'" in bad.stderr
    assert not (tmp_path / "g2").exists()


def test_help_ends_with_example() -> None:
    result = runner.invoke(app, ["aggregate", "--help"])
    assert result.exit_code == 0
    assert "xffl aggregate --strategy fedavg -o DIR UPDATE..." in result.output


def test_an_existing_output_is_kept_unless_forced(tmp_path: Path) -> None:
    _g0, ups = _setup(tmp_path)
    out = tmp_path / "g1"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    refused = runner.invoke(app, ["aggregate", "-o", str(out), *map(str, ups)])
    assert refused.exit_code == 2, refused.output
    assert "--force" in refused.output and (out / "keep.txt").read_text() == "mine"
    forced = runner.invoke(app, ["aggregate", "-o", str(out), "--force", *map(str, ups)])
    assert forced.exit_code == 0, forced.output
    assert not (out / "keep.txt").exists()
    verify_checkpoint(out)


def test_clip_norm_and_weight_cap_from_the_command_line(tmp_path: Path) -> None:
    # alpha moves every element of w (12 of them) from 0 to 1: a change of norm sqrt(12),
    # clipped to 0.5 (factor 0.5/sqrt(12)); beta moves them to 2, clipped by 0.5/sqrt(48).
    # Samples 3:1 capped at 0.6 -> shares 0.6 and 0.4. Each element: 0.6 * 0.5/sqrt(12) * 1
    # + 0.4 * 0.5/sqrt(48) * 2 = (0.3 + 0.2) / sqrt(12), computed in float64 (relative error
    # ~1e-15) and rounded once to fp32 (relative error <= 2^-24): rtol 2^-23 covers both.
    g0, ups = _setup(tmp_path)
    out = tmp_path / "g1"
    result = runner.invoke(app, ["aggregate", "-o", str(out), "--previous", str(g0),
                                 "--clip-norm", "0.5", "--max-weight-share", "0.6", "--json",
                                 *map(str, ups)])
    assert result.exit_code == 0, result.output
    with SafetensorsReader(out / MODEL_FILE) as r:
        np.testing.assert_allclose(r.read("w"), 0.5 / np.sqrt(12.0), rtol=2.0**-23, atol=0)
    bounds = read_manifest(out).extra["bounds"]
    assert bounds["clip_norm"] == 0.5 and bounds["max_weight_share"] == 0.6


def test_bf16_deltas_by_hand(tmp_path: Path) -> None:
    """`--exchange delta/bf16 --previous G`: the updates hold changes from G in bf16."""
    import torch

    g0 = write_checkpoint(tmp_path / "g0", _t(0.5), kind="global", site=None, round=0)
    parent = read_manifest(g0).digest()
    ups = [write_checkpoint(tmp_path / s, {"w": torch.full((4, 3), d, dtype=torch.bfloat16)},
                            site=s, round=1, parent=parent, num_samples=n)
           for s, d, n in (("alpha", 0.25, 3), ("beta", -1.0, 1))]
    out = tmp_path / "g1"
    base = ["aggregate", "-o", str(out)]
    result = runner.invoke(app, [*base, "--previous", str(g0), "--exchange", "delta/bf16",
                                 *map(str, ups)])
    assert result.exit_code == 0, result.output
    with SafetensorsReader(out / MODEL_FILE) as r:  # 0.5 + (3 * 0.25 - 1) / 4: exact
        np.testing.assert_array_equal(r.read("w"), np.full((4, 3), 0.4375, dtype=np.float32))
    # read as fp32 weights, the same updates are refused: their dtype is not the global's
    plain = runner.invoke(app, [*base, "--force", "--previous", str(g0), *map(str, ups)])
    assert plain.exit_code == 1 and "has dtype BF16, the global model has F32" in plain.output
    for argv, words in ((["--exchange", "delta/bf16"], "give it with --previous DIR"),
                        (["--previous", str(g0), "--exchange", "delta"], "give UPDATE/DTYPE")):
        bad = runner.invoke(app, [*base, "--force", *argv, *map(str, ups)])
        assert bad.exit_code == 2 and words in bad.output, bad.output


def test_nf4_deltas_by_hand(tmp_path: Path) -> None:
    """`--exchange delta/nf4/16 --previous G --strategy diloco`: nf4 codes and scales."""
    import torch

    from xffl.aggregator.quantize import quantize
    from xffl.aggregator.exchange_spec import ExchangeSpec

    codec = ExchangeSpec.parse("delta/nf4/16").codec
    assert codec is not None
    g0 = write_checkpoint(tmp_path / "g0", _t(0.5), kind="global", site=None, round=0)
    parent = read_manifest(g0).digest()
    ups = []
    for s, d, n in (("alpha", 0.25, 3), ("beta", -1.0, 1)):
        codes, scales = quantize(codec, np.full(12, d, dtype=np.float32))
        ups.append(write_checkpoint(tmp_path / s, {"w": torch.from_numpy(codes),
                                                   "w.absmax": torch.from_numpy(scales)},
                                    site=s, round=1, parent=parent, num_samples=n))
    out = tmp_path / "g1"
    result = runner.invoke(app, ["aggregate", "-o", str(out), "--previous", str(g0),
                                 "--exchange", "delta/nf4/16", "--strategy", "diloco",
                                 *map(str, ups)])
    assert result.exit_code == 0, result.output
    # a constant block is its absmax times NF4's 1.0 or -1.0: decoded exactly. The mean is
    # 0.5 + (3 * 0.25 - 1) / 4 = 0.4375, g = 0.0625, DiLoCo's first step 0.5 - 0.7 (1 + 0.9) g
    with SafetensorsReader(out / MODEL_FILE) as r:
        np.testing.assert_array_equal(r.read("w"), np.full(
            (4, 3), np.float32(0.5 - 0.7 * 1.9 * 0.0625), dtype=np.float32))
    bad = runner.invoke(app, ["aggregate", "-o", str(out), "--force", "--previous", str(g0),
                              "--exchange", "delta/nf4/100", *map(str, ups)])
    assert bad.exit_code == 2 and "give UPDATE/DTYPE" in bad.output, bad.output


def test_a_quickstart_round_aggregated_again_by_hand(tmp_path: Path, quickstart_run: FinishedRun,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`xffl aggregate --run RUN --round R` writes round R's global bit for bit from the
    updates the run kept (issue 31 item 7): the same files, the same digest. The same
    updates given by hand without the run's job are refused (they report validation numbers
    the bare command has no evaluation budget for), and the refusal names --run."""
    monkeypatch.setenv("XFFL_HOME", str(quickstart_run.home))
    run_dir = quickstart_run.run_dir
    for rnd in (1, 2, 3):
        out = tmp_path / f"g{rnd}"
        done = runner.invoke(app, ["aggregate", "--run", quickstart_run.run_id[:14], "--round",
                                   str(rnd), "-o", str(out), "--json"])
        assert done.exit_code == 0, done.output
        original = run_dir / "rounds" / str(rnd) / "global"
        want, got = read_manifest(original), read_manifest(out)
        assert json.loads(done.stdout)["global"]["digest"] == want.digest() == got.digest()
        assert got.files == want.files and (got.round, got.run_id) == (want.round, want.run_id)
        for name in want.files:
            assert (out / name).read_bytes() == (original / name).read_bytes(), name
        assert got.metrics == want.metrics and got.extra["sites"] == want.extra["sites"]
    kept = sorted((run_dir / "rounds" / "2" / "updates").iterdir())
    bare = runner.invoke(app, ["aggregate", "-o", str(tmp_path / "bare"),
                               "--previous", str(run_dir / "rounds" / "1" / "global"),
                               *map(str, kept)])
    assert bare.exit_code == 1 and "no data.validation" in bare.stderr
    assert "--run RUN --round R" in bare.stderr and not (tmp_path / "bare").exists()
    budget = runner.invoke(app, ["aggregate", "-o", str(tmp_path / "budget"), "--round", "2",
                                 "--previous", str(run_dir / "rounds" / "1" / "global"),
                                 "--max-val-samples", "1000", *map(str, kept)])
    assert budget.exit_code == 0, budget.output
    assert read_manifest(tmp_path / "budget").files == read_manifest(
        run_dir / "rounds" / "2" / "global").files
    for argv, words in ((["--run", "last"], "add --round R"),
                        (["--run", "last", "--round", "9"], "kept no aggregated updates"),
                        (["--run", "last", "--round", "1", "--previous", str(kept[0])],
                         "leave out --previous")):
        bad = runner.invoke(app, ["aggregate", "-o", str(tmp_path / "x"), *argv])
        assert bad.exit_code == 2 and words in bad.stderr, bad.output
