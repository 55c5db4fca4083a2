"""CPU check of fold_held.patch (apply it first): GDN split decode with the
history-only fold (fold_held=1: the tile (A) holds; 2: the tile re-read in one
piece) and a verify-style commit (window 1, every token accepted: the token
stays in the ring as the next buffer's first entry), compared with the float64
eager recurrence step by step over several buffer cycles.
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/results/diag/2026-12-06-sixth/check_fold_held.py
At 20ef978: worst relative error 3.2e-7 (fp32 state, tol 1e-5) and 1.4e-2 (bf16, tol 2e-2)
for both modes."""
import sys

import torch

sys.path.insert(0, "tests")
import test_gdn_kernels as t  # noqa: E402
from sglang_replayssm.kernels.cursors import MODE_VERIFY, commit  # noqa: E402

for held in (1, 2):
    t.ROUTES["held"] = ("split", t.split(project_fold=True, fold_held=held))
    for state in (t.F32, t.BF16):
        pool = t.Pool("cpu", ratio=2, L=4, route="held", state=state, ring=state, kring=state)
        slots = torch.tensor([3, -1, 1, 5], dtype=torch.int32)
        worst = 0.0
        for step in range(11):
            sl = slots if step >= 2 else torch.tensor([3], dtype=torch.int32)  # staggered
            qkv, a, b = pool.inputs(len(sl))
            y = pool.decode(sl, qkv, a, b, validate=True)
            commit(pool.fill, pool.origin, sl, mode=MODE_VERIFY, buffer_len=pool.L,
                   capacity=pool.cap, window=1, accepted=torch.ones_like(sl))
            for r, s in enumerate(sl.tolist()):
                if s >= 0:
                    o, st = pool.eager(s, qkv[r], a[r], b[r])
                    pool.ref[s] = st
                    worst = max(worst, pool.rel(y[r], o))
        print(f"fold_held={held} {state}: worst rel {worst:.2e} (tol {pool.tol})")
        assert worst < pool.tol
