"""The cursor protocol both kernel families share (kernels/cursors.py):
commit against its PyTorch reference, accept_path (tree verify) against
its reference, and their input checks."""
from __future__ import annotations

import pytest
import torch

from sglang_replayssm.kernels import cursors as cur
from sglang_replayssm.kernels.cursors import (MODE_DECODE, MODE_FLUSH, MODE_VERIFY, commit,
                                              commit_ref, required_capacity)

from draft_trees import as_sglang_parents, random_paths, random_tree  # noqa: E402 (tests/ helper)


@pytest.mark.parametrize("mode", [MODE_DECODE, MODE_VERIFY, MODE_FLUSH])
def test_commit_matches_commit_ref(device, mode):
    gen = torch.Generator().manual_seed(40 + mode)
    S, L, T = 16, 6, 3
    cap = required_capacity(L, T)
    for trial in range(6):
        fill = torch.randint(0, L, (S,), generator=gen, dtype=torch.int32)
        origin = torch.randint(0, cap, (S,), generator=gen, dtype=torch.int32)
        slots = torch.randperm(S, generator=gen)[:10].to(torch.int32)
        slots[torch.rand(10, generator=gen) < 0.3] = -1
        slot_dtype = torch.int64 if trial % 2 else torch.int32
        # out-of-range counts on odd trials: both versions clamp to [0, T]
        lo, hi = (-1, T + 2) if trial % 2 else (1, T + 1)
        accepted = torch.randint(lo, hi, (10,), generator=gen, dtype=torch.int32)
        window = 1 if mode == MODE_DECODE else T
        f_ref, o_ref = fill.clone(), origin.clone()
        commit_ref(f_ref, o_ref, slots, accepted, window, L, cap, mode)
        f, o = fill.to(device), origin.to(device)
        commit(f, o, slots.to(slot_dtype).to(device), mode=mode, buffer_len=L, capacity=cap,
               window=window, accepted=accepted.to(device) if mode == MODE_VERIFY else None)
        f, o = f.cpu(), o.cpu()
        assert torch.equal(f, f_ref) and torch.equal(o, o_ref), trial
        pad_free = [s for s in range(S) if s not in slots.tolist()]
        assert torch.equal(f.cpu()[pad_free], fill[pad_free])


def test_commit_and_capacity_reject_bad_input(device):
    fill = torch.zeros(4, dtype=torch.int32, device=device)
    slots = torch.tensor([0, 2], dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="cursors must be int32"):
        commit(fill.long(), fill.clone(), slots, mode=MODE_DECODE, buffer_len=4, capacity=3)
    with pytest.raises(ValueError, match="needs `accepted`"):
        commit(fill, fill.clone(), slots, mode=MODE_VERIFY, buffer_len=4, capacity=5, window=2)
    with pytest.raises(ValueError, match=r"accepted counts must lie in \[0, window=2\]"):
        commit(fill, fill.clone(), slots, mode=MODE_VERIFY, buffer_len=4, capacity=5, window=2,
               accepted=torch.tensor([1, 3], dtype=torch.int32, device=device), validate=True)
    with pytest.raises(ValueError, match="must exceed the speculative window"):
        required_capacity(4, 4)
    with pytest.raises(ValueError, match="buffer_len must be >= 1"):
        required_capacity(0, 1)


@pytest.mark.parametrize("stacked", [False, True])
def test_accept_path_moves_the_path_entries(device, stacked):
    """accept_path against its PyTorch reference on rings of every shape
    (vector and scalar entries, one layer or stacked), wrapped windows,
    a padded row, paths of every length."""
    gen = torch.Generator().manual_seed(23)
    S, T, cap = 5, 4, 9
    fill = torch.tensor([0, 5, 2, 8, 1], dtype=torch.int32)
    origin = torch.tensor([0, 6, 8, 3, 2], dtype=torch.int32)
    slots = torch.tensor([1, -1, 3, 2, 4], dtype=torch.int32)
    trees = [random_tree(gen, T) for _ in range(5)]
    path, acc = random_paths(gen, trees, T)
    lead = (3,) if stacked else ()
    rings = [torch.randn(*lead, S, 2, cap, 6, generator=gen),
             torch.randn(*lead, S, 2, cap, generator=gen)]
    want = [r.clone() for r in rings]
    for w in want:
        for layer in (w if stacked else [w]):
            cur.accept_path_ref(layer, fill, origin, slots, path, acc, cap)
    got = [r.clone().to(device) for r in rings]
    cur.accept_path(got, fill.to(device), origin.to(device), slots.to(device), path.to(device),
                    acc.to(device), capacity=cap, stacked=stacked,
                    parents=torch.tensor(trees, dtype=torch.int32).to(device), validate=True)
    assert int(acc.max()) > 1 and any(p != list(range(len(p))) for p in path.tolist())
    for r, g, w in zip(rings, got, want):
        assert torch.equal(g.cpu(), w) and not torch.equal(r, w)


def test_tree_path_follows_the_parents(device):
    """tree_path (the kernel) and its PyTorch reference against
    draft_trees.path_to on random trees (several trees in one window, every
    draft as the last accepted one), and a chain."""
    from draft_trees import path_to

    gen = torch.Generator().manual_seed(29)
    T = 7
    trees = [random_tree(gen, T) for _ in range(6)]
    rows = [(tree, node) for tree in trees for node in range(T)]
    parents = torch.tensor([t for t, _ in rows], dtype=torch.int32)
    last = torch.tensor([n for _, n in rows])
    for fn in (cur.tree_path, cur.tree_path_ref):
        path, accepted = fn(parents.to(device), last.to(device))
        assert path.dtype == accepted.dtype == torch.int32 and path.is_contiguous()
        for r, (tree, node) in enumerate(rows):
            want = path_to(tree, node)
            assert int(accepted[r]) == len(want)
            assert path[r].tolist() == want + [0] * (T - len(want))
        # SGLang's buffer as it is: int64, entry 0 unset (never followed)
        path64, accepted64 = fn(as_sglang_parents([t for t, _ in rows]).to(device),
                                last.to(device))
        assert torch.equal(path64, path) and torch.equal(accepted64, accepted)
        chain = torch.tensor([[-1, 0, 1, 2]], dtype=torch.int32).expand(4, 4).contiguous()
        path, accepted = fn(chain.to(device), torch.arange(4).to(device))
        assert accepted.tolist() == [1, 2, 3, 4]
        assert path.tolist() == [[0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 2, 0], [0, 1, 2, 3]]
    with pytest.raises(ValueError, match="parents must be int32 or int64"):
        cur.tree_path(parents.to(torch.int16).to(device), last.to(device))
