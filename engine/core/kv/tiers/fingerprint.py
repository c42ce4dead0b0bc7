"""The model's identity for stored KV, found without reading every weight byte.

A stored block may be served only to the model that computed it, with the same numbers: the
fingerprint covers every file of the checkpoint by name, size and modification time; the bytes
of what is small and says what the model is (config, tokenizer, generation config, chat
template), the headers of safetensors files (names, shapes, dtypes, offsets) and the first MiB of
a GGUF file; and the facts the caller adds (dtype, KV dtype and scales, block size, the cache's
layout, device, kiln's version). A model changed in place on the same directory, or the same one
run with another KV dtype or scales, gets another fingerprint, and so another namespace.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

SMALL_FILE_BYTES = 4 << 20  # small files are hashed whole (config, tokenizer, templates)
GGUF_HEAD_BYTES = 1 << 20


def _file_facts(path: Path, rel: str, h) -> None:
    st = path.stat()
    h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    if path.suffix == ".safetensors":
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                h.update(f.read(min(n, 64 << 20)))
    elif path.suffix == ".gguf":
        with open(path, "rb") as f:
            h.update(f.read(GGUF_HEAD_BYTES))
    elif st.st_size <= SMALL_FILE_BYTES:
        h.update(path.read_bytes())


def model_fingerprint(model_path: Path, facts: dict[str, Any]) -> bytes:
    """16 bytes naming this model and KV layout; `facts` must be JSON-serialisable."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"kiln-kv-tiers-1\0")
    model_path = Path(model_path)
    if model_path.is_file():
        _file_facts(model_path, model_path.name, h)
    else:
        for root, dirs, files in os.walk(model_path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                if name.startswith("."):
                    continue
                path = Path(root) / name
                _file_facts(path, str(path.relative_to(model_path)), h)
    h.update(json.dumps(facts, sort_keys=True, default=str).encode())
    return h.digest()
