"""The streamed update save: the update the site wrote before (whole state dict, then
safetensors' ``save_file``), tensor for tensor, in one process and under FSDP2 at dp 2; rank
0's memory bounded by the largest tensor; a failed save leaves no update behind."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors import safe_open
from torch import Tensor

from tests.conftest import REPO
from tests.training.save_worker import (
    EXCHANGES,
    FSDP_CASES,
    eval_job,
    manifest,
    perturb,
    save_new,
    save_old,
)
from tests.workflows.warm_ranks import rank_python, warm_env
from xffl.aggregator import metrics as metric
from xffl.aggregator.exchange import CONFIG_FILE, Manifest, read_manifest, verify_checkpoint
from xffl.aggregator.exchange_spec import ExchangeSpec
from xffl.aggregator.reported import Bounds
from xffl.aggregator.shards import MODEL_FILE
from xffl.core.layout import RunLayout
from xffl.jobs.registry.states import SiteState
from xffl.training.arch import build_config
from xffl.training.checkpoint import init_global
from xffl.training.config import ModelSpec, TrainingSpec, TrainJob
from xffl.training.data import ensure_synthetic
from xffl.training.evaluate_models import evaluate_models
from xffl.training.feedback import FOLDER
from xffl.training.launch import launch
from xffl.training.model import build_model
from xffl.training.parallelize import ParallelModel
from xffl.training.update_save import gather_tensors, global_update_nbytes, save_update
from xffl.workflows.steps.admit import admit

MiB = 1 << 20
#: elements encoded at a time here: 2 quantization blocks of 128, so that a tiny model's
#: tensors (up to 256 x 32) are encoded in many pieces, as an 8B model's are
PIECE = 256


def _tensors(path: Path) -> dict[str, Tensor]:
    with safe_open(str(path), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118


def _bits(t: Tensor) -> Tensor:
    """A tensor's bytes, so that equality is bitwise (signed zeros, NaN payloads)."""
    return t.contiguous().view(torch.uint8)


def assert_same_update(old: Path, new: Path, quantized: bool) -> None:
    """The streamed update holds the old one's tensors bit for bit, its tensor index, its
    files (byte for byte where the layout is safetensors', see the module's docstring), and
    its manifest but for the save's seconds; its checksums are the files' own."""
    a, b = _tensors(old / MODEL_FILE), _tensors(new / MODEL_FILE)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(_bits(a[name]), _bits(b[name])), name
    ma, mb = verify_checkpoint(old), verify_checkpoint(new)  # the checksums are the files'
    assert ma.tensors == mb.tensors
    assert mb.metrics.pop(metric.SAVE_SECONDS) >= 0
    assert ma.model_dump(exclude={"files", "created"}) == mb.model_dump(
        exclude={"files", "created"})
    assert ma.files[CONFIG_FILE] == mb.files[CONFIG_FILE]
    if not quantized:  # one dtype: the very bytes save_file wrote
        assert ma.files == mb.files


def _residuals(state: Path) -> dict[str, dict[str, Tensor]]:
    folder = state / FOLDER
    return {p.name: _tensors(p) for p in sorted(folder.iterdir())} if folder.is_dir() else {}


def _global(tmp_path: Path, preset: str) -> tuple[Path, ParallelModel]:
    """A seeded global of ``preset`` and the model moved a little away from it."""
    parent = tmp_path / "global"
    init_global("save-test", ModelSpec(preset=preset), 3, parent)
    model = build_model(build_config(ModelSpec(preset=preset)), seed=3)
    perturb(model, 5)
    return parent, ParallelModel(module=model, net=model)


@pytest.mark.parametrize("preset", ["tiny-test", "tiny-qwen2"])
@pytest.mark.parametrize("spec", [*EXCHANGES, "delta/nf4", "weights/fp16"])
def test_streamed_save_writes_the_update_of_before(tmp_path: Path, preset: str,
                                                   spec: str) -> None:
    """One process, every exchange (fp32 weights, narrowed weights and deltas, int8 and nf4
    with error feedback over two rounds, so a carried residual is added), untied and tied
    (tiny-qwen2) embeddings, encoded in pieces: the same update and residual at the site."""
    parent, pm = _global(tmp_path, preset)
    config = build_config(ModelSpec(preset=preset))
    exchange = ExchangeSpec.parse(spec)
    for rnd in (1, 2):
        if rnd == 2:
            perturb(pm.module, 6)
        save_old(pm, config, parent, tmp_path / f"r{rnd}" / "old", exchange,
                 tmp_path / "old-state", rnd)
        save_new(pm, config, parent, tmp_path / f"r{rnd}" / "new", exchange,
                 tmp_path / "new-state", rnd, piece=PIECE)
        assert_same_update(tmp_path / f"r{rnd}" / "old", tmp_path / f"r{rnd}" / "new",
                           exchange.quantized)
        old, new = _residuals(tmp_path / "old-state"), _residuals(tmp_path / "new-state")
        kept = exchange.codec is not None and exchange.feedback  # nf4: yes, int8: no
        assert sorted(old) == sorted(new) == ([f"r{r}.safetensors" for r in range(1, rnd + 1)]
                                              if kept else [])
        for file, tensors in old.items():
            for name, value in tensors.items():
                assert torch.equal(_bits(value), _bits(new[file][name])), (file, name)
    if preset == "tiny-qwen2":  # the tied head is the embedding: written once
        names = {t.name for t in read_manifest(tmp_path / "r1" / "new").tensors}
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch of 2 forked gloo ranks running every case of tests/training/save_worker.py
    (the wide model's save, the FSDP2 and tp saves, the sliced evaluation); its folder."""
    out = tmp_path_factory.mktemp("save")
    ensure_synthetic(out / "evaluate" / "data", "alpha", 64, 16)
    init_global("save-test", ModelSpec(preset="tiny-test"), 3, out / "evaluate" / "global")
    cmd = [str(rank_python()), "-m", "xffl.training.forked", "--nproc-per-node", "2",
           "-m", "tests.training.save_worker", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("update-save")  # one worker launches the ranks once
def test_streamed_save_under_fsdp2_and_tp(launched: Path) -> None:
    """Two gloo ranks, FSDP2 at dp 2 (uneven shards of an odd vocabulary; tied embeddings)
    and tp 2: the streamed update (each tensor's blocks sent to rank 0) equals the one
    gathered whole by torch's get_model_state_dict, for each exchange
    (tests/training/save_worker.py)."""
    for case in FSDP_CASES:
        for spec in EXCHANGES:
            where = launched / "fsdp" / case / spec.replace("/", "-")
            assert_same_update(where / "old", where / "new", ExchangeSpec.parse(spec).quantized)


def test_a_failed_save_leaves_no_update(tmp_path: Path) -> None:
    """A save that fails half way (the disk fills after two tensors) leaves the previous
    update in place, no temporary folder and no residual of the round."""
    parent, pm = _global(tmp_path, "tiny-test")
    config = build_config(ModelSpec(preset="tiny-test"))
    exchange = ExchangeSpec.parse("delta/nf4")
    out = tmp_path / "runs" / "update"
    save_new(pm, config, parent, out, exchange, tmp_path / "state")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    shapes, gathered = gather_tensors(pm)
    taken: list[str] = []

    def disk_fills() -> Iterator[tuple[str, Tensor | None]]:
        for name, tensor in gathered:
            taken.append(name)
            if len(taken) == 3:
                raise OSError(28, "No space left on device")
            yield name, tensor

    perturb(pm.module, 7)
    with pytest.raises(OSError, match="No space left"):
        save_update(disk_fills(), shapes, config.to_json(), out, manifest(2), exchange,
                    parent, tmp_path / "state")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["update"]  # no .tmp left
    assert sorted(_residuals(tmp_path / "state")) == ["r1.safetensors"]
    verify_checkpoint(out)


def test_a_failed_write_runs_the_gathering_out(tmp_path: Path) -> None:
    """A write that fails (the global's tensor has another shape) still runs the gathering
    to its end: every rank takes part in every collective, whatever rank 0 met."""
    parent, pm = _global(tmp_path, "tiny-test")
    config = build_config(ModelSpec(preset="tiny-test"))
    shapes, gathered = gather_tensors(pm)
    first = next(iter(shapes))
    shapes[first] = (1, *shapes[first])  # the declared shape the global does not have
    with pytest.raises(Exception, match="shape"):
        save_update(gathered, shapes, config.to_json(), tmp_path / "update", manifest(),
                    ExchangeSpec.parse("delta/bf16"), parent)
    assert list(gathered) == []
    assert not (tmp_path / "update").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("update-save")
def test_rank0_memory_is_the_largest_tensor_plus_a_constant(launched: Path) -> None:
    """FSDP2 at dp 2 over a model at Llama-3.1-8B width (one layer, the 128256 x 4096 fp32
    embedding of 2 GiB the largest tensor): rank 0's peak RSS while saving rises by at most
    the largest tensor plus 256 MiB. Gathering the whole state dict first (the save before
    streaming) raised it by 7.2 GB here: the model, plus full_tensor()'s copies over gloo."""
    seen = json.loads((launched / "memory" / "memory.json").read_text())
    rise = seen["peak"] - seen["before"]
    assert seen["largest"] == 128256 * 4096 * 4
    assert rise <= seen["largest"] + 256 * MiB, f"{rise / MiB:.0f} MiB"
    verify_checkpoint(launched / "memory" / "new")


def test_the_coordinator_admits_the_save_seconds(tmp_path: Path) -> None:
    """The streamed update, its save_seconds included, is admitted as it is; a negative
    duration is a rejection naming the metric."""
    parent, pm = _global(tmp_path, "tiny-test")
    config = build_config(ModelSpec(preset="tiny-test"))
    layout = RunLayout(tmp_path / "run")
    exchange = ExchangeSpec.parse("delta/bf16")
    sent = manifest().model_copy(update={"parent": read_manifest(parent).digest()})
    for site, seconds in (("a", None), ("b", -1.0)):
        shapes, gathered = gather_tensors(pm)
        out = save_update(gathered, shapes, config.to_json(), tmp_path / site,
                          sent.model_copy(update={"site": site}), exchange, parent)
        assert out.metrics[metric.SAVE_SECONDS] >= 0
        if seconds is not None:
            data = json.loads((tmp_path / site / "manifest.json").read_text())
            data["metrics"][metric.SAVE_SECONDS] = seconds
            (tmp_path / site / "manifest.json").write_text(json.dumps(data))
        verdict, _ = admit(layout, site, 1, parent, tmp_path / site, Bounds(), exchange)
        if seconds is None:
            assert verdict.state == SiteState.COMPLETED, verdict.reason
        else:
            assert verdict.state == SiteState.REJECTED
            assert "metric 'save_seconds' is -1.0; a duration is never negative" in \
                verdict.reason, verdict.reason


@pytest.mark.parametrize("spec", ["weights/fp32", "delta/bf16", "delta/nf4"])
def test_time_margin_auto_grows_with_the_updates_bytes(tmp_path: Path, spec: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``time_margin: auto`` keeps 120 s plus 8 s per GB of the update the round will write
    (its tensors' bytes, exactly: the file less its header); a number is kept as it is."""
    from xffl.training.trainer import round_deadline

    parent, pm = _global(tmp_path, "tiny-test")
    exchange = ExchangeSpec.parse(spec)
    nbytes = global_update_nbytes(parent, exchange)
    save_new(pm, build_config(ModelSpec(preset="tiny-test")), parent, tmp_path / "u",
             exchange, None)
    with (tmp_path / "u" / MODEL_FILE).open("rb") as fh:
        header = 8 + int.from_bytes(fh.read(8), "little")
    assert nbytes == (tmp_path / "u" / MODEL_FILE).stat().st_size - header
    end = time.time() + 3600
    monkeypatch.setattr("xffl.training.distributed.job_end_time", lambda environ=None: end)
    assert round_deadline(TrainingSpec(), 7.5, 32 * 10**9) == end - (120 + 8 * 32) - 7.5
    assert round_deadline(TrainingSpec(), 0.0, nbytes) == end - 120 - 8 * nbytes / 1e9
    assert round_deadline(TrainingSpec(time_margin=30), 0.0, 32 * 10**9) == end - 30


@pytest.mark.slow
@pytest.mark.xdist_group("update-save")
def test_evaluate_loads_the_model_in_slices(launched: Path) -> None:
    """``xffl evaluate`` on two ranks holds every weight as FSDP2 slices (never the whole
    model per rank) and gets the loss one process gets loading it whole.

    Tolerance: the weights are the checkpoint's bit for bit either way (FSDP2 all-gathers
    exact copies); only how the token losses are summed differs (per rank, then one
    all-reduce, against one sum), a reordering of at most a few hundred fp32 additions of
    terms below 10: relative error below 1e-6 by far; 1e-5 of the loss."""
    where = launched / "evaluate"
    data = where / "data"
    ranks = [json.loads((where / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["sliced"] for r in ranks] == [True, True]
    _, _, whole = evaluate_models(eval_job(data), {"global": where / "global"}, data, True)
    got = ranks[0]["losses"]["global"]
    assert abs(got - whole["global"]) <= 1e-5 * whole["global"], (got, whole)


@pytest.mark.parametrize("bad", ["soon", -3, float("inf"), True])
def test_time_margin_is_auto_or_seconds(bad: object) -> None:
    """Anything else is one error naming what the field takes."""
    with pytest.raises(ValidationError) as info:
        TrainingSpec(time_margin=bad)
    (error,) = info.value.errors()
    assert error["loc"] == ("time_margin",)
    assert "must be a number of seconds (0 or more) or auto" in error["msg"]


@pytest.mark.slow
def test_a_fsdp2_round_writes_its_update_streamed(
        tmp_path: Path, global0: tuple[Path, Manifest],
        make_job: Callable[..., TrainJob]) -> None:
    """A round at dp 2 under FSDP2 through the launcher: rank 1 takes part in every gather
    while rank 0 writes the bf16 delta; the update verifies, carries its save seconds, and
    decodes (the global plus the delta) to a model that trained away from the global."""
    job = make_job(tmp_path / "data", steps=2)
    job = job.model_copy(update={
        "training": job.training.model_copy(update={"data_parallel": "fsdp"}),
        "exchange": ExchangeSpec.parse("delta/bf16")})
    (tmp_path / "job.json").write_text(job.model_dump_json())
    out = tmp_path / "update"
    args = ["--job", str(tmp_path / "job.json"), "--round", "1", "--model", str(global0[0]),
            "--out", str(out)]
    assert launch(2, "torchrun", args, out, env=warm_env()) == 0
    manifest = verify_checkpoint(out)
    assert manifest.extra["dp"] == 2 and manifest.metrics[metric.SAVE_SECONDS] > 0
    delta, base = _tensors(out / MODEL_FILE), _tensors(global0[0] / MODEL_FILE)
    assert sorted(delta) == sorted(base)
    assert all(d.dtype == torch.bfloat16 for d in delta.values())
    assert any(bool(d.any()) for d in delta.values())


@pytest.mark.parametrize("spec", ["weights/fp32", "delta/bf16", "delta/nf4"])
def test_a_lora_adapter_is_written_as_before(tmp_path: Path, spec: str) -> None:
    """A LoRA update (the adapter's tensors, held whole by rank 0) through the streamed
    writer: adapter_model.safetensors and adapter_config.json as lora.save_adapter wrote
    them, the same tensors, the same residual (nf4)."""
    from xffl.aggregator.kinds import LORA_ADAPTER
    from xffl.training import lora
    from xffl.training.config import LoraSpec
    from xffl.training.encode import encode_update

    lora_spec = LoraSpec(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
    parent = tmp_path / "global"
    lora.init_adapter_global("save-test", ModelSpec(preset="tiny-test"), lora_spec, 0,
                             parent, "base")
    gen = torch.Generator().manual_seed(4)
    state = {name: value + 0.01 * torch.randn(value.shape, generator=gen)
             for name, value in _tensors(parent / LORA_ADAPTER.tensor_file).items()}
    config = (parent / LORA_ADAPTER.config_file).read_text()
    exchange = ExchangeSpec.parse(spec)
    lora.save_adapter(encode_update(dict(state), parent, exchange, tmp_path / "old-state", 1),
                      config, tmp_path / "old", manifest())
    names = sorted(state)
    save_update(((n, state[n]) for n in names), {n: tuple(state[n].shape) for n in names},
                config, tmp_path / "new", manifest(), exchange, parent, tmp_path / "new-state",
                config_file=LORA_ADAPTER.config_file, tensor_file=LORA_ADAPTER.tensor_file)
    old, new = verify_checkpoint(tmp_path / "old"), verify_checkpoint(tmp_path / "new")
    assert old.tensors == new.tensors and sorted(old.files) == sorted(new.files)
    a = _tensors(tmp_path / "old" / LORA_ADAPTER.tensor_file)
    b = _tensors(tmp_path / "new" / LORA_ADAPTER.tensor_file)
    assert all(torch.equal(_bits(a[n]), _bits(b[n])) for n in a) and sorted(a) == sorted(b)
    if not exchange.quantized:
        assert old.files == new.files
    assert _residuals(tmp_path / "old-state").keys() == _residuals(tmp_path / "new-state").keys()
