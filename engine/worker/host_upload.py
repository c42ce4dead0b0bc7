"""Small host -> device uploads inside a step (row indices, flags) that do not block the host.

`torch.tensor(list, device=cuda)` and `.to(cuda)` from pageable memory make the host wait for the
copy (and so for whatever the stream had queued before it). A step's index lists go instead
through pinned memory with `non_blocking=True`, as the block swapper's do: torch's pinned-memory
allocator keeps each pinned block until the copy that reads it has run, so the list may be
dropped at once. On the CPU (and on a CPU-only torch, where pinning is not possible) a list simply
becomes a tensor: nothing is copied.

`BlockingUploads` finds the other kind in a piece of code, on the CPU as well (a test's
check of the spec step path: tests/spec_decode/test_spec_uploads.py).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.overrides import TorchFunctionMode


def upload(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, copied without blocking the host."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class BlockingUploads(TorchFunctionMode):
    """Counts, while active, the calls that would block the host on a GPU: a tensor made from a
    host list straight on a device (`torch.tensor(..., device=...)`), and a host tensor's
    `.to(device)` without `non_blocking=True` or from memory that is not pinned. On the CPU every
    device is the CPU, so the calls are counted by their form: what they would do on a GPU (on
    the CPU, `upload` calls neither). `where` lists each one's kind."""

    def __init__(self) -> None:
        super().__init__()
        self.where: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self.where.append(f"torch.{name}(..., device=...)")
        elif name == "to" and args and isinstance(args[0], torch.Tensor) and _names_device(args[1:], kwargs):
            if args[0].is_cpu and not (kwargs.get("non_blocking") and args[0].is_pinned()):
                self.where.append("Tensor.to(device) from pageable memory or blocking")
        return func(*args, **kwargs)


def _names_device(args: tuple, kwargs: dict) -> bool:
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args)
