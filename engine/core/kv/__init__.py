"""KV cache: the block pool (pure Python bookkeeping) and the KV tensors."""

from engine.core.kv.block_pool import BlockPool, NoFreeBlocksError

__all__ = ["BlockPool", "NoFreeBlocksError"]
