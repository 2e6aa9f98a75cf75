"""A run's global model written out for other tools: the checkpoint's own files without xffl's
manifest and server state, or a LoRA adapter merged into its base (:mod:`xffl.aggregator.merge`),
with the job's tokenizer and chat template beside it, so that transformers'
``AutoTokenizer`` / ``AutoModelForCausalLM`` and ``generate`` work on the folder alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from xffl.aggregator.exchange import read_manifest, staged_dir
from xffl.aggregator.kinds import kind_of
from xffl.aggregator.merge import merge_adapter
from xffl.core.errors import InvalidInput
from xffl.core.layout import RunLayout
from xffl.jobs.spec.schema import JobSpec
from xffl.training.config import TOKENIZER_FILES


def tokenizer_source(layout: RunLayout) -> Path | None:
    """The run's tokenizer folder: its job's ``model.tokenizer``, else ``model.init`` when
    that holds a tokenizer, else None."""
    model = JobSpec.of_run(layout.root).model
    if model.tokenizer is not None:
        return Path(model.tokenizer)
    if model.init is not None and any((Path(model.init) / n).is_file()
                                      for n in TOKENIZER_FILES):
        return Path(model.init)
    return None


def _load_tokenizer(folder: Path) -> Any:
    """transformers' tokenizer of ``folder`` (InvalidInput naming it if none loads)."""
    from transformers import AutoTokenizer

    if not folder.is_dir():
        raise InvalidInput(f"{folder}: the job's tokenizer folder (model.tokenizer or "
                           "model.init) is gone; restore it, or export without it by "
                           "--no-tokenizer.")
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, ...
        raise InvalidInput(f"{folder}: no tokenizer transformers can load ({exc}); fix the "
                           "job's model.tokenizer, or export without it by --no-tokenizer.") \
            from exc


def export_global(layout: RunLayout, rnd: int, out: Path, *, merge: bool = False,
                  max_shard_bytes: int | None = None,
                  tokenizer: Path | None = None) -> list[str]:
    """Write the global model after round ``rnd`` into ``out``; return the files written.

    ``merge``: a LoRA run's adapter folded into its base (``rounds/0/base``). ``tokenizer``:
    a folder whose tokenizer (and chat template) is saved beside the model by transformers'
    ``save_pretrained``. ``out`` appears only when complete.
    """
    source = layout.global_dir(rnd)
    if merge and not kind_of(source).adapter:
        raise InvalidInput("--merge folds a LoRA adapter into its base, but this run trains "
                           "the whole model; leave --merge out.")
    tok = None if tokenizer is None else _load_tokenizer(tokenizer)  # before any writing
    with staged_dir(Path(out)) as tmp:
        if merge:  # (its own staging folder, renamed over the empty tmp)
            merge_adapter(layout.base_model, source, tmp, max_shard_bytes)
        else:  # the model's files (tensors, index, config), not the server state beside them
            for name in read_manifest(source).files:
                if not name.startswith("server_"):
                    shutil.copyfile(source / name, tmp / name)
        if tok is not None:
            tok.save_pretrained(str(tmp))
        return sorted(p.name for p in tmp.iterdir())
