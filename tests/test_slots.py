"""copy_slots (the radix track snapshots of whole slots) against its reference."""
import pytest
import torch

from sglang_replayssm.kernels.slots import copy_slots, copy_slots_ref


def test_copy_slots_copies_masked_rows_of_every_tensor(device):
    """Tensors of several dtypes and shapes (per layer and per slot), a
    masked-off row, an int32 cursor viewed as [1, S]: the masked rows' dst
    slots become their src slots, nothing else moves."""
    gen = torch.Generator().manual_seed(5)
    S = 7
    tensors = [torch.randn(3, S, 2, 5, 4, generator=gen),                  # a ring
               torch.randn(3, S, 6, 3, generator=gen).to(torch.bfloat16),   # conv
               torch.randn(2, S, 4, 8, 8, generator=gen, dtype=torch.float64),
               torch.randint(0, 100, (1, S), generator=gen, dtype=torch.int32)]  # cursors
    src = torch.tensor([1, 4, 2, 0], dtype=torch.int32)
    dst = torch.tensor([5, 6, 3, 0], dtype=torch.int64)
    mask = torch.tensor([True, False, True, False])
    want = [t.clone() for t in tensors]
    copy_slots_ref(want, src, dst, mask)
    got = [t.clone().to(device) for t in tensors]
    copy_slots(got, src.to(device), dst.to(device), mask.to(device))
    for t, g, w in zip(tensors, got, want):
        assert torch.equal(g.cpu(), w)
        assert torch.equal(w[:, 5], t[:, 1]) and torch.equal(w[:, 3], t[:, 2])
        assert torch.equal(w[:, 6], t[:, 6])  # masked off: untouched
    copy_slots(got, src[:0].to(device), dst[:0].to(device), mask[:0].to(device))  # empty batch
    with pytest.raises(ValueError, match=r"src and dst must be \[batch=4\]"):
        copy_slots(got, src[:2].to(device), dst.to(device), mask.to(device))
    with pytest.raises(ValueError, match="each slot's entries contiguous"):
        copy_slots([got[0].transpose(2, 4)], src.to(device), dst.to(device), mask.to(device))
