"""The per-site trainer: LLaMA-architecture model, token-shard data, DDP over gloo or NCCL."""
