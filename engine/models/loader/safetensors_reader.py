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
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class SafetensorsFile:
    """One open .safetensors file: its tensors' names, shapes and dtypes, and reads of them."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._file = open(self.path, "rb", buffering=0)
        try:
            (size,) = struct.unpack("<Q", self._file.read(8))
            header = json.loads(self._file.read(size))
        except (struct.error, ValueError) as e:
            self._file.close()
            raise ValueError(f"model: {self.path} is not a safetensors file ({e})") from None
        header.pop("__metadata__", None)
        self._start = 8 + size
        self._entries = header

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        code = self._entries[name]["dtype"]
        if code not in DTYPES:
            raise ValueError(f"model: {self.path} tensor {name} has dtype {code}, which kiln does not read")
        return DTYPES[code]

    def read(self, name: str) -> torch.Tensor:
        """The tensor, in a fresh CPU tensor of its own dtype."""
        out = torch.empty(self.shape(name), dtype=self.dtype(name))
        self.read_into(name, out)
        return out

    def read_into(self, name: str, dest: torch.Tensor) -> None:
        """Read the tensor into `dest`: a contiguous CPU tensor of its dtype and element count."""
        begin, end = self._entries[name]["data_offsets"]
        if dest.dtype != self.dtype(name) or dest.numel() != math.prod(self.shape(name)) or \
                not dest.is_contiguous() or dest.device.type != "cpu":
            raise ValueError(f"model: cannot read {name} ({self.dtype(name)}, {self.shape(name)}) into a "
                             f"{dest.dtype} tensor of shape {tuple(dest.shape)} on {dest.device}")
        if end - begin != dest.numel() * dest.element_size():
            raise ValueError(f"model: {self.path} tensor {name} has {end - begin} bytes for shape "
                             f"{self.shape(name)} ({self.dtype(name)})")
        if end == begin:
            return
        self._file.seek(self._start + begin)
        if not read_exactly_into(self._file, dest):
            raise ValueError(f"model: {self.path} ends inside tensor {name}")


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
