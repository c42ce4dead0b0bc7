"""Build-time half of kiln: custom ops, graph capture and ahead-of-time kernels.

Never imports `engine`: everything here takes tensors and plain values.
"""
