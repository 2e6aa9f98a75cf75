"""What kind of model a run trains: the whole model, or a LoRA adapter of a frozen base.

One object per kind knows its file names (the tensor file, the config file), whether its
tensors may be split into Hugging Face shards, and what an update of that kind may contain.
The coordinator decides the kind of a round's updates by the global it holds
(:func:`kind_of`), never by what an update or its manifest says; the trainer, admission,
the aggregators and export ask the kind rather than testing for LoRA themselves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from xffl.aggregator.shards import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    CONFIG_FILE,
    INDEX_FILE,
    MODEL_FILE,
)
from xffl.core.errors import CheckpointError
from xffl.core.words import quoted

SHARD_NAME = re.compile(r"^model-[0-9]{5}-of-[0-9]{5}\.safetensors$")


@dataclass(frozen=True)
class ModelKind:
    """A kind of trained model: its checkpoint's file names and what an update may hold."""

    adapter: bool  # a LoRA adapter (peft's file names), not the whole model
    tensor_file: str  # the one tensor file (a whole model may be sharded instead)
    config_file: str  # beside the tensors: the model's config, or the adapter's
    update_name: str  # what an update of this kind is called in a refusal

    @property
    def shardable(self) -> bool:
        """Whether its tensors may be Hugging Face shards with an index json."""
        return not self.adapter

    def check_listed(self, names: set[str]) -> None:
        """An update's manifest lists the tensor files of this kind, and nothing else but
        its config; raises CheckpointError naming the first file that does not belong."""
        if self.adapter:
            if ADAPTER_FILE not in names or MODEL_FILE in names or INDEX_FILE in names:
                raise CheckpointError(f"a LoRA adapter is expected ({ADAPTER_FILE}, not a "
                                      "whole model)")
            allowed = {ADAPTER_FILE, ADAPTER_CONFIG_FILE}
        else:
            if ADAPTER_FILE in names:
                raise CheckpointError("the job trains the whole model, not a LoRA adapter")
            if MODEL_FILE not in names and INDEX_FILE not in names:
                raise CheckpointError(f"the manifest lists neither {MODEL_FILE} nor "
                                      f"{INDEX_FILE}")
            if MODEL_FILE in names and INDEX_FILE in names:
                raise CheckpointError(f"the manifest lists both {MODEL_FILE} and {INDEX_FILE}")
            allowed = {MODEL_FILE, CONFIG_FILE} if MODEL_FILE in names else {
                INDEX_FILE, CONFIG_FILE, *(n for n in names if SHARD_NAME.fullmatch(n))}
        extra = sorted(names - allowed)
        if extra:
            raise CheckpointError(f"the manifest lists {quoted(extra[0])}, which "
                                  f"{self.update_name} never holds")


WHOLE_MODEL = ModelKind(adapter=False, tensor_file=MODEL_FILE, config_file=CONFIG_FILE,
                        update_name="a model update")
LORA_ADAPTER = ModelKind(adapter=True, tensor_file=ADAPTER_FILE,
                         config_file=ADAPTER_CONFIG_FILE, update_name="a LoRA adapter update")


def kind_for(adapter: bool) -> ModelKind:
    """The kind of a run that trains a LoRA adapter (``adapter``) or the whole model."""
    return LORA_ADAPTER if adapter else WHOLE_MODEL


def kind_of(directory: Path) -> ModelKind:
    """The kind of the checkpoint in ``directory``: an adapter when it holds peft's tensor
    file, else a whole model."""
    return kind_for((Path(directory) / ADAPTER_FILE).is_file())

