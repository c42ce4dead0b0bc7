"""GGUF files (llama.cpp's single-file checkpoints): config, tokenizer and weights.

The config and the tokenizer (with its chat template) come from the file's metadata through
transformers' GGUF support, so kiln sees the same config a transformers user would. Tensors are
read one at a time from the file, renamed from llama.cpp's names to HF's and
dequantised (engine/layers/quant/gguf_blocks.py) to float32 (plain F32/F16/BF16 values kept as
they are), undoing what llama.cpp's converter did to
them: the rotary row permutation of Llama-architecture q/k, Gemma's +1 on norm weights.
"""

from __future__ import annotations

import functools
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from engine.layers.quant.gguf_blocks import BLOCK_TYPES, dequantize
from engine.models.loader import convert, fast_tokenizer, gguf_cache

# llama.cpp tensor name inside a block -> HF name inside model.layers.N
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 2/3 have four norms per layer; llama.cpp's ffn_norm is then the one before the MLP.
_SANDWICH_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
# Tensors llama.cpp stores that kiln derives itself (rope_freqs: llama3 rope factors, from the config).
_SKIPPED = ("rope_freqs.weight",)


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    return p.suffix.lower() == ".gguf" and p.is_file()


def hf_config(path: str | Path, cache_dir: Path | None = None) -> dict[str, Any]:
    """The HF config dict transformers derives from the file's metadata (kept under cache_dir:
    engine/models/loader/gguf_cache.py), with what transformers leaves out of it."""
    p = Path(path)
    meta, tensors = read_header(p)
    raw = gguf_cache.cached_config(p, _header_end(p, tensors), cache_dir, lambda: _transformers_config(p))
    # transformers ignores some architectures' key_length (Qwen3: its default head_dim 128 instead)
    key_length = meta.get(f"{meta.get('general.architecture')}.attention.key_length")
    if key_length:
        raw["head_dim"] = int(key_length)
    # Llama 3.x: llama.cpp stores the rope scaling as per-frequency divisors (rope_freqs), not as
    # config values; transformers drops them, kiln applies them as llama.cpp does.
    freqs = next((t for t in tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        with open(p, "rb") as f:
            f.seek(freqs.offset)
            raw_bytes = torch.frombuffer(bytearray(f.read(freqs.nbytes)), dtype=torch.uint8)
        factors = dequantize(raw_bytes, freqs.type_id, freqs.shape)
        raw["rope_scaling"] = {"rope_type": "freq_factors", "factors": factors.tolist()}
    return raw


def _transformers_config(p: Path) -> dict[str, Any]:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name).to_dict()
    except ValueError as exc:  # e.g. an architecture transformers' GGUF mapping lacks
        raise ValueError(f"model: cannot read the config of GGUF file {p}: {exc}") from exc


def load_tokenizer(path: str | Path, cache_dir: Path | None = None):
    """The tokenizer (vocabulary, merges, special tokens, chat template) stored in the file;
    converted once and kept under cache_dir (engine/models/loader/gguf_cache.py), with kiln's fast
    form beside it (engine/models/loader/fast_tokenizer.py: no transformers import on a warm start)."""
    p = Path(path)
    _, tensors = read_header(p)
    end = _header_end(p, tensors)

    def transformers_tokenizer():
        from transformers import AutoTokenizer

        return gguf_cache.cached_tokenizer(
            p, end, cache_dir, lambda: AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        )

    entry = None if cache_dir is None else gguf_cache.entry_dir(p, end, cache_dir) / "fast-tokenizer"
    return fast_tokenizer.load(entry, transformers_tokenizer, str(p))


def _header_end(p: Path, tensors: list[TensorInfo]) -> int:
    """Where the header ends: the first tensor's data (the whole file without tensors)."""
    return min((t.offset for t in tensors), default=p.stat().st_size)


# GGUF metadata value types: struct format of the scalars; 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (ggml's dimensions reversed)
    type_id: int
    offset: int  # from the file's start
    nbytes: int


_U64 = struct.Struct("<Q")


class _Cursor:
    """Reads the header from a mapping of the file: struct.unpack_from at an offset, so skipping a
    150k-token vocabulary walks its lengths without a read call per string (issue 40: start-up)."""

    def __init__(self, buf) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("gguf: the header ends inside a string")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int, keep: bool = True) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype != 9:
            raise ValueError(f"gguf: unknown metadata value type {vtype}")
        item, count = self.unpack("<I"), self.unpack("<Q")
        if not keep and item in _SCALARS:  # skip without decoding (token scores, types, ...)
            self.pos += count * struct.calcsize(_SCALARS[item])
            return None
        if not keep and item == 8:  # skip strings (the vocabulary, merges): their lengths only
            length, buf, pos = _U64.unpack_from, self.buf, self.pos
            for _ in range(count):
                pos += 8 + length(buf, pos)[0]
            self.pos = pos
            return None
        values = [self.value(item, keep) for _ in range(count)]
        return values if keep else None


def _parse(cur: _Cursor, path: str | Path) -> tuple[dict[str, Any], list[tuple], int]:
    """(metadata, (name, shape, type id, offset) per tensor, where the tensor data starts)."""
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"model: GGUF version {version} of {path} is not supported (2 or 3)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.unpack("<I")
        value = cur.value(vtype, keep=vtype != 9)
        if vtype != 9:
            meta[key] = value
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        type_id, offset = cur.unpack("<I"), cur.unpack("<Q")
        infos.append((name, tuple(reversed(dims)), type_id, offset))
    align = int(meta.get("general.alignment", 32))
    return meta, infos, (cur.pos + align - 1) // align * align


def read_header(path: str | Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """The file's scalar and string metadata (arrays such as the vocabulary are skipped) and where
    each tensor's bytes are. Reads only the header: the tensors stay on disk. Parsed once per file
    version: a start asks eight times (config, dtype, tokenizer, loader), and walking a 128k-token
    vocabulary's and its merges' lengths costs ~40 ms each time (issue 40)."""
    st = os.stat(path)
    meta, tensors = _read_header(os.fspath(path), (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return dict(meta), list(tensors)  # (copies: a caller may edit its own)


@functools.lru_cache(maxsize=8)
def _read_header(path: str, version: tuple[int, ...]) -> tuple[dict[str, Any], tuple[TensorInfo, ...]]:
    # (version: size, mtime, ctime and inode, so an edited or replaced file is parsed again)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"model: {path} is not a GGUF file (bad magic)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            cur = _Cursor(memoryview(mapped))
            cur.pos = 4  # (past the magic)
            try:
                meta, infos, start = _parse(cur, path)
            except struct.error as exc:
                raise ValueError(f"model: {path} ends inside its GGUF header") from exc
            finally:
                cur.buf.release()
    tensors = []
    for name, shape, type_id, offset in infos:
        if type_id not in BLOCK_TYPES:
            raise ValueError(
                f"model: GGUF tensor {name} has type {type_id}, which kiln does not read "
                f"(it reads {', '.join(n for n, _, _ in BLOCK_TYPES.values())})"
            )
        _, block, block_bytes = BLOCK_TYPES[type_id]
        numel = 1
        for s in shape:
            numel *= s
        tensors.append(TensorInfo(name, shape, type_id, start + offset, numel // block * block_bytes))
    return meta, tuple(tensors)


def hf_name(gguf_name: str, sandwich: bool) -> str | None:
    """The HF name of a GGUF tensor (None: one kiln derives itself)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    if gguf_name in _SKIPPED:
        return None
    m = _BLOCK.match(gguf_name)
    part = m and ((_SANDWICH_NAMES.get(m.group(2)) if sandwich else None) or _LAYER_NAMES.get(m.group(2)))
    if not part:
        raise ValueError(
            f"model: GGUF tensor {gguf_name!r} has no place in kiln's models "
            "(mixture-of-experts GGUF files are not supported)"
        )
    return f"model.layers.{m.group(1)}.{part}.{m.group(3)}"


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (its rotary pairs adjacent dims, HF's pairs the two halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_tensors(
    path: str | Path,
    num_heads: int,
    num_kv_heads: int,
    gemma_norms: bool,
    sandwich: bool,
    skip: frozenset[str] | set[str] = frozenset(),
    into: Callable[[str, tuple[int, ...]], torch.Tensor | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for each weight, one at a time (peak memory: one tensor): quantised blocks
    dequantised to float32; F32 / F16 / BF16 tensors in their own dtype, as read (the caller's copy
    into the parameter converts them: no float32 tensor beside a 2-byte one, issue 40).
    gemma_norms: norm weights are stored as 1 + w (Gemma); sandwich: Gemma 2/3's four norms;
    skip: GGUF tensor names loaded elsewhere (kept quantised: engine/models/loader/gguf_quant.py);
    into(HF name, shape): the tensor a plain one that needs no rework lands in (its parameter), or
    None: it is read there a slice at a time and yielded as that tensor, never whole beside it
    (an F16 file's 128k-vocabulary embedding table is 0.5 GB)."""
    meta, tensors = read_header(path)
    permuted = meta.get("general.architecture") == "llama"  # (Mistral GGUFs are written as llama too)
    with open(path, "rb") as f:
        for t in tensors:
            name = hf_name(t.name, sandwich)
            if name is None or t.name in skip:
                continue
            f.seek(t.offset)
            plain = _PLAIN_DTYPES.get(BLOCK_TYPES[t.type_id][0]) if t.type_id in BLOCK_TYPES else None
            reworked = (permuted and re.search(r"\.self_attn\.[qk]_proj\.", name)) or (
                gemma_norms and name.endswith("norm.weight")
            )
            if plain is not None and into is not None and not reworked and (dest := into(name, t.shape)) is not None:
                _read_plain_into(f, plain, dest, f"{path}: tensor {t.name}")
                yield name, dest
                continue
            raw = torch.empty(t.nbytes, dtype=torch.uint8)
            if f.readinto(memoryview(raw.numpy())) != t.nbytes:
                raise ValueError(f"gguf: {path} ends inside tensor {t.name}")
            w = raw.view(plain).reshape(t.shape) if plain is not None else dequantize(raw, t.type_id, t.shape)
            if permuted and ".self_attn.q_proj." in name:
                w = unpermute_rows(w, num_heads)
            elif permuted and ".self_attn.k_proj." in name:
                w = unpermute_rows(w, num_kv_heads)
            if gemma_norms and name.endswith("norm.weight"):
                w = w.float() - 1.0
            yield name, w


# GGUF tensor types whose bytes are plain values, read as such
_PLAIN_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# A plain tensor converted on its way into a parameter of another dtype is read this much at a time
READ_SLICE_BYTES = 16 << 20


def _read_plain_into(f, dtype: torch.dtype, dest: torch.Tensor, what: str) -> None:
    """The file's next dest.numel() values of `dtype` into the contiguous CPU tensor `dest`: read
    in place where dest has that dtype, else a slice at a time into one buffer and converted."""
    flat = dest.view(-1)
    if dest.dtype == dtype:
        slices = [flat]
        buf = None
    else:
        step = max(1, READ_SLICE_BYTES // dtype.itemsize)
        slices = [flat[a : a + step] for a in range(0, flat.numel(), step)]
        buf = torch.empty(min(step, flat.numel()), dtype=dtype)
    for part in slices:
        target = part if buf is None else buf[: part.numel()]
        view = memoryview(target.view(torch.uint8).numpy())
        done = 0
        while done < len(view):  # (a raw read may return fewer bytes than asked)
            got = f.readinto(view[done:])
            if not got:
                raise ValueError(f"gguf: {what} ends inside the file")
            done += got
        if buf is not None:
            convert.copy_into(part, target)
