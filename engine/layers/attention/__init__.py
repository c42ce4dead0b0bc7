"""The attention layer and its backends: `torch` (reference, CPU and CUDA) and `cutlass` (kiln's
kernels, CUDA).

layer.py: the Attention nn.Module of a decoder layer (q/k/v, rotary, the backend, o_proj);
base.py: the backend protocol and the metadata every backend reads; selector.py: which backend
serves a model; torch_backend.py and cutlass_backend.py: the two backends.
"""
