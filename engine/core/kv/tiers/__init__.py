"""KV tiers under the block pool: full prefix blocks that leave the pool are kept, keyed by the
model's fingerprint and their prefix-hash chain, in host memory, a local directory and a shared
Redis/Valkey store, and come back by a load instead of a prefill.

Plain Python over bytes (no torch): the record format with its checksum (block_record.py), the
tiers (host.py, disk.py, remote.py over resp.py), the model fingerprint (fingerprint.py) and the
store that ties them together (store.py). Moving a block's bytes in and out of the KV tensors is
engine/worker/kv_block_io.py's; wiring the store to the engine core is engine/runtime/kv_tiers.py's.
"""
