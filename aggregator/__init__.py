"""The coordinator side: the checkpoint exchange format, streaming aggregation, strategies."""
