"""Schemas of the training sections of a job spec (model, training loop, per-site data)."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from xffl.aggregator.exchange_spec import ExchangeSpec
from xffl.core.validation import PathText, StrictModel
from xffl.training.group_spec import LocalGroupsSpec
from xffl.training.round_spec import RoundCheckpointSpec as RoundCheckpointSpec

ENTRY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def check_entry_point(value: str) -> str:
    """ValueError unless ``value`` looks like ``package.module:function``."""
    if not ENTRY_RE.match(value):
        raise ValueError(f"{value!r} is not an entry point; write package.module:function")
    return value


#: a ``package.module:function`` field (:func:`check_entry_point`)
EntryPoint = Annotated[str, AfterValidator(check_entry_point)]


#: a folder holding one of these is a tokenizer transformers' AutoTokenizer loads
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class ModelSpec(StrictModel):
    """Which model to train: a transformers causal LM, from a checkpoint or a preset.

    ``init`` is a Hugging Face checkpoint folder (config.json and safetensors weights, of any
    family transformers builds) to start from; its config.json is the architecture. Without
    it, ``preset`` names a bundled config (no weights) and round 0 is seeded. Field names of
    ``overrides`` are the family's config.json names (hidden_size, ...). ``entry_point``
    (``package.module:function``) builds a model of the user's own from that config instead
    (see xffl.training.entry). ``tokenizer`` is what ``xffl export`` writes beside the model,
    so that the export is one folder transformers generates with.
    """

    preset: str = Field(default="tiny", description="bundled config (no weights): tiny, "
                        "llama2-7b, llama3.1-8b, qwen2.5-7b, mistral-7b, tiny-<family>")
    overrides: dict[str, int | float | bool] = Field(
        default_factory=dict,
        description="config.json fields replacing the preset's or init's (hidden_size, ...)")
    init: PathText | None = Field(
        default=None, description="Hugging Face checkpoint folder of round 0 on the "
        "coordinator, relative to the job file's folder (null: seeded weights of the preset)")
    entry_point: EntryPoint | None = Field(
        default=None, description="package.module:function building the model from the "
        "config; imported at the sites, on the coordinator only with --trust-entry-point")
    tokenizer: PathText | None = Field(
        default=None, description="the model's tokenizer folder on the coordinator "
        "(tokenizer.json, its config and chat template), relative to the job file's folder; "
        "xffl export writes it beside the model (null: model.init's own, if it has one)")

    @model_serializer(mode="wrap")
    def _what_applies(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Dumped (job.json, a site's job file): ``preset`` left out when ``init`` is set,
        since the init's config.json is the architecture then, not the (default) preset."""
        data: dict[str, Any] = handler(self)
        if self.init is not None:
            data.pop("preset", None)
        return data


_MODULE_RE = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")  # mlp.0: Sequential children


def matches_target(module: str, target: str) -> bool:
    """peft's rule for one name of a target list: ``module`` is it or ends with ``.TARGET``."""
    return module == target or module.endswith(f".{target}")


class LoraSpec(StrictModel):
    """A LoRA adapter (through peft) trained instead of the whole model.

    The base model (``model.init``, or the seeded weights) stays frozen at every site; only
    the adapter's tensors travel and are aggregated. ``target_modules`` are peft's: a module
    is adapted when its name is one of them or ends with ``.NAME``.
    """

    r: int = Field(default=8, description="rank of the update B·A (must be > 0)")
    alpha: float = Field(default=16.0, description="scaling numerator: B·A is scaled by "
                         "alpha / r (must be > 0)")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapter's "
                           "input while training")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], min_length=1,
        description="names of the nn.Linear modules to adapt (q_proj, v_proj, ...)")

    @field_validator("r")
    @classmethod
    def _rank(cls, value: int) -> int:
        if value <= 0:
            raise ValueError(f"r is {value}; the rank of a LoRA adapter must be at least 1 "
                             "(8 or 16 are usual)")
        return value

    @field_validator("alpha")
    @classmethod
    def _alpha(cls, value: float) -> float:
        if not value > 0 or not math.isfinite(value):
            raise ValueError(f"alpha is {value}; it scales the adapter by alpha / r and must be "
                             "a positive number (often 2 x r)")
        return value

    @field_validator("target_modules")
    @classmethod
    def _module_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not _MODULE_RE.match(name):
                raise ValueError(f"{name!r} is not a module name; write names such as q_proj "
                                 "or self_attn.q_proj")
        if len(set(value)) != len(value):
            raise ValueError("a module is named twice; list each once")
        return value

    def matches(self, module: str) -> bool:
        """Whether peft adapts ``module``: it matches one of the targets."""
        return any(matches_target(module, t) for t in self.target_modules)


class StopWhen(StrictModel):
    """Early stop: end the run when the federated validation loss stops improving.

    After each round, the federated validation loss of the global models measured so far is
    checked: when none of the last ``patience`` was lower than the best before them by more
    than ``min_delta``, no further round is run and the run completes with that reason.
    """

    metric: Literal["val_loss"] = Field(default="val_loss", description="what is watched: "
                                        "val_loss, the federated validation loss")
    patience: int = Field(default=3, ge=1, le=100_000,
                          description="rounds without improvement before stopping")
    min_delta: float = Field(default=0.0, ge=0, description="a smaller decrease does not count "
                             "as an improvement")


def _time_margin(value: object) -> object:
    """``auto``, or a number of seconds at least 0 (one clear error for anything else)."""
    if value == "auto" or (isinstance(value, int | float) and not isinstance(value, bool)
                           and math.isfinite(value) and value >= 0):
        return value
    raise ValueError("must be a number of seconds (0 or more) or auto")


TimeMargin = Annotated[float | Literal["auto"], BeforeValidator(_time_margin)]


class TrainingSpec(StrictModel):
    """The local training loop each site runs every round.

    A round lasts ``steps`` optimizer steps, or as many as ``tokens`` buys, and stops early
    (writing its checkpoint) when ``time_budget`` seconds are spent or when the SLURM job
    would otherwise hit its time limit (``time_margin`` seconds are kept for saving; ``auto``
    sizes them from the update's bytes: :func:`xffl.training.update_save.time_margin`). The
    learning-rate schedule runs over the whole job (rounds x steps), not per round.
    """

    steps: int = Field(default=20, ge=1, description="optimizer steps per round")
    tokens: int | None = Field(default=None, ge=1,
                               description="round budget in tokens per site (sets steps)")
    time_budget: float | None = Field(default=None, gt=0,
                                      description="seconds of training per round at most")
    time_margin: TimeMargin = Field(
        default="auto", description="seconds kept before the SLURM time limit to save the "
        "update; auto: 120 plus 8 per GB the update writes")
    batch_size: int = Field(default=8, ge=1, description="sequences per micro-batch per dp rank")
    grad_accum: int = Field(default=1, ge=1, description="micro-batches per optimizer step")
    seq_len: int = Field(default=64, ge=8, le=1 << 16, description="tokens per sequence")
    lr: float = Field(default=3e-3, gt=0, description="peak learning rate (AdamW)")
    schedule: Literal["constant", "cosine"] = Field(
        default="constant", description="learning rate over the whole job (rounds x steps)")
    warmup_steps: int = Field(default=0, ge=0, description="linear warm-up steps of the schedule")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1,
                                description="cosine: the last learning rate over lr")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    adam_eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float = Field(default=1.0, ge=0,
                             description="gradient norm clipping (0: none)")
    prox_mu: float = Field(default=0.0, ge=0, description="FedProx proximal term weight")
    tensor_parallel: int = Field(default=1, ge=1, le=1024, description="ranks splitting "
                                 "every layer Megatron-style; divides ranks and heads")
    data_parallel: Literal["auto", "ddp", "fsdp", "hsdp"] = Field(
        default="auto", description="across the dp groups; auto: FSDP2 when tp > 1 or the "
        "model has 1 B parameters or more (fewer when its fp32 weights, gradients and AdamW "
        "states, 16 B a parameter, exceed half of a GPU's memory), else DDP; hsdp: FSDP2 "
        "sharding inside groups of shard_group ranks, replicated across the groups")
    shard_group: int | None = Field(
        default=None, ge=1, le=1 << 20, description="data_parallel hsdp: data-parallel "
        "ranks of one shard group (consecutive ranks, e.g. one node's GPUs); with "
        "tensor_parallel a group spans shard_group x tensor_parallel ranks, which divides "
        "every site's ranks")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto", description="auto: bf16 on GPUs, fp32 on CPUs; bf16 under FSDP2 is "
        "its mixed-precision policy (bf16 compute, fp32 weights and gradient reductions), "
        "under DDP or one rank autocast")
    activation_checkpointing: bool | int = Field(
        default=False, description="recompute decoder layers' activations in the backward "
        "pass: true (every layer), k (every k-th layer) or false")
    compile: bool = Field(default=False, description="torch.compile each decoder layer")
    loss_chunk: int = Field(
        default=1024, ge=0, le=1 << 24, description="tokens per chunk of the LM head and "
        "cross-entropy: at most one chunk's fp32 logits (chunk x vocabulary x 4 bytes) are "
        "alive, recomputed in backward; 0: all tokens at once (full logits)")
    seed: int = Field(default=0, ge=0, description="seeds round 0's weights and the samplers")
    balance: Literal["none", "throughput"] = Field(
        default="none", description="throughput: from round 2, faster sites get more steps so "
        "that every site trains about as long as the slowest needs for its budget")
    balance_max: float = Field(default=4.0, ge=1.0, le=1000.0,
                               description="a balanced site runs at most this many times "
                               "its configured steps")
    update_fn: EntryPoint | None = Field(
        default=None, description="package.module:function (name, array, context) -> array: "
        "a local update computed tensor by tensor instead of SGD (xffl.training.streamed)")
    lora: LoraSpec | None = Field(
        default=None, description="train a LoRA adapter (peft) on the frozen model instead "
        "of the whole model; only the adapter travels")
    stop_when: StopWhen | None = Field(
        default=None, description="end the run early when the federated validation loss stops "
        "improving: {metric: val_loss, patience: N, min_delta: D}")
    checkpoint: RoundCheckpointSpec | None = Field(
        default=None, description="checkpoints inside a round at the site, which a retried "
        "job continues from: {every: STEPS or \"<N>m\", keep: N, chain: BOOL}")
    local_groups: LocalGroupsSpec | None = Field(
        default=None, description="federated groups of ranks inside a site: {groups: G, "
        "every: K}: each group trains on its share of every step's batch, and the groups "
        "average their weights every K steps and at the round's end")

    @field_validator("activation_checkpointing")
    @classmethod
    def _checkpoint_every(cls, value: bool | int) -> bool | int:
        if not isinstance(value, bool) and value < 1:
            raise ValueError(f"activation_checkpointing is {value}; write false (off), true "
                             "(every decoder layer) or a whole number k >= 1 (every k-th "
                             "decoder layer)")
        return value

    @property
    def checkpoint_every(self) -> int:
        """Every how many decoder layers activations are checkpointed (0: none)."""
        value = self.activation_checkpointing
        return int(value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _ddp_and_tp(self) -> TrainingSpec:
        if self.data_parallel == "hsdp" and self.shard_group is None:
            raise ValueError("data_parallel hsdp needs shard_group; add shard_group: the ranks "
                             "of one shard group (e.g. 4 for nodes of 4 GPUs)")
        if self.shard_group is not None and self.data_parallel != "hsdp":
            raise ValueError("shard_group applies to data_parallel: hsdp only; set "
                             "data_parallel: hsdp or remove shard_group")
        if self.data_parallel == "ddp" and self.tensor_parallel > 1:
            raise ValueError("data_parallel ddp does not combine with tensor_parallel > 1 in "
                             "torch; use data_parallel: fsdp (or auto)")
        if self.lora is not None and self.tensor_parallel > 1:
            raise ValueError("lora does not combine with tensor_parallel > 1 (peft's adapter "
                             "layers are not split Megatron-style); use tensor_parallel: 1 "
                             "(an adapter's base model is frozen, so data parallelism fits "
                             "more of it)")
        if self.lora is not None and self.update_fn is not None:
            raise ValueError("lora does not combine with update_fn (a streamed update "
                             "computes whole tensors); remove one of them")
        return self


class ValidationSpec(StrictModel):
    """A site's held-out data, never trained on and never moved: a fraction or a directory.

    ``fraction``: that share of the site's sequences is held out, the same ones every round
    (:func:`xffl.training.data.validation_indices`); ``path``: a token-shard directory of its
    own at the site (``xffl data prepare --validation-fraction`` writes one).
    """

    fraction: float | None = Field(default=None, gt=0, le=0.5, description="share of the "
                                   "site's sequences held out for validation (0 < f <= 0.5)")
    path: PathText | None = Field(default=None, description="a token-shard directory of held-out "
                             "data at the site (absolute, or under its workdir)")

    @model_validator(mode="after")
    def _one_source(self) -> ValidationSpec:
        if (self.fraction is None) == (self.path is None):
            raise ValueError("give fraction (a share of the training data held out) or path "
                             "(a directory of held-out data), one of the two")
        return self


class DataSpec(StrictModel):
    """Where a site's token shards live, on that site's filesystem (never transferred).

    ``path`` may be absolute or relative to the site profile's ``workdir``. With
    ``synthetic`` set, the shards are generated deterministically there on first use.
    """

    path: PathText = Field(description="token shards at the site (absolute, or under its workdir)")
    synthetic: Literal["alpha", "beta", "gamma", "delta"] | None = Field(
        default=None, description="generate this synthetic language at path on first use")
    synthetic_sequences: int = Field(default=512, ge=1,
                                     description="sequences of the synthetic corpus")
    max_samples: int | None = Field(
        default=None, ge=1, description="the most samples this site may report (its "
        "dataset's size): sites are weighed by their samples, so this bounds what a site's "
        "report can claim; synthetic data is bounded by synthetic_sequences")

    validation: ValidationSpec | None = Field(
        default=None, description="held-out data the site evaluates every global model and its "
        "own update on: {fraction: 0.1} or {path: DIR}")

    @property
    def declared_samples(self) -> int | None:
        """The dataset size the job declares for this site (None: not declared)."""
        if self.max_samples is not None:
            return self.max_samples
        return self.synthetic_sequences if self.synthetic is not None else None


class EvaluationSpec(StrictModel):
    """How much held-out data a site evaluates on in each round (its ``data.validation``).

    Every round a site evaluates the global model it receives, before training, and its own
    trained update, in the same job: at most ``batches`` batches of ``batch_size`` sequences
    (default: ``training.batch_size``), the same sequences every round. ``final``: whether
    every site also evaluates the final global model after the last round.
    """

    batches: int = Field(default=16, ge=1, le=1_000_000,
                         description="batches of held-out sequences evaluated per model")
    batch_size: int | None = Field(default=None, ge=1,
                                   description="sequences per batch (null: training.batch_size)")
    final: bool = Field(default=True,
                        description="after the last round every site evaluates the final global "
                        "model (steps of main.cwl; needs data.validation at every site, not LoRA)")

    def batch(self, training: TrainingSpec) -> int:
        """Sequences per evaluation batch: ``batch_size``, else the training batch size."""
        return self.batch_size or training.batch_size

    def sequences(self, training: TrainingSpec) -> int:
        """The most held-out sequences one evaluation reads."""
        return self.batches * self.batch(training)


class TrainJob(StrictModel):
    """What the trainer receives for one site and round (written to a JSON file by the plan)."""

    run_id: str
    site: str
    rounds: int = Field(default=1, ge=1, description="rounds of the job (for the LR schedule)")
    model: ModelSpec
    training: TrainingSpec
    data: DataSpec
    exchange: ExchangeSpec = Field(default_factory=ExchangeSpec)
    freeze_a: bool = Field(default=False, description="LoRA: keep every A at the global's "
                           "(aggregation.lora: freeze_a)")
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)


def round_steps(spec: TrainingSpec, dp_size: int) -> int:
    """Optimizer steps in one round: ``steps``, or the fewest that consume ``tokens``."""
    if spec.tokens is None:
        return spec.steps
    per_step = spec.batch_size * spec.grad_accum * spec.seq_len * dp_size
    return max(1, math.ceil(spec.tokens / per_step))
