"""kiln's kernels and the custom ops that launch them.

CUDA (ahead of time): templates/ -> rendered .cu -> nvcc cubins -> cuda-python loader
  build time:  `compiler.kernels.build.build_kernels(cache_dir, variants=None, jobs=None)`
  serve time:  `compiler.kernels.loader.KernelLibrary(cache_dir, variants)` (never compiles)
CPU: templates/cpu_*.cpp built once per machine capability by cpu_extension.py (cpu_attention,
cpu_fused, cpu_gemv); ops.py registers every `kiln::` op, reference_attention.py is the torch
reference every kernel is checked against.
"""
