"""Graph compilation: the model forward under torch.compile and decode steps captured as CUDA graphs."""
