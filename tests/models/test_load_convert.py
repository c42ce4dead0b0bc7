"""The half -> half copy at load (engine/models/loader/convert.py) writes what torch's copy writes."""

import torch

from engine.models.loader import convert


def _halves_with_edges(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Every 16-bit pattern (normals, subnormals, zeros, infinities, NaNs), then random ones."""
    every = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    more = torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int16, generator=torch.Generator().manual_seed(0))
    return torch.cat([every, more.view(dtype)])


def test_half_to_half_copies_the_same_bits_as_torch(monkeypatch):
    monkeypatch.setattr(convert, "SCRATCH_ELEMENTS", 1000)  # (several slices and a short last one)
    for src_dtype, dest_dtype in ((torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)):
        src = _halves_with_edges(4321, src_dtype)
        want = torch.empty(src.shape, dtype=dest_dtype).copy_(src)
        got = torch.full(src.shape, 7.0, dtype=dest_dtype)
        convert.copy_into(got, src)
        nan = want.isnan()  # (a NaN stays a NaN; torch's direct copy makes every NaN the same one)
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), (src_dtype, dest_dtype)


def test_other_copies_are_torch_copies():
    src = torch.randn(6, 8, dtype=torch.float16)
    dest = torch.zeros(8, 6, dtype=torch.bfloat16).t()  # (not contiguous: torch's own copy)
    convert.copy_into(dest, src)
    assert torch.equal(dest, src.to(torch.bfloat16))
    dest32 = torch.zeros(6, 8)
    convert.copy_into(dest32, src)
    assert torch.equal(dest32, src.float())
