"""Model building blocks that know nothing of models (engine/models/ assembles them):

- layernorm.py: RMSNorm; rotary.py: rotary embeddings (tables, Llama's and GLM's rotations);
- linear.py: Linear (dense, quantised or LoRA-adapted; its post-load weight work on the CPU) and
  the row-parallel choice for o_proj / down_proj;
- attention/: the Attention layer (layer.py) and the backends it calls; mlp.py: the gated MLP;
  sparse_moe.py: the mixture-of-experts block;
- quant/: quantised linear layers and experts; kv_cache.py: the KV cache tensors and their fp8
  scales; forward_context.py: a step's feature inputs.
"""
