"""The compact step description rank 0 broadcasts to its tensor-parallel workers.

Every message is one `dist.broadcast` of a fixed-size byte buffer: an int64 header (`HEADER_LEN`
values: op code, payload bytes, then op-specific ints) and, inline, the payload tensors' bytes
when they fit (`INLINE_BYTES`: every decode step and small prefill of a tiny model does); a larger
payload follows in a second broadcast of exactly its size. No Python object is pickled per step. A forward's
arguments (input ids, positions, then the step dataclasses such as
AttentionMetadata or a forward context) are described generically from their dataclass fields:

  per argument: a type id (an index into the types announced so far; -1 a bare tensor, -2 None)
  per field:    NONE | INT value | FLOAT (float64 bits) | BOOL value | TENSOR dtype ndim dims...

Integer tensors travel as one int64 block of the payload (cast back on arrival); floating-point
tensors as their own bytes after it (each part aligned to 8 bytes). A dataclass type is announced once, the
first time rank 0 sends it (OP_SCHEMA,
its import path as bytes), so new per-step context objects need no change here.
"""

from __future__ import annotations

import dataclasses
import importlib
import struct
from typing import Any, Callable

import torch

HEADER_LEN = 96  # int64 values
HEADER_BYTES = HEADER_LEN * 8
MESSAGE_BYTES = 16384  # one broadcast per message: the header and an inline payload
INLINE_BYTES = MESSAGE_BYTES - HEADER_BYTES

OP_FORWARD = 1  # run the model forward on this step's inputs
OP_LOGITS = 2  # compute_logits on rank 0's hidden rows (the LM head may hold a collective)
OP_COPY_BLOCKS = 3  # copy-on-write: KV blocks src -> dst
OP_SWAP = 4  # preemption by swap: blocks out to the CPU pool, then blocks in
OP_LAYOUT = 5  # start-up: KV block count and CPU swap block count, decided by rank 0
OP_SCHEMA = 6  # a dataclass type used by forward arguments from now on
OP_NOOP = 7  # heartbeat while idle (keeps the collective timeout for real hangs)
OP_EXIT = 8  # shut down

OP_NAMES = {
    OP_FORWARD: "forward",
    OP_LOGITS: "logits",
    OP_COPY_BLOCKS: "copy_blocks",
    OP_SWAP: "swap",
    OP_LAYOUT: "layout",
    OP_SCHEMA: "schema",
    OP_NOOP: "noop",
    OP_EXIT: "exit",
}

_NONE, _INT, _FLOAT, _BOOL, _TENSOR = range(5)
_DTYPES = [
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
]
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_BARE = -1  # an argument that is a tensor itself
_NONE_ARG = -2  # an argument that is None (an optional context the step does not use)


def _is_int(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex


def type_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_type(path: str) -> type:
    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


class Header:
    """Builds one header: op code, payload bytes (filled in by pack_message), then ints in order."""

    def __init__(self, op: int) -> None:
        self.values = [op, 0]

    def add(self, *values: int) -> None:
        self.values.extend(int(v) for v in values)

    @property
    def op(self) -> int:
        return self.values[0]


def _aligned(n: int) -> int:
    return -(-n // 8) * 8


def pack_message(header: Header, payloads, message: torch.Tensor) -> torch.Tensor | None:
    """Write the header and payload tensors into `message` (uint8 [MESSAGE_BYTES]); returns the
    payload bytes to broadcast after it when they do not fit inline, else None."""
    parts = [p.contiguous().view(-1).view(torch.uint8) for p in payloads if p is not None]
    total = sum(_aligned(p.numel()) for p in parts)
    header.values[1] = total
    if len(header.values) > HEADER_LEN:
        raise ValueError(f"step header needs {len(header.values)} ints (limit {HEADER_LEN})")
    head = torch.zeros(HEADER_LEN, dtype=torch.int64)
    head[: len(header.values)] = torch.tensor(header.values, dtype=torch.int64)
    message[:HEADER_BYTES].view(torch.int64).copy_(head)
    extra = None
    if total <= INLINE_BYTES:
        dest = message[HEADER_BYTES : HEADER_BYTES + total]
    else:
        dest = extra = torch.empty(total, dtype=torch.uint8, device=message.device)
    offset = 0
    for p in parts:
        dest[offset : offset + p.numel()].copy_(p)
        offset += _aligned(p.numel())
    return extra


class Payload:
    """A received message's payload bytes, read back as tensors in the order they were packed."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.pos = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        n = numel * torch.empty((), dtype=dtype).element_size()
        out = self.data[self.pos : self.pos + n].view(dtype).view(shape).clone()
        self.pos += _aligned(n)
        return out


class Reader:
    """Reads a received header's ints in order."""

    def __init__(self, values: list[int]) -> None:
        self.values = values
        self.pos = 2

    @property
    def op(self) -> int:
        return self.values[0]

    @property
    def payload_bytes(self) -> int:
        return self.values[1]

    def next(self) -> int:
        v = self.values[self.pos]
        self.pos += 1
        return v


def encode_forward(
    header: Header, args: tuple, type_ids: Callable[[type], int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Describe forward arguments into `header`; returns (integer tensors, float tensors) to send."""
    ints: list[torch.Tensor] = []
    floats: list[torch.Tensor] = []
    header.add(len(args))
    for arg in args:
        if arg is None:
            header.add(_NONE_ARG)
        elif isinstance(arg, torch.Tensor):
            header.add(_BARE)
            _encode_value(header, arg, ints, floats)
        elif dataclasses.is_dataclass(arg):
            header.add(type_ids(type(arg)))
            for f in dataclasses.fields(arg):
                _encode_value(header, getattr(arg, f.name), ints, floats)
        else:
            raise TypeError(f"tensor parallel: cannot send a forward argument of type {type(arg).__name__}")
    return ints, floats


def _encode_value(header: Header, value: Any, ints: list, floats: list) -> None:
    if value is None:
        header.add(_NONE)
    elif isinstance(value, bool):
        header.add(_BOOL, value)
    elif isinstance(value, int):
        header.add(_INT, value)
    elif isinstance(value, float):
        header.add(_FLOAT, struct.unpack("<q", struct.pack("<d", value))[0])
    elif isinstance(value, torch.Tensor):
        header.add(_TENSOR, _CODE[value.dtype], value.dim(), *value.shape)
        (ints if _is_int(value.dtype) else floats).append(value)
    else:
        raise TypeError(f"tensor parallel: cannot send a step field of type {type(value).__name__}")


def pack_ints(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The integer tensors as one flat int64 tensor (None when there are none)."""
    if not tensors:
        return None
    return torch.cat([t.reshape(-1).to(torch.int64) for t in tensors]).to(device)


@dataclasses.dataclass
class _Slot:
    """A tensor to be received: dtype and shape, filled from the payloads."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def decode_forward(reader: Reader, types: list[type]) -> tuple[list[Any], list[_Slot]]:
    """Read a forward's description: returns (argument plan, slots) where each plan entry is
    a _Slot (bare tensor) or (dataclass type, [field values or _Slots])."""
    slots: list[_Slot] = []
    plan: list[Any] = []
    for _ in range(reader.next()):
        type_id = reader.next()
        if type_id == _NONE_ARG:
            plan.append(None)
        elif type_id == _BARE:
            plan.append(_decode_value(reader, slots))
        else:
            cls = types[type_id]
            plan.append((cls, [_decode_value(reader, slots) for _ in dataclasses.fields(cls)]))
    return plan, slots


def _decode_value(reader: Reader, slots: list[_Slot]) -> Any:
    kind = reader.next()
    if kind == _NONE:
        return None
    if kind == _BOOL:
        return bool(reader.next())
    if kind == _INT:
        return reader.next()
    if kind == _FLOAT:
        return struct.unpack("<d", struct.pack("<q", reader.next()))[0]
    dtype = _DTYPES[reader.next()]
    shape = tuple(reader.next() for _ in range(reader.next()))
    slot = _Slot(dtype, shape)
    slots.append(slot)
    return slot


def int_payload_size(slots: list[_Slot]) -> int:
    return sum(s.numel for s in slots if _is_int(s.dtype))


def fill_slots(plan: list[Any], slots: list[_Slot], ints: torch.Tensor | None, floats: list[torch.Tensor]) -> list[Any]:
    """The received tensors put in place: the forward's arguments."""
    values: dict[int, torch.Tensor] = {}
    offset = 0
    float_iter = iter(floats)
    for slot in slots:
        if _is_int(slot.dtype):
            values[id(slot)] = ints[offset : offset + slot.numel].view(slot.shape).to(slot.dtype)
            offset += slot.numel
        else:
            values[id(slot)] = next(float_iter)

    def value(v: Any) -> Any:
        return values[id(v)] if isinstance(v, _Slot) else v

    args: list[Any] = []
    for entry in plan:
        if entry is None:
            args.append(None)
        elif isinstance(entry, _Slot):
            args.append(value(entry))
        else:
            cls, fields = entry
            names = [f.name for f in dataclasses.fields(cls)]
            args.append(cls(**{name: value(v) for name, v in zip(names, fields)}))
    return args
