"""One KV block as stored in a tier: a self-checking record.

    magic  b"KILNKV01"
    u32    header length, then the header:
             model fingerprint (16 bytes), block digest (16 bytes),
             u16 parent length + parent (the previous block's digest, or the prefix root),
             u32 token count + tokens (int64 each), u64 payload length
    payload  the block's bytes (every layer's K and V, as the cache holds them)
    checksum CRC-32 of everything before it (u32; 2.4x blake2b's speed here, and the header's exact
             match, not the checksum, is what tells one block from another)

`decode` refuses (BadRecord) anything that is not exactly the block asked for: another model, another
digest, parent or tokens (a digest collision), a payload of the wrong size, a torn or flipped byte.
"""

from __future__ import annotations

import struct
import zlib
from array import array

MAGIC = b"KILNKV01"
CHECKSUM_BYTES = 4


class BadRecord(ValueError):
    """A stored block that must not be served (corrupt, truncated, or not the block asked for)."""


def _checksum(data: bytes | memoryview) -> bytes:
    return struct.pack("<I", zlib.crc32(data))


def _header(fingerprint: bytes, digest: bytes, parent: bytes | None, tokens, payload_len: int) -> bytes:
    parent = parent or b""
    toks = array("q", tokens).tobytes()
    return b"".join(
        (
            fingerprint,
            digest,
            struct.pack("<H", len(parent)),
            parent,
            struct.pack("<I", len(tokens)),
            toks,
            struct.pack("<Q", payload_len),
        )
    )


def encode(fingerprint: bytes, digest: bytes, parent: bytes | None, tokens, payload: bytes) -> bytes:
    header = _header(fingerprint, digest, parent, tokens, len(payload))
    body = b"".join((MAGIC, struct.pack("<I", len(header)), header, payload))
    return body + _checksum(body)


def record_size(parent: bytes | None, num_tokens: int, payload_len: int) -> int:
    """Bytes of a record (to tell a truncated file at start-up without reading it)."""
    return len(MAGIC) + 4 + 16 + 16 + 2 + len(parent or b"") + 4 + 8 * num_tokens + 8 + payload_len + CHECKSUM_BYTES


def decode(
    record: bytes | memoryview, fingerprint: bytes, digest: bytes, parent: bytes | None, tokens, payload_len: int
) -> memoryview:
    """The payload of `record` if it is exactly this block of this model; else BadRecord."""
    view = memoryview(record)
    if len(view) < len(MAGIC) + 4 + CHECKSUM_BYTES or bytes(view[: len(MAGIC)]) != MAGIC:
        raise BadRecord("not a kiln KV block record")
    if _checksum(view[:-CHECKSUM_BYTES]) != bytes(view[-CHECKSUM_BYTES:]):
        raise BadRecord("checksum mismatch (torn or corrupt)")
    (header_len,) = struct.unpack_from("<I", view, len(MAGIC))
    start = len(MAGIC) + 4
    expected = _header(fingerprint, digest, parent, tokens, payload_len)
    if header_len != len(expected) or bytes(view[start : start + header_len]) != expected:
        raise BadRecord("a different block (model, digest, parent, tokens or size differ)")
    payload = view[start + header_len : -CHECKSUM_BYTES]
    if len(payload) != payload_len:
        raise BadRecord(f"payload of {len(payload)} bytes, expected {payload_len}")
    return payload
