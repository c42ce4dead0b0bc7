"""The `kiln` command line: commands, vLLM's flags, and serve-replicas."""
