"""Tensor parallelism: rank 0's executor, the worker processes, and the compact step description broadcast
between them."""
