"""Model building blocks that know nothing of models: attention backends, the KV cache tensors and their fp8 scales, quantised linear layers and experts."""
