"""KV cache bookkeeping, plain Python over block ids: the block pool (free, used, cached blocks and
prefix hashes), the allocator over it and the CPU swap space's accounting. (How big the cache is:
engine/worker/kv_sizing.py, which reads the machine.)"""
