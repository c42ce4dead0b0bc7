"""Filling a model's weights: safetensors checkpoints (single or sharded), GGUF files, quantised checkpoints,
dummy weights, with load progress."""
