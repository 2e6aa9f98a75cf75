"""The final model's held-out loss: after the quickstart's last round every site evaluates the
final global (round 3's), as Flower's final evaluation; `xffl status` (and --json) and the
run directory carry the federated value, which equals an evaluation made here by
transformers, in float64, of the same files on the same held-out windows. (`xffl evaluate RUN
--final` by hand: tests/workflows/test_evaluate.py, on the seeded run its other tests share.)"""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from tests.cli.schemas import check
from tests.conftest import QUICKSTART, FinishedRun
from tests.workflows.test_end_to_end import held_out_windows
from xffl.cli.app import app
from xffl.core.layout import RunLayout
from xffl.jobs.registry.records import FinalLoss
from xffl.workflows.evaluate_run import Outcome, SiteRow
from xffl.workflows.final_evaluation import final_loss
from xffl.workflows.steps.evaluate_result import SiteEvaluation

runner = CliRunner()
U = 2.0**-24  # fp32's unit roundoff: the sites evaluate in fp32


def test_the_final_loss_is_the_mean_over_the_sites_targets() -> None:
    """Two sites' rows: their losses weighted by their held-out targets (not by their
    sequences: an SFT site's sequences hold few targets), the median of the two, and a site
    whose evaluation failed left out."""
    rows = [SiteRow("alpha", SiteEvaluation("alpha", 77, {"global": 2.0}, tokens=100)),
            SiteRow("beta", SiteEvaluation("beta", 52, {"global": 3.0}, tokens=300)),
            SiteRow("gamma", error="the evaluation at the site failed: no data")]
    got = final_loss(Outcome(run_id="r", round=3, models=["global"], rows=rows, seconds=1.0))
    assert got == FinalLoss(round=3, val_loss=(2.0 * 100 + 3.0 * 300) / 400,
                            val_loss_median=2.5, val_samples=129, val_tokens=400,
                            sites={"alpha": 2.0, "beta": 3.0},
                            site_tokens={"alpha": 100, "beta": 300})
    # no row with a target in the loss: nothing to record
    none = [SiteRow("alpha", SiteEvaluation("alpha", 3, {"global": 2.0}, tokens=0))]
    assert final_loss(Outcome("r", 3, ["global"], none, 1.0)) is None


def _windows(quickstart_run: FinishedRun, site: dict[str, object], seq_len: int) -> np.ndarray:
    """A site's held-out windows (seq_len + 1 tokens), as documented, derived here."""
    data_dir = quickstart_run.home / "sites" / str(site["name"]) / "data" / str(site["name"])
    tokens = np.fromfile(data_dir / "train.bin", dtype=np.uint16).astype(np.int64)
    n = len(tokens) // (seq_len + 1)
    validation = site["data"]["validation"]  # type: ignore[index]
    held = held_out_windows(n, validation["fraction"])
    return np.stack([tokens[w * (seq_len + 1):(w + 1) * (seq_len + 1)] for w in held])


@pytest.mark.slow
def test_the_quickstarts_final_loss_is_an_evaluation_of_the_last_global(
        quickstart_run: FinishedRun, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quickstart (3 rounds, 2 sites of 2 ranks): its final loss is that of round 3's
    global on the sites' held-out windows, recomputed here in float64 by transformers."""
    import torch
    import transformers

    monkeypatch.setenv("XFFL_HOME", str(quickstart_run.home))
    spec = yaml.safe_load(QUICKSTART.read_text())
    seq_len = spec["training"]["seq_len"]
    # what `xffl submit --wait --json` printed at the end, and `xffl status --json` now
    final = quickstart_run.status["final_loss"]
    shown = runner.invoke(app, ["status", quickstart_run.run_id, "--json"])
    assert shown.exit_code == 0, shown.output
    assert check("status", json.loads(shown.stdout))["final_loss"] == final
    on_disk = json.loads(RunLayout(quickstart_run.run_dir).final_validation.read_text())
    assert on_disk == final and final["round"] == 3
    text = runner.invoke(app, ["status", quickstart_run.run_id], env={"COLUMNS": "200"})
    assert (f"final model (the global after round 3): held-out loss {final['val_loss']:.4f}, "
            "the mean over the sites' held-out targets") in " ".join(text.stdout.split())

    model = transformers.LlamaForCausalLM.from_pretrained(
        str(quickstart_run.run_dir / "rounds" / "3" / "global"), torch_dtype=torch.float64)
    sums: list[float] = []  # S_z = max over tokens and logits j of sum_k |h_k W_jk|
    hook = model.lm_head.register_forward_hook(lambda mod, args, _out: sums.append(float(
        (args[0].abs() @ mod.weight.abs().T).max())))
    reference: dict[str, float] = {}
    bound: dict[str, float] = {}
    for site in spec["sites"]:
        rows = torch.from_numpy(_windows(quickstart_run, site, seq_len))
        with torch.no_grad():
            logits = model(rows[:, :-1]).logits
        reference[site["name"]] = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).item()
        # The bound of tests/workflows/test_end_to_end.py::test_federated_validation_every_
        # round, for this model (the same architecture, so the same N = 2048 rounded terms
        # per token chain): each rounding (|delta| <= u) enters a token's loss with a
        # coefficient <= 2 S_z, and the mean over T = n x seq_len tokens has
        # sum c_i^2 <= 256 N S_z^2 / T; as independent mean-zero errors, Hoeffding bounds
        # the error by 8 u S_z sqrt(256 N / T) but with probability <= 2 exp(-32) (2.5e-14).
        # Here S_z = 8.9 (round 3's global), so 4.4e-5 at alpha and 5.2e-5 at beta; the
        # global the last round started from is off by > 0.2.
        tokens = rows.shape[0] * seq_len
        bound[site["name"]] = 8 * U * sums[-1] * math.sqrt(256 * 2048 / tokens)
    hook.remove()
    assert final["sites"].keys() == reference.keys() == {"alpha", "beta"}
    assert final["site_tokens"] == {"alpha": 77 * seq_len, "beta": 52 * seq_len}
    assert (final["val_samples"], final["val_tokens"]) == (129, 129 * seq_len)
    assert max(sums) <= 16 and max(bound.values()) < 1e-4, (sums, bound)  # measured: 8.9
    for name, value in reference.items():
        assert abs(final["sites"][name] - value) <= bound[name], (name, final, value, bound)
    # the mean over all the targets: the sites' losses weighted by their targets; its error
    # is the same convex combination of the sites' errors, so within the larger bound
    expected = math.fsum(reference[s] * t for s, t in final["site_tokens"].items()) \
        / final["val_tokens"]
    assert abs(final["val_loss"] - expected) <= max(bound.values()), (final, expected)
    assert final["val_loss_median"] == statistics.median(final["sites"].values())
    # round 2's global, what round 3 measured, is another model: > 0.1 away from it
    last_round = quickstart_run.status["rounds"][-1]
    assert abs(last_round["val_loss"] - final["val_loss"]) > 100 * max(bound.values())
