"""Build-time half of kiln, in two rooms:

- `compiler.kernels`: what builds and loads kernels — the CUTLASS/CuTe CUDA kernels built ahead of
  time with nvcc (manifest, build cache, cuda-python loader), the C++ CPU kernels built with
  torch.utils.cpp_extension, and the `kiln::` custom ops that launch them (and their torch
  references);
- `compiler.compilation`: what compiles graphs — the model forward under torch.compile and decode
  steps captured as CUDA graphs.

Never imports `engine`: everything here takes tensors and plain values.
"""
