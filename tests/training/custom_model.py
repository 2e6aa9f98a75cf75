"""A user's own model for the entry-point tests: embeddings, a GELU MLP, a head."""

from __future__ import annotations

from torch import Tensor, nn

from xffl.training.arch import ModelConfig


class TinyMLPLM(nn.Module):
    """Predicts the next token from the current one only (a neural bigram model)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 2 * config.hidden_size),
                                 nn.GELU(), nn.Linear(2 * config.hidden_size, config.hidden_size))
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Logits (batch, seq, vocab)."""
        x = self.embed(input_ids)
        return self.head(x + self.mlp(x))


def build(config: ModelConfig) -> nn.Module:
    """The entry point: ``tests.training.custom_model:build``."""
    return TinyMLPLM(config)


def not_a_module(config: ModelConfig) -> object:
    """A broken entry point."""
    return {"hidden": config.hidden_size}
