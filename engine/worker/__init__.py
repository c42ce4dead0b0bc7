"""The device side: the model runner, the step's static input buffers and how a step is written into them,
CUDA graphs of decode steps, CPU threads and warm-up, and sampling (sample/)."""
