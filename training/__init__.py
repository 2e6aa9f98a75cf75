"""The per-site trainer: a transformers causal LM on token shards, DDP/FSDP2/tp, gloo or NCCL."""
