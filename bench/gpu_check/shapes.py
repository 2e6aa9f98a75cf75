"""The shapes the one-GPU check trains: real sizes on a GPU, tiny ones in the CPU dry run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Llama-3.2-1B's shape on Llama 3.1's preset (its 128K vocabulary and rope): 1.24 B, tied
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True,
            "max_position_embeddings": 8192}
# ~3 M parameters on a byte vocabulary (bench/train_throughput's "small")
SMALL = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024}


@dataclass(frozen=True)
class Shape:
    """One model and the training a step runs on it."""

    preset: str
    overrides: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 64
    batch_size: int = 2
    grad_accum: int = 1
    steps: int = 4
    lr: float = 1e-3

    def model(self) -> dict[str, Any]:
        """The job spec's ``model`` section."""
        return {"preset": self.preset, "overrides": dict(self.overrides)}

    def training(self, **extra: Any) -> dict[str, Any]:
        """The job spec's ``training`` section (``extra`` fields added)."""
        return {"steps": self.steps, "seq_len": self.seq_len, "batch_size": self.batch_size,
                "grad_accum": self.grad_accum, "lr": self.lr, "warmup_steps": 2,
                "time_margin": 0, **extra}

    def sequences(self) -> int:
        """Synthetic sequences enough for one round without a second epoch."""
        return self.batch_size * self.grad_accum * self.steps + 8


# full: what the check runs on one H100/H200; dry: the same steps at CPU sizes
SHAPES: dict[str, dict[str, Shape]] = {
    "full": {
        "dense": Shape("llama3.1-8b", LLAMA_1B, seq_len=2048, batch_size=4, grad_accum=2,
                       steps=30, lr=1e-3),
        "small": Shape("tiny", SMALL, seq_len=256, batch_size=8, steps=20, lr=1e-3),
        "lora": Shape("llama3.1-8b", {}, seq_len=2048, batch_size=2, steps=12, lr=1e-4),
    },
    # the dry run: the fewest tokens that still take every path (gradient accumulation in the
    # dense round, a few optimizer steps in each); its cost is the processes' start-up
    "dry": {
        "dense": Shape("tiny", {}, seq_len=32, batch_size=2, grad_accum=2, steps=3, lr=1e-2),
        "small": Shape("tiny-test", {}, seq_len=32, batch_size=2, steps=3, lr=1e-3),
        "lora": Shape("tiny", {}, seq_len=32, batch_size=2, steps=2, lr=1e-3),
    },
}

# what each mode asks of the dense round's loss: on the GPU 30 steps of a 128K-vocabulary
# model from its uniform loss (ln 128256 = 11.8) onto bytes fall by far more than 1; the dry
# run's 3 steps of a byte model from ln 256 = 5.5 fall by more than a few tenths (1.1 measured)
LOSS_DROP = {"full": 1.0, "dry": 0.1}
