"""Read safetensors tensors with explicit file reads, straight into their destination.

safetensors' own reader maps the file: every page a tensor is copied from then counts in the
process's resident size until the file is closed, so loading a checkpoint holds the model twice
at its peak (once in the parameters, once in file pages). Reading with readinto puts the bytes
in the destination tensor and leaves the file's pages in the page cache, outside the process.
The format: 8 bytes little-endian header length, a JSON header {name: {dtype, shape,
data_offsets: [begin, end]}} (offsets after the header), then the data, little-endian.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

# Bytes per element, by safetensors dtype name (the formats kiln reads).
DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsFile:
    """One open .safetensors file: its tensors' names, shapes and dtypes, and reads of them."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._file = open(self.path, "rb", buffering=0)
        try:
            self._entries, self._start = read_header(self._file, self.path.stat().st_size)
        except ValueError as e:
            self._file.close()
            raise ValueError(f"model: {self.path} {e}") from None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self._entries[name]["dtype"]]  # (read_header refused any other)

    def get_slice(self, name: str) -> "TensorSlice":
        """A reader of parts of the tensor (tensor parallelism reads only its rank's rows)."""
        return TensorSlice(self, name)

    def read(self, name: str) -> torch.Tensor:
        """The tensor, in a fresh CPU tensor of its own dtype."""
        out = torch.empty(self.shape(name), dtype=self.dtype(name))
        self.read_into(name, out)
        return out

    def read_into(self, name: str, dest: torch.Tensor) -> None:
        """Read the tensor into `dest`: a contiguous CPU tensor of its dtype and element count."""
        begin, end = self._entries[name]["data_offsets"]
        if (
            dest.dtype != self.dtype(name)
            or dest.numel() != math.prod(self.shape(name))
            or not dest.is_contiguous()
            or dest.device.type != "cpu"
        ):
            raise ValueError(
                f"model: cannot read {name} ({self.dtype(name)}, {self.shape(name)}) into a "
                f"{dest.dtype} tensor of shape {tuple(dest.shape)} on {dest.device}"
            )
        if end - begin != dest.numel() * dest.element_size():
            raise ValueError(
                f"model: {self.path} tensor {name} has {end - begin} bytes for shape "
                f"{self.shape(name)} ({self.dtype(name)})"
            )
        if end == begin:
            return
        self._file.seek(self._start + begin)
        if not read_exactly_into(self._file, dest):
            raise ValueError(f"model: {self.path} ends inside tensor {name}")


class TensorSlice:
    """Part of one tensor of a SafetensorsFile: `slice_[index]` reads the rows the index's first
    slice selects (only those bytes) and applies the rest of the index to them."""

    def __init__(self, file: SafetensorsFile, name: str) -> None:
        self.file, self.name = file, name

    def get_shape(self) -> list[int]:
        return list(self.file.shape(self.name))

    def get_dtype(self) -> str:
        """The safetensors dtype name (F32, BF16, ...)."""
        return self.file._entries[self.name]["dtype"]

    def __getitem__(self, index: tuple) -> torch.Tensor:
        shape = self.file.shape(self.name)
        rows = index[0] if index else slice(None)
        if not shape or not isinstance(rows, slice) or rows.step not in (None, 1):
            return self.file.read(self.name)[index]
        first, last, _ = rows.indices(shape[0])
        last = max(first, last)
        row_bytes = math.prod(shape[1:]) * DTYPE_BYTES[self.file._entries[self.name]["dtype"]]
        out = torch.empty((last - first, *shape[1:]), dtype=self.file.dtype(self.name))
        begin = self.file._entries[self.name]["data_offsets"][0]
        self.file._file.seek(self.file._start + begin + first * row_bytes)
        if out.numel() and not read_exactly_into(self.file._file, out):
            raise ValueError(f"model: {self.file.path} ends inside tensor {self.name}")
        return out[(slice(None), *index[1:])]


# A header longer than this is not a checkpoint's (real ones are a few MB at most).
MAX_HEADER_BYTES = 100 << 20


def read_header(file, size: int) -> tuple[dict[str, dict], int]:
    """The header of the safetensors file open in binary `file` (its total size `size`), checked:
    ({tensor name: {dtype, shape, data_offsets}}, where the data starts). ValueError says what is
    wrong: a length that cannot be, JSON that is not an object, a tensor with an unknown dtype, a
    malformed shape, or data that lies outside the file or does not match its shape."""
    head = file.read(8)
    if len(head) < 8:
        raise ValueError("is not a safetensors file (too short)")
    (length,) = struct.unpack("<Q", head)
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise ValueError("is not a safetensors file (its header length is impossible)")
    try:
        header = json.loads(file.read(length).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError("is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError("is not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    data = size - 8 - length
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise ValueError(f"is corrupt: tensor {name!r} has no description")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"is corrupt: tensor {name!r} has an unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"is corrupt: tensor {name!r} has a malformed shape")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data
        ):
            raise ValueError(f"is corrupt: tensor {name!r} lies outside the file")
        if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise ValueError(f"is corrupt: tensor {name!r}'s size does not match its shape")
    return header, 8 + length


def read_tensors(path: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor of a (small) safetensors file, by name: LoRA adapters, KV scales."""
    with SafetensorsFile(path) as f:
        return {name: f.read(name) for name in f.keys()}


def read_exactly_into(file, dest: torch.Tensor) -> bool:
    """Fill the contiguous CPU tensor `dest` with the next bytes of the binary file (no
    intermediate bytes object). False when the file ends first."""
    view = memoryview(dest.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):  # (a raw read may return fewer bytes than asked)
        got = file.readinto(view[done:])
        if not got:
            return False
        done += got
    return True
