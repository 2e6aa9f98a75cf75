"""A hostile facility: called where a site's Python would run the launcher, it crafts an update.

The site profile's ``python`` points at this file (run by the venv's interpreter), so the
plan's train step ``<python> -m xffl.training.launch ... -- --job J --round R --model M ...
--out update`` runs it instead of training. The site's name (``h<NN>``) picks the attack from
VARIANTS: a well-formed update of the global model is written first, then altered the way a
compromised facility account could alter it; the site ``honest`` sends HONEST, well-formed
weights of its own. Each variant names the reason admission must give (a substring), or
None where the site delivers nothing at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Attack = Callable[[Path, dict[str, Any]], None]


def _manifest(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "manifest.json").read_text())
    return data


def _write_manifest(out: Path, data: dict[str, Any]) -> None:
    (out / "manifest.json").write_text(json.dumps(data))


def _edit(**changes: Any) -> Attack:
    def attack(out: Path, ctx: dict[str, Any]) -> None:
        data = _manifest(out)
        data.update(changes)
        _write_manifest(out, data)
    return attack


def _metric(name: str, value: float) -> Attack:
    def attack(out: Path, ctx: dict[str, Any]) -> None:
        data = _manifest(out)
        data["metrics"][name] = value
        (out / "manifest.json").write_text(json.dumps(data, allow_nan=True))
    return attack


def _validation(**values: float) -> Attack:
    """Report validation numbers (the job gives every hostile site 32 held-out sequences)."""
    def attack(out: Path, ctx: dict[str, Any]) -> None:
        data = _manifest(out)
        data["metrics"].update(values)
        _write_manifest(out, data)
    return attack


def _raw_manifest_field(field: str, literal: str) -> Attack:
    """Put a JSON literal no Python float can hold (e.g. a 400-digit integer) in a field."""
    def attack(out: Path, ctx: dict[str, Any]) -> None:
        data = _manifest(out)
        data[field] = "@@"
        (out / "manifest.json").write_text(json.dumps(data).replace('"@@"', literal))
    return attack


def _extra_file(out: Path, ctx: dict[str, Any]) -> None:
    (out / "evil.pth").write_text("import os; os.system('touch /tmp/xffl-owned')\n")


def _path_site(out: Path, ctx: dict[str, Any]) -> None:
    _extra_file(out, ctx)
    _edit(site="../../../../../../ESCAPED")(out, ctx)


def _subfolder(out: Path, ctx: dict[str, Any]) -> None:
    (out / "sub").mkdir()
    (out / "sub" / "evil.pth").write_text("x\n")


def _symlink_extra(out: Path, ctx: dict[str, Any]) -> None:
    os.symlink("/etc/passwd", out / "passwd")


def _symlinked_model(out: Path, ctx: dict[str, Any]) -> None:
    model = out / "model.safetensors"
    os.rename(model, out.parent / "elsewhere.safetensors")
    os.symlink(out.parent / "elsewhere.safetensors", model)


def _symlinked_manifest(out: Path, ctx: dict[str, Any]) -> None:
    real = out.parent / "manifest-elsewhere.json"
    os.rename(out / "manifest.json", real)
    os.symlink(real, out / "manifest.json")


def _listed_name(name: str) -> Attack:
    def attack(out: Path, ctx: dict[str, Any]) -> None:
        data = _manifest(out)
        data["files"][name] = "0" * 64
        _write_manifest(out, data)
    return attack


def _fifo_config(out: Path, ctx: dict[str, Any]) -> None:
    (out / "config.json").unlink()
    os.mkfifo(out / "config.json")


def _padded(name: str, size: int) -> Attack:
    def attack(out: Path, ctx: dict[str, Any]) -> None:
        if name == "manifest.json":
            data = _manifest(out)
            data["extra"]["padding"] = "x" * size
            _write_manifest(out, data)
        else:
            (out / name).write_text(json.dumps({"job_id": "1", "pad": "x" * size}))
    return attack


def _config_changed(out: Path, ctx: dict[str, Any]) -> None:
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (out / "config.json").write_text(json.dumps(config))
    _refresh_checksum(out, "config.json")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _refresh_checksum(out: Path, name: str) -> None:
    data = _manifest(out)
    data["files"][name] = _sha256(out / name)
    _write_manifest(out, data)


def _flip_bit(out: Path, ctx: dict[str, Any]) -> None:
    model = out / "model.safetensors"
    raw = bytearray(model.read_bytes())
    raw[-1] ^= 1
    model.write_bytes(bytes(raw))


def _rewrite_model(change: Callable[[dict[str, Any]], dict[str, Any]]) -> Attack:
    """Rewrite model.safetensors with changed tensors, then a consistent manifest."""
    def attack(out: Path, ctx: dict[str, Any]) -> None:
        from safetensors.numpy import load_file, save_file

        from xffl.aggregator.exchange import Manifest, finalize_manifest

        tensors = change(load_file(str(out / "model.safetensors")))
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        old = Manifest.model_validate(_manifest(out))
        (out / "manifest.json").unlink()
        finalize_manifest(out, old)
    return attack


def _nan_tensor(t: dict[str, Any]) -> dict[str, Any]:
    t["model.norm.weight"][0] = float("nan")
    return t


def _extra_tensor(t: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    t["model.backdoor.weight"] = np.zeros(4, dtype=np.float32)
    return t


def _missing_tensor(t: dict[str, Any]) -> dict[str, Any]:
    t.pop("model.norm.weight")
    return t


def _reshaped(t: dict[str, Any]) -> dict[str, Any]:
    t["model.norm.weight"] = t["model.norm.weight"].reshape(1, -1).copy()
    return t


def _truncated(out: Path, ctx: dict[str, Any]) -> None:
    model = out / "model.safetensors"
    model.write_bytes(model.read_bytes()[:200])
    _refresh_checksum(out, "model.safetensors")


def _header_bomb(out: Path, ctx: dict[str, Any]) -> None:
    model = out / "model.safetensors"
    model.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    _refresh_checksum(out, "model.safetensors")


def _sharded_escape(out: Path, ctx: dict[str, Any]) -> None:
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "../../escape.safetensors"}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "model.safetensors").unlink()
    data = _manifest(out)
    del data["files"]["model.safetensors"]
    _write_manifest(out, data)
    _refresh_checksum(out, "model.safetensors.index.json")


def _listed_file(name: str, text: str) -> Attack:
    """Add a file and list it in the manifest with its correct checksum."""
    def attack(out: Path, ctx: dict[str, Any]) -> None:
        (out / name).write_text(text)
        _refresh_checksum(out, name)
    return attack


def _many_metrics(out: Path, ctx: dict[str, Any]) -> None:
    """~9 MB of metric names of its own (the manifest stays under its 16 MiB cap): were they
    carried into the global's manifest, twice (the mean and the site's numbers), it would
    pass the cap and the round could not go on."""
    data = _manifest(out)
    data["metrics"].update({f"m{i:07d}" + "x" * 52: 1.0 for i in range(150_000)})
    _write_manifest(out, data)


def _weightless(attack: Attack) -> Attack:
    """An attack on an update that is then admitted, sent with 0 samples: it weighs nothing,
    so the global is still the honest update bit for bit."""
    def weightless(out: Path, ctx: dict[str, Any]) -> None:
        _edit(num_samples=0)(out, ctx)
        attack(out, ctx)
    return weightless


def _huge_record(out: Path, ctx: dict[str, Any]) -> None:
    """slurm_job.json (not listed: a side file) with integers no registry column holds."""
    (out / "slurm_job.json").write_text(json.dumps(
        {"job_id": "12", "queue_wait_s": 10**30, "run_s": -(10**40), "exit_code": 10**25}))


def _json_equal_config(out: Path, ctx: dict[str, Any]) -> None:
    """config.json equal to the global's as a JSON value, not as bytes (2.0 for 2): were its
    bytes written as the global's, a loader that wants integers would fail on it."""
    config = json.loads((out / "config.json").read_text())
    for key, value in config.items():
        if type(value) is int:
            config[key] = float(value)
    (out / "config.json").write_text(json.dumps(config, indent=4))
    _refresh_checksum(out, "config.json")


def _nothing(out: Path, ctx: dict[str, Any]) -> None:
    shutil.rmtree(out)


def _crash(out: Path, ctx: dict[str, Any]) -> None:
    print("xffl.training (rank 0): the facility's GPUs fell over", file=sys.stderr)
    sys.exit(3)


ADMITTED = "<admitted>"  # the update is admitted (what it tried is ignored or undone)
# attack, and a substring of the reason admission records (None: the site delivers nothing)
VARIANTS: list[tuple[Attack, str | None]] = [
    (_path_site, "'evil.pth' is not listed in the manifest"),
    (_extra_file, "'evil.pth' is not listed in the manifest"),
    (_subfolder, "'sub' is not a regular file"),
    (_symlink_extra, "'passwd'"),
    (_symlinked_model, "model.safetensors"),
    (_symlinked_manifest, "manifest.json"),
    (_listed_name("../escape"), "not a plain file name"),
    (_listed_name("/etc/passwd"), "not a plain file name"),
    (_fifo_config, "config.json"),
    (_padded("manifest.json", 17 << 20), "manifest.json"),
    (_padded("slurm_job.json", 100 << 10), "slurm_job.json is"),
    (_edit(num_samples=10**15), "num_samples is 1000000000000000, more than"),
    (_raw_manifest_field("num_samples", "9" * 400), "num_samples is a 400-digit number"),
    (_edit(num_tokens=10**18), "num_tokens is"),
    (_metric("loss", float("nan")), "metric 'loss' is nan"),
    (_metric("loss", float("inf")), "metric 'loss' is inf"),
    (_metric("loss", 3e38), "metric 'loss' is 3e+38"),
    (_edit(num_samples=-5), "invalid manifest"),
    # validation numbers steer the federated validation loss and the early stop
    (_validation(val_loss=0.1, val_loss_update=0.1, val_samples=10**6, val_tokens=16),
     "val_samples is 1000000, not a whole number from 1 to the 32"),
    (_validation(val_loss=0.1, val_loss_update=0.1, val_samples=2.5, val_tokens=16),
     "val_samples is 2.5"),
    (_validation(val_loss=-1.0, val_loss_update=0.1, val_samples=8, val_tokens=16),
     "'val_loss' is -1.0; a cross-entropy is never negative"),
    (_validation(val_loss=0.1), "it reports 'val_loss' without 'val_loss_update'"),
    # the federated validation loss weighs a site by its held-out targets in the loss: more
    # than its sequences hold (8 x seq_len 16), or than the budget's 32 sequences do, or no
    # count at all (which would leave its weight to a default)
    (_validation(val_loss=0.1, val_loss_update=0.1, val_samples=8, val_tokens=129),
     "val_tokens is 129, not a whole number from 0 to the 128 its 8 held-out sequences of "
     "16 targets hold"),
    (_validation(val_loss=0.1, val_loss_update=0.1, val_samples=32, val_tokens=10**9),
     "val_tokens is 1000000000, not a whole number from 0 to the 512"),
    (_validation(val_loss=0.1, val_loss_update=0.1, val_samples=8, val_tokens=2.5),
     "val_tokens is 2.5"),
    (_validation(val_loss=0.1, val_loss_update=0.1, val_samples=8),
     "it reports 'val_loss' without 'val_tokens'"),
    (_edit(run_id="another-run"), "run id 'another-run'"),
    (_edit(round=7), "round 7, expected round 1"),
    (_edit(parent="0" * 64), "trained from global 000000000000"),
    (_edit(site="honest"), "says it comes from site 'honest'"),
    (_edit(kind="global"), "kind is 'global'"),
    (_edit(format_version=1), "format version 1 (written by xffl "),
    (_config_changed, "config.json differs from the global model's"),
    (_flip_bit, "checksum mismatch for model.safetensors"),
    (_rewrite_model(_nan_tensor), "holds non-finite values"),
    (_rewrite_model(_extra_tensor), "unexpected tensor 'model.backdoor.weight'"),
    (_rewrite_model(_missing_tensor), "tensor 'model.norm.weight' is missing"),
    (_rewrite_model(_reshaped), "tensor 'model.norm.weight' has shape"),
    (_truncated, "model.safetensors"),
    (_header_bomb, "model.safetensors"),
    (_listed_name("nothere.bin"), "the manifest lists 'nothere.bin', which a model update "
                                  "never holds"),
    # what an update holds is decided by the global's kind, not by the update's manifest
    (_listed_file("evil.pth", "import os; os.system('touch /tmp/xffl-owned')\n"),
     "the manifest lists 'evil.pth', which a model update never holds"),
    (_listed_file("slurm_job.json", json.dumps({"job_id": "12"})),
     "the manifest lists 'slurm_job.json', which a model update never holds"),
    # one site never aborts a round that has its quorum (these sites have real data and no
    # data.max_samples: their counts are bounded by what their job can have read)
    (_many_metrics, "150000 metric(s) xffl does not know (first: 'm0000000xxx"),
    (_weightless(_huge_record), ADMITTED),
    (_weightless(_json_equal_config), ADMITTED),
    (_sharded_escape, "escape.safetensors"),
    (_nothing, None),
    (_crash, None),
]

# the honest site: every weight moved by 1/64 (the global's are far below 2^17, where float32
# would round that away), so the global it must become, bit for bit, is not the previous one
HONEST = _rewrite_model(lambda t: {name: w + w.dtype.type(1 / 64) for name, w in t.items()})


def _arg(argv: list[str], option: str) -> str:
    return argv[argv.index(option) + 1]


def honest_update(model: Path, out: Path, site: str, rnd: int, run_id: str) -> None:
    """A well-formed update of ``model`` (its weights unchanged) for ``site``, in the
    standard library alone: its manifest is what finalize_manifest writes for these files
    (the global's tensor index: the same model.safetensors), which
    tests/security/test_hostile_updates.py checks. xffl.aggregator.exchange's imports
    (pydantic, numpy) took 0.23 CPU-s of each hostile site's 0.3."""
    glob = _manifest(model)
    out.mkdir(parents=True)
    for name in ("model.safetensors", "config.json"):
        shutil.copyfile(model / name, out / name)
    # the global's identity (Manifest.digest: sha256 over its sorted file checksums)
    parent = hashlib.sha256("\n".join(
        f"{name}:{glob['files'][name]}" for name in sorted(glob["files"])).encode()).hexdigest()
    _write_manifest(out, {
        "format_version": glob["format_version"], "xffl_version": glob["xffl_version"],
        "kind": "update", "run_id": run_id, "round": rnd, "site": site, "num_samples": 4,
        "num_tokens": 32, "metrics": {"loss": 1.0},
        "files": {p.name: _sha256(p) for p in sorted(out.iterdir())},
        "tensors": glob["tensors"], "parent": parent, "created": time.time(), "extra": {}})


def main(argv: list[str]) -> int:
    """Act as ``python -m xffl.training.launch ... -- --job J --round R --model M --out O``
    (xffl submit's version probe, ``python -c SOURCE``, never reaches this script: the
    profile's wrapper answers it)."""
    job = json.loads(Path(_arg(argv, "--job")).read_text())
    site, rnd = job["site"], int(_arg(argv, "--round"))
    out = Path(_arg(argv, "--out"))
    honest_update(Path(_arg(argv, "--model")), out, site, rnd, job["run_id"])
    attack = HONEST if site == "honest" else VARIANTS[int(site[1:])][0]
    attack(out, {"site": site, "round": rnd})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
