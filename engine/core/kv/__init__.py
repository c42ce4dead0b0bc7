"""KV cache bookkeeping, plain Python over block ids: the block pool (free, used, cached blocks and
prefix hashes), the allocator over it, the CPU swap space's accounting and KV sizing."""
