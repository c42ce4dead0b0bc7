"""Sampling on the device: the sampler, a step's sampled tokens on their way to the host, and logprobs."""
