"""The job spec's ``exchange`` section: what each site sends back every round."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from xffl.aggregator.codec import DEFAULT_BLOCK, MAX_BLOCK, MIN_BLOCK, QUANTIZED, Codec, valid_block

# the exchange's dtype names and the safetensors dtypes they are written as
EXCHANGE_DTYPES = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}
#: the validation context's key that says the job trains a LoRA adapter
LORA_CONTEXT = "lora"


class ExchangeSpec(BaseModel):
    """What each site sends back every round.

    ``weights``: its trained weights; ``delta``: their change from the round's global model
    (``w_site - w_parent``), which the coordinator adds back to the global it already holds.
    ``dtype``: the floating-point type they travel in (the global model stays in its own), or
    a blockwise quantization of a delta (int8, nf4, fp4: :mod:`xffl.aggregator.quantize`) in
    blocks of ``block_size`` elements with a float32 absmax each; ``error_feedback``: the site
    adds what quantization lost last round to this round's delta (default: on for 4 bits).
    """

    model_config = ConfigDict(extra="forbid")

    update: Literal["weights", "delta"] = Field(
        default="weights", description="weights, or delta: the change from the round's global")
    dtype: Literal["fp32", "bf16", "fp16", "int8", "nf4", "fp4"] = Field(
        default="fp32", description="the type the update's tensors travel in; int8, nf4 and "
        "fp4 quantize a delta blockwise (absmax scales)")
    block_size: int | None = Field(
        default=None, description=f"elements per quantization block, a power of two from "
        f"{MIN_BLOCK} to {MAX_BLOCK} (quantized dtypes; default {DEFAULT_BLOCK})")
    error_feedback: bool | None = Field(
        default=None, description="carry each round's quantization error into the next "
        "round's delta at the site (quantized dtypes; default: on for nf4 and fp4)")

    @field_validator("block_size")
    @classmethod
    def _block(cls, value: int | None) -> int | None:
        if value is None or valid_block(value):
            return value
        fix = f"use a power of two from {MIN_BLOCK} to {MAX_BLOCK}, e.g. {DEFAULT_BLOCK}"
        if value < 1 or value & (value - 1):
            raise ValueError(f"block size {value} does not divide the tensors into even "
                             f"blocks; {fix}")
        if value > MAX_BLOCK:
            raise ValueError(f"block size {value} is too large: one outlier would set the "
                             f"scale of {value} elements; {fix}")
        raise ValueError(f"block size {value} is too small: its float32 scale would add 4 "
                         f"bytes to every {value} elements; {fix}")

    @model_validator(mode="after")
    def _quantized_delta(self, info: ValidationInfo) -> ExchangeSpec:
        # a LoRA job (the job spec's loader says so in the context) sends its adapter's
        # weights, never a delta (xffl.jobs.spec.load): no quantized exchange fits it
        if self.quantized and (info.context or {}).get(LORA_CONTEXT):
            raise ValueError(f"dtype {self.dtype} quantizes a delta, but a LoRA job sends "
                             "its adapter's weights (already small); use `exchange: "
                             "{update: weights, dtype: bf16}` (half the bytes of fp32)")
        if self.quantized and self.update != "delta":
            raise ValueError(f"dtype {self.dtype} quantizes the change from the round's "
                             "global; set update: delta (weights cannot travel quantized): "
                             f"`exchange: {{update: delta, dtype: {self.dtype}}}`")
        if not self.quantized and self.block_size is not None:
            raise ValueError(f"block_size applies to int8, nf4 and fp4, not {self.dtype}; "
                             "remove it")
        if not self.quantized and self.error_feedback is not None:
            raise ValueError(f"error_feedback applies to int8, nf4 and fp4, not {self.dtype}; "
                             "remove it")
        return self

    @property
    def quantized(self) -> bool:
        """Whether the update's tensors are blockwise quantized (int8, nf4, fp4)."""
        return self.dtype in QUANTIZED

    @property
    def codec(self) -> Codec | None:
        """The quantized exchange's codec (None: not quantized)."""
        return Codec(self.dtype, self.block_size or DEFAULT_BLOCK) if self.quantized else None

    @property
    def feedback(self) -> bool:
        """Whether the site carries its quantization error into the next round."""
        if not self.quantized:
            return False
        return self.error_feedback if self.error_feedback is not None else self.dtype != "int8"

    @property
    def plain(self) -> bool:
        """Whether updates are fp32 weights, as the global model is (nothing to decode)."""
        return self.update == "weights" and self.dtype == "fp32"

    @property
    def safetensors_dtype(self) -> str:
        """The dtype string of the update's tensors in its safetensors header (a quantized
        exchange's codes)."""
        codec = self.codec
        return codec.code_dtype if codec is not None else EXCHANGE_DTYPES[self.dtype]

    def label(self) -> str:
        """``delta/bf16``-style name (``delta/nf4/128`` when quantized), as manifests,
        messages and the plan's tools show it."""
        codec = self.codec
        block = f"/{codec.block_size}" if codec is not None else ""
        return f"{self.update}/{self.dtype}{block}"

    @classmethod
    def parse(cls, label: str) -> ExchangeSpec:
        """The spec a :meth:`label` names (ValueError for anything else)."""
        update, _, rest = label.partition("/")
        dtype, _, block = rest.partition("/")
        fields: dict[str, object] = {"update": update, "dtype": dtype}
        if block:
            fields["block_size"] = block
        return cls.model_validate(fields)
