"""scripts/bench_verify.py: its cursor-cycle arithmetic against the commit
rule, a dry run of every arm of ours on CPU (interpreter, tiny shapes), and
on a GPU its stock arms' outputs against ours."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import bench_verify as bv  # noqa: E402

from sglang_replayssm.kernels.cursors import MODE_VERIFY, commit_ref  # noqa: E402


def test_cycle_steps_is_the_commit_rules_period():
    """cycle_steps(L, T, A) = the steps from a flush to the next one when
    every step accepts A of T drafts, as commit_ref advances the cursors."""
    for L, T, A in [(16, 4, 2), (16, 8, 2), (16, 4, 4), (8, 7, 1), (32, 4, 3)]:
        cap = L - 1 + T
        fill = torch.tensor([A], dtype=torch.int32)
        origin = torch.zeros(1, dtype=torch.int32)
        slots = torch.zeros(1, dtype=torch.int32)
        acc = torch.tensor([A], dtype=torch.int32)
        steps = 0
        while True:
            steps += 1
            before = int(fill[0])
            commit_ref(fill, origin, slots, acc, T, L, cap, MODE_VERIFY)
            if int(fill[0]) != before + A:  # folded: the buffer holds this window alone
                assert int(fill[0]) == A
                break
        assert bv.cycle_steps(L, T, A) == steps, (L, T, A)
    assert bv.cycle_steps(16, 4, 2) == 6 and bv.cycle_steps(16, 8, 2) == 4


def test_trees_and_paths():
    assert bv.binary_tree(8) == [-1, 0, 0, 1, 1, 2, 2, 3]
    assert bv.first_child_path(8) == [0, 1, 3, 7]
    assert bv.first_child_path(1) == [0]


def test_dry_run_runs_every_arm_of_ours(tmp_path):
    """Both families' verify, accept_path and commit through the script (a
    tree exercises all a chain does, plus accept_path), over a two-step cycle
    whose second step flushes; another launch shape and the split route
    beside the default."""
    assert bv.main(["--dry-run", "--out-dir", str(tmp_path), "--batches", "2",
                    "--drafts", "tree:4", "--buffer-len", "8", "--configs", "16x2",
                    "--routes", "split"]) == 0
    res = json.loads((tmp_path / "kernels_verify.json").read_text())
    assert res["errors"] == []
    rows = {(r["family"], r["draft"]): r for r in res["rows"]}
    assert set(rows) == {("gdn", "tree"), ("mamba2", "tree")}
    assert rows["gdn", "tree"]["parents"] == [-1, 0, 0, 1]
    assert rows["gdn", "tree"]["accepted_path"] == [0, 1]
    assert rows["mamba2", "tree"]["cycle_steps"] == bv.cycle_steps(8, 4, 2) == 2
    # --configs and --routes: timed beside the default
    assert all("us_16x2" in r and "us_split" in r for r in rows.values())
    assert "| 16x2 | split |" in (tmp_path / "kernels_verify.md").read_text()


@pytest.mark.parametrize("bad", ["16", "24x4", "16x3", "ax4"])
def test_configs_must_be_rows_x_warps(bad):
    with pytest.raises(SystemExit, match="--configs"):
        bv.parse(["--configs", bad])


@pytest.mark.gpu
def test_stock_and_ours_agree_on_the_gpu(tmp_path):
    """On a GPU the script calls SGLang's verify kernels as the server does:
    its outputs, chain and tree, agree with ours from the same checkpoint, on
    the default route and on the split route."""
    assert bv.main(["--out-dir", str(tmp_path), "--batches", "3", "--drafts", "chain:3,tree:4",
                    "--buffer-len", "8", "--rep-ms", "5", "--slots", "8",
                    "--stock", "triton", "--routes", "split"]) == 0
    res = json.loads((tmp_path / "kernels_verify.json").read_text())
    assert res["errors"] == []
    assert len(res["rows"]) == 4
    for r in res["rows"]:
        assert r["stock_triton_us"] is not None, r
        assert r["max_rel_diff_vs_stock_triton"] < 1e-5, r
        assert r["max_rel_diff_split_vs_stock_triton"] < 1e-5, r
