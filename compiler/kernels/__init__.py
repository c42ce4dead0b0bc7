"""kiln's attention kernels: templates/ -> rendered .cu -> nvcc cubins -> cuda-python loader.

build time:  `compiler.kernels.build.build_kernels(cache_dir, variants=None, jobs=None)`
serve time:  `compiler.kernels.loader.KernelLibrary(cache_dir, variants)` (never compiles)
"""
