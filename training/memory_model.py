"""Peak accelerator memory per rank of a site's training, estimated from the config and layout.

The estimate models the site trainer the way torchtitan trains (docs/large-models.md, "The
memory model", derives every term): FSDP2 with a bf16 param / fp32 reduce mixed-precision
policy (fp32 master weights, gradients and AdamW states sharded over dp: 16 B per parameter
/ dp; the root unit and about two decoder layers unsharded in bf16 at a time; a reduce-scatter
every micro-batch), DDP (16 B per parameter replicated plus its gradient buckets and bf16
autocast copies), tensor parallelism (decoder layers / tp; embedding and head replicated),
LoRA (a bf16 frozen base, an fp32 adapter), activation checkpointing (off, every layer, or
every k-th), the cross-entropy's logits (whole or in chunks of ``training.loss_chunk``
tokens), and a fixed CUDA context / NCCL / allocator reserve. With ``gpu=False`` the same
model describes an fp32 run on CPUs (no bf16 copies, no CUDA context): what the tests measure.

No torch at import time: ``xffl validate`` stays fast; only :func:`model_parts` builds the
model on the meta device (to count parameters by part, exactly, for any family).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from xffl.training.arch import ModelConfig
    from xffl.training.config import LoraSpec, TrainingSpec

GIB = 1 << 30
#: ``data_parallel: auto`` shards with FSDP2 from this many parameters, or from fewer where
#: DDP's replicated 16 B/parameter (fp32 weights, gradients, two AdamW moments) exceed half
#: of the GPU's memory: the trainer's rule (:func:`xffl.training.parallelize.parallelize`)
FSDP_PARAMS = 1_000_000_000
TRAINING_BYTES_PER_PARAM = 16
#: CUDA context (~0.5-1 GiB with cuBLAS/cuDNN workspaces), NCCL's buffers and channels
#: (~0.5-1 GiB per communicator), allocator rounding/fragmentation with expandable segments
CUDA_RESERVE_BYTES = 3 * GIB
#: what "fits" means: the estimate at most this share of the card's memory (10 % headroom)
FIT_SHARE = 0.9

DataParallel = Literal["ddp", "fsdp", "none"]


@dataclass(frozen=True)
class ModelParts:
    """Parameter counts of a causal LM by part, and the widths activations depend on."""

    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    embedding: int  # input embedding parameters
    head: int  # LM head parameters (0: tied to the embedding)
    layer: int  # parameters of one decoder layer
    other: int  # the rest outside the layers (final norm, ...)
    largest: int = 0  # elements of the largest parameter tensor
    lora_layer: int = 0  # adapter parameters in one decoder layer
    lora_other: int = 0  # adapter parameters outside the layers

    @property
    def root(self) -> int:
        """Parameters of FSDP2's root unit: embedding, head and final norm."""
        return self.embedding + self.head + self.other

    @property
    def total(self) -> int:
        """All parameters of the base model (a tied head counted once)."""
        return self.root + self.layers * self.layer

    @property
    def adapter(self) -> int:
        """All LoRA adapter parameters."""
        return self.layers * self.lora_layer + self.lora_other


#: families whose parameters :func:`_llama_linears` counts from config.json alone (no torch)
LLAMA_LIKE = ("llama", "mistral")


#: the config.json fields the LLaMA-style count needs (without one, the meta model counts)
LLAMA_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "vocab_size")


def _llama_widths(f: dict[str, Any]) -> tuple[int, int, int]:
    """(hidden, q width, kv width) from config.json fields, with transformers' defaults."""
    heads = int(f["num_attention_heads"])
    head_dim = int(f.get("head_dim") or int(f["hidden_size"]) // heads)
    return int(f["hidden_size"]), heads * head_dim, int(
        f.get("num_key_value_heads") or heads) * head_dim


def _llama_linears(f: dict[str, Any]) -> dict[str, tuple[int, int, bool]]:
    """A LLaMA-style layer's linear modules: name -> (in, out, bias), from config.json."""
    h, q, kv = _llama_widths(f)
    inter = int(f["intermediate_size"])
    attn_bias = bool(f.get("attention_bias", False))  # transformers' defaults
    mlp_bias = bool(f.get("mlp_bias", False))
    return {"self_attn.q_proj": (h, q, attn_bias), "self_attn.k_proj": (h, kv, attn_bias),
            "self_attn.v_proj": (h, kv, attn_bias), "self_attn.o_proj": (q, h, attn_bias),
            "mlp.gate_proj": (h, inter, mlp_bias), "mlp.up_proj": (h, inter, mlp_bias),
            "mlp.down_proj": (inter, h, mlp_bias)}


def _llama_parts(f: dict[str, Any], lora: LoraSpec | None) -> ModelParts:
    """:func:`model_parts` of a LLaMA-style family from its config.json fields alone (what
    the meta model counts: tests/training/test_memory_model.py compares them)."""
    h, q, kv = _llama_widths(f)
    vocab, heads = int(f["vocab_size"]), int(f["num_attention_heads"])
    linears = _llama_linears(f)
    layer = 2 * h + sum(i * o + (o if b else 0) for i, o, b in linears.values())  # + 2 norms
    head = 0 if f.get("tie_word_embeddings", False) else vocab * h
    lora_layer = sum(lora.r * (i + o) for name, (i, o, _) in linears.items()
                     if lora.matches(f"model.layers.0.{name}")) if lora else 0
    lora_other = lora.r * (h + vocab) if lora and head and lora.matches("lm_head") else 0
    largest = max([vocab * h, *(i * o for i, o, _ in linears.values())])
    return ModelParts(
        hidden=h, layers=int(f["num_hidden_layers"]), vocab=vocab, heads=heads,
        kv_heads=kv // (q // heads), head_dim=q // heads,
        intermediate=int(f["intermediate_size"]), embedding=vocab * h, head=head,
        layer=layer, other=h, largest=largest, lora_layer=lora_layer, lora_other=lora_other)


def model_parts(config: ModelConfig, lora: LoraSpec | None = None) -> ModelParts:
    """Count the parameters of ``config``'s model by part: from config.json for LLaMA-style
    families, else from the model built on the meta device (torch and transformers)."""
    if config.model_type in LLAMA_LIKE and all(k in config.fields for k in LLAMA_FIELDS):
        return _llama_parts(config.fields, lora)
    from torch import nn

    from xffl.training.model import meta_model

    model = meta_model(config)
    counts = {"embedding": 0, "head": 0, "other": 0}
    layer_total = 0
    largest = 0
    for name, param in model.named_parameters():  # a tied head is listed once, as embedding
        largest = max(largest, param.numel())
        if ".layers." in f".{name}":
            layer_total += param.numel()
        elif "embed_tokens" in name:
            counts["embedding"] += param.numel()
        elif name.startswith("lm_head"):
            counts["head"] += param.numel()
        else:
            counts["other"] += param.numel()
    lora_layer = lora_other = 0
    if lora is not None:
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and lora.matches(name):
                adapter = lora.r * (module.in_features + module.out_features)
                if ".layers." in f".{name}":
                    lora_layer += adapter
                else:
                    lora_other += adapter
    layers = max(config.num_hidden_layers, 1)
    return ModelParts(
        hidden=config.hidden_size, layers=config.num_hidden_layers, vocab=config.vocab_size,
        heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim, intermediate=config.intermediate_size,
        embedding=counts["embedding"], head=counts["head"], other=counts["other"],
        layer=layer_total // layers, largest=largest, lora_layer=lora_layer // layers,
        lora_other=lora_other)


@dataclass(frozen=True)
class Layout:
    """How one site trains: the parallel layout, precision and per-micro-batch shape."""

    dp: int = 1
    tp: int = 1
    mode: DataParallel = "fsdp"  # "none": one process, no wrapper
    gpu: bool = True  # the CUDA reserve and foreach AdamW; False: a CPU run
    bf16: bool = True  # bf16 compute (FSDP2's param dtype, autocast under DDP); False: fp32
    batch: int = 1
    seq: int = 2048
    grad_accum: int = 1
    ac_every: int = 0  # 0: no activation checkpointing; k: every k-th decoder layer
    loss_chunk: int = 0  # tokens per cross-entropy chunk; 0: the whole micro-batch
    lora: bool = False
    shard: int = 0  # ranks a parameter is sharded over under FSDP2 (0: dp; HSDP: a group)


@dataclass(frozen=True)
class Estimate:
    """The estimated peak bytes per rank, the phase it occurs in and the terms adding to it."""

    peak: int
    phase: str
    terms: dict[str, int] = field(default_factory=dict)

    @property
    def gib(self) -> float:
        """The peak in GiB."""
        return self.peak / GIB


def checkpoint_every(value: bool | int | None) -> int:
    """``training.activation_checkpointing`` as k (0: off): false, true (every layer) or k."""
    if value is None or value is False:
        return 0
    return 1 if value is True else max(int(value), 0)


def fsdp_threshold(memory: int | None) -> int:
    """Parameters from which ``auto`` shards: 1 B, or fewer where 16 B/parameter exceed half
    of ``memory`` (a GPU's bytes; None: not a GPU)."""
    if memory is None:
        return FSDP_PARAMS
    return min(FSDP_PARAMS, memory // (2 * TRAINING_BYTES_PER_PARAM))


def resolve_data_parallel(requested: str, tp: int, params: int, ranks: int,
                          memory: int | None = None) -> DataParallel:
    """The wrapper the trainer uses: ``auto`` is FSDP2 with tp > 1 or from
    :func:`fsdp_threshold` parameters of a GPU of ``memory`` bytes."""
    if ranks <= 1 and tp == 1:
        return "none"  # world 1: no process group, the model as it is
    if requested == "auto":
        return "fsdp" if tp > 1 or params >= fsdp_threshold(memory) else "ddp"
    return "ddp" if requested == "ddp" else "fsdp"


def site_layout(spec: TrainingSpec, ranks: int, parts: ModelParts, *, gpu: bool = True,
                data_parallel: str | None = None, gpu_memory: int | None = None) -> Layout:
    """The Layout of a site running ``spec`` on ``ranks`` ranks (``data_parallel`` overrides;
    ``gpu_memory``: one GPU's bytes, which ``auto``'s choice depends on); under
    ``local_groups`` a rank's memory is that of a site of one group's ranks."""
    if spec.local_groups is not None:
        ranks = spec.local_groups.ranks_per_group(ranks) or ranks
    tp = spec.tensor_parallel
    mode = resolve_data_parallel(data_parallel or spec.data_parallel, tp, parts.total, ranks,
                                 gpu_memory)
    bf16 = spec.precision == "bf16" or (spec.precision == "auto" and gpu)
    return Layout(dp=max(ranks // tp, 1), tp=tp, mode=mode, gpu=gpu, bf16=bf16,
                  batch=spec.batch_size,
                  seq=spec.seq_len, grad_accum=spec.grad_accum,
                  ac_every=checkpoint_every(spec.activation_checkpointing),
                  loss_chunk=spec.loss_chunk, lora=spec.lora is not None,
                  shard=(spec.shard_group or 0)
                  if (data_parallel or spec.data_parallel) == "hsdp" else 0)


def layer_activation_bytes(parts: ModelParts, layout: Layout) -> int:
    """Bytes one decoder layer saves for its backward per token (SDPA: no score matrix).

    Per token, a LLaMA-style layer saves: each RMSNorm's input and output (2h); the rotated
    q and k, v, the attention output and its contiguous copy into o_proj (3q + 2kv: the
    rotary products multiply by cos/sin, which need no gradient, so the projections' own
    outputs are not kept); the MLP's gate, SiLU, up and product (4I). Korthikanti et al.'s
    34sbh counts the same pieces for GPT (plus dropout masks and the s x s scores SDPA's
    flash kernels do not keep). In fp32: 4 bytes each. In bf16 the norms upcast: an fp32
    input (4h) and a bf16 output (2h) each. Under tp, the attention and MLP pieces are split
    over the tp ranks, the norms are not (no sequence parallelism).
    """
    h, I = parts.hidden, parts.intermediate  # noqa: E741 (the MLP width, as in the papers)
    q, kv = parts.heads * parts.head_dim, parts.kv_heads * parts.head_dim
    split = (3 * q + 2 * kv + 4 * I) // layout.tp
    return (12 * h + 2 * split) if layout.bf16 else 4 * (4 * h + split)


def activation_terms(parts: ModelParts, layout: Layout) -> dict[str, int]:
    """Saved activations at the end of the forward, and the backward's one-layer working set."""
    tokens = layout.batch * layout.seq
    act = 2 if layout.bf16 else 4  # bytes of the residual stream
    full = layer_activation_bytes(parts, layout) * tokens
    k = layout.ac_every
    checkpointed = parts.layers // k if k else 0  # torchtitan: layers k, 2k, ... (1-based)
    saved = (checkpointed * act * parts.hidden * tokens  # each checkpoint's input
             + (parts.layers - checkpointed) * full
             + (6 if layout.bf16 else 8) * parts.hidden * tokens)  # final norm (fp32 in, out)
    return {"activations": saved,
            # the layer in backward: its recompute (checkpointed) or, without checkpoints, the
            # top layer's gradient transients (lower layers reuse what the upper ones freed)
            "layer_backward": full}


def logits_bytes(parts: ModelParts, layout: Layout) -> int:
    """The cross-entropy's peak: 12 bytes per token per vocabulary entry, in its backward.

    The loss takes the logits to fp32 (bf16 logits 2 + fp32 copy 4 + saved log-softmax 4 in
    the forward); the backward then holds the saved log-softmax (4), nll's dense gradient (4)
    and log-softmax's input gradient (4) at once: 12 bytes, in fp32 and in bf16 alike. The
    LM head is not split under tp (no loss parallel): every tp rank computes all V logits.
    """
    tokens = layout.batch * layout.seq
    if layout.loss_chunk > 0:
        tokens = min(tokens, layout.loss_chunk)
    return 12 * tokens * parts.vocab


def state_terms(parts: ModelParts, layout: Layout) -> dict[str, int]:
    """Weights, gradients and AdamW states a rank keeps, and what each wrapper adds."""
    layer_params = parts.layers * parts.layer // layout.tp
    local = layer_params + parts.root  # embedding, head and norm are replicated over tp
    shard = (layout.shard or layout.dp) if layout.mode == "fsdp" else 1
    trained = (parts.adapter if layout.lora else local) // shard
    base = 0
    if layout.lora:  # frozen base: bf16 on GPUs (2 B), fp32 on CPUs, sharded under FSDP2
        base = (2 if layout.bf16 else 4) * local // shard
    half = 2 if layout.bf16 else 4  # unsharded compute copies: bf16 under mixed precision
    # AdamW's sqrt(exp_avg_sq) temporary: for all parameters at once in the foreach
    # implementation torch picks on GPUs (0 with fused=True, counted anyway), tensor by
    # tensor in the single-tensor one it picks on CPUs
    step_temp = trained if layout.gpu or layout.lora else min(trained, parts.largest)
    terms = {"weights": base + 4 * trained, "adam": 8 * trained, "grads": 4 * trained,
             "optimizer_step": 4 * step_temp}
    if layout.mode == "fsdp":
        terms["unsharded_root"] = half * parts.root
        terms["unsharded_layers"] = 2 * half * parts.layer // layout.tp  # current + prefetch
        # backward: a layer's unsharded grads (bf16) copied into an fp32 reduce-scatter buffer;
        # the root's (head first, embedding last) are held until the end of the backward
        grad_unit = 0 if layout.lora else half + 4
        terms["reduce_layer"] = grad_unit * parts.layer // layout.tp
        terms["reduce_root"] = grad_unit * parts.root
        terms["head_grad"] = 0 if layout.lora else half * parts.head
    else:  # DDP, or one process: fp32 weights and bf16 from autocast
        # DDP (gradient_as_bucket_view): the gradients are views into its buckets, so the
        # buckets add nothing beyond the gradients counted above
        if layout.bf16 and not layout.lora:  # autocast's bf16 copies of the fp32 weights, saved
            # for the backward's matmuls (a LoRA base is bf16 already)
            terms["autocast_copies"] = 2 * (local - parts.embedding)
    if layout.gpu:
        terms["cuda_reserve"] = CUDA_RESERVE_BYTES
    return terms


def estimate(parts: ModelParts, layout: Layout) -> Estimate:
    """The peak bytes per rank: the largest of the forward/backward, the backward's end and
    the optimizer step, each the persistent state plus what that phase holds."""
    s = state_terms(parts, layout)
    a = activation_terms(parts, layout)
    logits = logits_bytes(parts, layout)
    fsdp = {k: s.get(k, 0) for k in ("unsharded_root", "unsharded_layers", "reduce_layer",
                                     "reduce_root", "head_grad")}
    fixed = s["weights"] + s["adam"] + s.get("ddp_buckets", 0) + s.get("cuda_reserve", 0)
    # gradients of earlier micro-batches: FSDP2 keeps them sharded (reduce-scatter each one)
    held = s["grads"] if layout.grad_accum > 1 else 0
    hold_in_backward = fsdp["head_grad"] if layout.mode == "fsdp" else (
        0 if layout.lora else 4 * parts.head)
    during = (fixed + held + fsdp["unsharded_root"] + fsdp["unsharded_layers"]
              + s.get("autocast_copies", 0) + a["activations"]
              + max(logits, a["layer_backward"] + fsdp["reduce_layer"] + hold_in_backward))
    end = fixed + s["grads"] + fsdp["unsharded_root"] + fsdp["reduce_root"]
    step = fixed + s["grads"] + s["optimizer_step"]
    phases = {"forward/backward": during, "end of backward": end, "optimizer step": step}
    phase = max(phases, key=lambda p: phases[p])
    return Estimate(peak=phases[phase], phase=phase,
                    terms={**s, **a, "logits": logits, **{f"phase:{k}": v
                                                          for k, v in phases.items()}})
