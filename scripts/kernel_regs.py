#!/usr/bin/env python3
"""Registers, spills and shared memory of the kernels (Mamba-2 and GDN, split
route and fused) for sm_90, compiled offline: no GPU needed (Triton's bundled
ptxas), so launch knobs can be screened before spending device time.

Also listed: every state tile (2-D) that the compiled kernel converts to a
tensor-core (MMA) layout outside any branch, i.e. on every step. A tile
folded by tl.dot only on the flush step should be converted inside that
branch; Triton 3.6 has hoisted such a conversion of a bf16 checkpoint to
its load (a shared-memory round trip of the tile per plain step, the GDN
fused kernel until 2026-12-04).

Approximates the JIT's specialisation at the Nemotron-H shape (H=128, P=64,
N=128, G=8, L=16; bf16 activations, fp32 dt ring) and the Qwen3-Next GDN
shape (H=16, HV=32, K=V=128, L=16; bf16 activations and k ring, u ring fp32
for an fp32 state / bf16 for bf16, as bench_kernels.py): 16-byte aligned
pointers and every integer argument a multiple of 16. Without that, masks on runtime
sizes block vectorisation and the counts are far too pessimistic. The real
JIT can differ (e.g. a stride equal to 1 is specialised further): confirm the
picked configs on the GPU (``kernel.n_regs`` / ``n_spills`` after a launch).
Measured once: GDN's split projection (A) with the fold, fp32, 64 rows at 2
warps, is 193 registers here and 168 as the GPU JIT built it (Nsight Compute on
the H100, benchmarks/results/diag/2026-12-06-fourth/ncu_sections_fp32.txt).

usage: python scripts/kernel_regs.py [mamba2|gdn ...]   (default: both;
       TRITON_INTERPRET must be unset)
       python scripts/kernel_regs.py check   (exit 1 on such a conversion in
       an output-only fused decode or verify kernel or a split projection
       with the fold, or on a default verify / flush launch that spills;
       tests/test_kernel_layouts.py)
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("unset TRITON_INTERPRET: the kernels must be JIT functions here")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sglang_replayssm.kernels import fold as fd  # noqa: E402
from sglang_replayssm.kernels import gdn_replay as gdn  # noqa: E402
from sglang_replayssm.kernels import mamba2_replay as m2  # noqa: E402
from sglang_replayssm.kernels import projection as pj  # noqa: E402
from sglang_replayssm.kernels.cursors import MODE_FLUSH  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
P, N, L = 64, 128, 16


FLOATS = {"scale"}  # float scalar arguments (no divisibility hint)


def compile_sm90(fn, ptr_types, consts, num_warps):
    sig = {n: "constexpr" if n in consts else (ptr_types.get(n, "*fp32") if n.endswith("_ptr")
                                                else "fp32" if n in FLOATS else "i32")
           for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] not in ("constexpr", "fp32")}
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET,
                          options={"num_warps": num_warps})


def resources(k) -> tuple[int | None, int | None]:
    """(registers, bytes of spill stores) of a compiled kernel, from ptxas -v."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    info = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                          capture_output=True, text=True).stderr
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    return (int(regs.group(1)) if regs else None, int(spill.group(1)) if spill else None)


def report(name, fn, ptr_types, consts, num_warps):
    k = compile_sm90(fn, ptr_types, consts, num_warps)
    regs, spill = resources(k)
    hoisted = unconditional_mma_tiles(k.asm["ttgir"])
    print(f"{name:<44} warps={num_warps}: {regs if regs is not None else '?':>3} registers, "
          f"{spill if spill is not None else '?':>4} B spilled, {k.metadata.shared:>6} B shared"
          + (f", tiles to MMA layout on every step: {' '.join(hoisted)}" if hoisted else ""))


def unconditional_mma_tiles(ttgir: str) -> list[str]:
    """Shapes of the 2-D tensors converted to an MMA layout at the function
    body's top level (not inside an scf.if / scf.for region). Region depth
    is counted by braces: module and tt.func open two; attribute dicts open
    and close on their own line."""
    found, depth = [], 0
    for line in ttgir.splitlines():
        if depth == 2 and "ttg.convert_layout" in line:
            m = re.search(r"-> tensor<(\d+)x(\d+)x(\w+), #mma", line)
            if m and int(m.group(1)) > 1 and int(m.group(2)) > 1:
                found.append(f"{m.group(1)}x{m.group(2)}x{m.group(3)}")
        depth += line.count("{") - line.count("}")
    return found


# the Mamba-2 kernels' non-state pointers (the state pointers vary per case)
MAMBA2_PTRS = {"xbuf_ptr": "*bf16", "bbuf_ptr": "*bf16", "dtbuf_ptr": "*fp32", "fill_ptr": "*i32",
               "origin_ptr": "*i32", "slot_ptr": "*i32", "x_ptr": "*bf16", "dt_ptr": "*bf16",
               "B_ptr": "*bf16", "C_ptr": "*bf16", "z_ptr": "*bf16", "A_ptr": "*fp32",
               "D_ptr": "*bf16", "dt_bias_ptr": "*bf16", "out_ptr": "*bf16", "proj_ptr": "*fp32",
               "weights_ptr": "*fp32", "parent_ptr": "*i32"}


def serving_bf16_terms(sdt):
    """(A)'s fold.weighted_dot parts at the listed shapes (bf16 key rings)."""
    return 3 if sdt == "fp32" else 2


def mamba2_projection_case(sdt, cols, block=32, terms=None, outputs=False):
    """The split route's (A) with the flush folded in (project_fold); terms:
    BF16_TERMS (None: as served, bf16 B ring; 0: the tf32x3 dot); outputs:
    SplitConfig.outputs_in_projection (D, no z, as Nemotron-H decodes)."""
    terms = serving_bf16_terms(sdt) if terms is None else terms
    ptr = f"*{sdt}"
    return (m2._mamba2_split_projection_kernel, dict(MAMBA2_PTRS, ckpt_ptr=ptr, fold_ptr=ptr),
            {"BLOCK_S": L, "BLOCK_P": block, "BLOCK_N": N, "FOLD_COLS": cols,
             "BF16_TERMS": terms,
             "HAS_FOLD_COPY": False, "HAS_DT_BIAS": True, "DT_SOFTPLUS": True,
             "DOT_PRECISION": "tf32x3", "OVERLAP": False, "OUTPUTS": outputs,
             "HAS_D": True, "HAS_Z": False})


def gdn_projection_case(sdt, cols, block=32, terms=None, outputs=False):
    terms = serving_bf16_terms(sdt) if terms is None else terms
    ptr = f"*{sdt}"
    return (gdn._gdn_split_projection_kernel, dict(gdn_split_ptrs(sdt), ckpt_ptr=ptr),
            {"BLOCK_S": L, "BLOCK_R": block, "BLOCK_K": 128, "FOLD_COLS": cols,
             "BF16_TERMS": terms,
             "USE_QK_L2NORM": True, "DOT_PRECISION": "tf32x3", "OVERLAP": False,
             "OUTPUTS": outputs})


def gdn_split_ptrs(sdt):
    """The GDN split kernels' pointers: u ring in the state's dtype, as bench_kernels.py."""
    ptr = f"*{sdt}"
    return {"kbuf_ptr": "*bf16", "ubuf_ptr": ptr, "gbuf_ptr": "*fp32", "fill_ptr": "*i32",
            "origin_ptr": "*i32", "slot_ptr": "*i32", "proj_ptr": "*fp32",
            "qkv_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "A_log_ptr": "*fp32",
            "dt_bias_ptr": "*bf16", "out_ptr": "*bf16", "weights_ptr": "*fp32"}


def mamba2():
    state = {"fp32": "*fp32", "bf16": "*bf16"}
    for sdt, ptr in state.items():
        for block in (32, 64):
            for nw in (1, 2, 4):
                report(f"(A) projection {sdt} block={block}", pj._projection_kernel,
                       {"state_ptr": ptr, "slot_ptr": "*i32", "vec_ptr": "*bf16",
                        "out_ptr": "*fp32"},
                       {"NUM_VEC": 1, "BLOCK_R": block, "BLOCK_K": N}, nw)
    for sdt, ptr in state.items():
        served = serving_bf16_terms(sdt)
        for cols, terms in ((N, served), (32, served), (32, 0)):  # fold_cols 0: one chunk
            for block in (16, 32, 64):
                for nw in (2, 4, 8):
                    report(f"(A) projection + fold {sdt} fold_cols={cols} "
                           f"bf16_terms={terms} block={block}",
                           *mamba2_projection_case(sdt, cols, block, terms), nw)
    for sdt in state:  # outputs_in_projection: (A) at the serving tiles, and (W)
        for block, nw in ((64, 2), (64, 4), (32, 4)):
            report(f"(A) projection + fold + outputs {sdt} block={block}",
                   *mamba2_projection_case(sdt, 32, block, outputs=True), nw)
    for nw in (1, 2, 4):
        report("(W) ring weights, 16 heads", m2._mamba2_ring_weights_kernel, MAMBA2_PTRS,
               {"BLOCK_S": L, "BLOCK_H": 16, "BLOCK_N": N, "HAS_DT_BIAS": True,
                "DT_SOFTPLUS": True, "OVERLAP": True}, nw)
    for heads in (1, 4, 16):
        for nw in (1, 2, 4):
            for overlap in (False, True):
                report(f"(B) outputs out_heads={heads} overlap={overlap}",
                       m2._mamba2_split_outputs_kernel, MAMBA2_PTRS,
                       {"HEADS": heads, "BLOCK_S": L, "BLOCK_P": P, "BLOCK_N": N, "HAS_D": True,
                        "HAS_Z": False, "HAS_DT_BIAS": True, "DT_SOFTPLUS": True,
                        "OVERLAP": overlap}, nw)
    for sdt, ptr in state.items():
        for dot in (True, False):
            for block in (32, 64):
                for nw in (4, 8):
                    report(f"(C) fold {sdt} fold_dot={dot} fold_block={block}",
                           fd.split_fold_kernel,
                           dict(MAMBA2_PTRS, ckpt_ptr=ptr, fold_ptr=ptr, vbuf_ptr="*bf16",
                                kbuf_ptr="*bf16", gbuf_ptr="*fp32"),
                           {"ROWS": 256, "BLOCK_S": L, "BLOCK_R": block, "BLOCK_K": N,
                            "HAS_FOLD_COPY": False, "FOLD_DOT": dot, "DT_GATED": True,
                            "RECOMPUTE": False, "FOLD_COLS": N, "DOT_PRECISION": "tf32x3"}, nw)


def gdn_split():
    K = V = 128
    for sdt in ("fp32", "bf16"):
        ptr = f"*{sdt}"
        ring = gdn_split_ptrs(sdt)
        for block in (32, 64):
            for nw in (1, 2, 4):
                report(f"GDN (A) projection {sdt} 2 vectors block={block}",
                       pj._projection_kernel,
                       {"state_ptr": ptr, "slot_ptr": "*i32", "vec_ptr": "*bf16",
                        "out_ptr": "*fp32"},
                       {"NUM_VEC": 2, "BLOCK_R": block, "BLOCK_K": K}, nw)
        served = serving_bf16_terms(sdt)
        for cols, terms in ((K, served), (32, served), (32, 0)):  # fold_cols 0: one chunk
            for block in (16, 32, 64):
                for nw in (2, 4, 8):
                    report(f"GDN (A) projection + fold {sdt} fold_cols={cols} "
                           f"bf16_terms={terms} block={block}",
                           *gdn_projection_case(sdt, cols, block, terms), nw)
        for block, nw in ((64, 2), (64, 4), (32, 4)):
            report(f"GDN (A) projection + fold + outputs {sdt} block={block}",
                   *gdn_projection_case(sdt, 32, block, outputs=True), nw)
        for nw in (1, 2, 4):
            report(f"GDN (W) ring weights {sdt}", gdn._gdn_ring_weights_kernel, ring,
                   {"BLOCK_S": L, "BLOCK_H": 2, "BLOCK_K": K, "USE_QK_L2NORM": True,
                    "OVERLAP": True}, nw)
        for heads in (1, 2):
            for nw in (1, 2, 4):
                for overlap in (False, True):
                    report(f"GDN (B) outputs u ring {sdt} out_heads={heads} overlap={overlap}",
                           gdn._gdn_split_outputs_kernel, ring,
                           {"HEADS": heads, "BLOCK_S": L, "BLOCK_V": V, "BLOCK_K": K,
                            "USE_QK_L2NORM": True, "HAS_FOLD_COPY": False,
                            "OVERLAP": overlap}, nw)
        for dot in (True, False):
            for block in (32, 64, 128):
                for nw in (4, 8):
                    report(f"GDN (C) fold {sdt} fold_dot={dot} fold_block={block}",
                           fd.split_fold_kernel,
                           {"ckpt_ptr": ptr, "fold_ptr": ptr, "vbuf_ptr": ptr,
                            "kbuf_ptr": "*bf16", "gbuf_ptr": "*fp32", "fill_ptr": "*i32",
                            "origin_ptr": "*i32", "slot_ptr": "*i32", "A_ptr": "*fp32"},
                           {"ROWS": 256, "BLOCK_S": L, "BLOCK_R": block, "BLOCK_K": K,
                            "HAS_FOLD_COPY": False, "FOLD_DOT": dot, "DT_GATED": False,
                            "RECOMPUTE": False, "FOLD_COLS": K, "DOT_PRECISION": "tf32x3"}, nw)
    # dual precision: bf16 read copy, fp32 fold copy, u recomputed in the fold,
    # the tile and the keys in chunks of fold_cols columns
    for block, cols, nw in ((32, 32, 4), (32, 32, 8), (32, 64, 4), (64, 32, 4), (64, 32, 8),
                            (16, 32, 2), (16, 32, 4), (16, 64, 2), (32, K, 4)):
        report(f"GDN (C) fold bf16+fp32 copy, recompute u, fold_block={block} "
               f"fold_cols={cols}",
               fd.split_fold_kernel,
               {"ckpt_ptr": "*bf16", "fold_ptr": "*fp32", "vbuf_ptr": "*bf16",
                "kbuf_ptr": "*fp32", "gbuf_ptr": "*fp32", "betabuf_ptr": "*fp32",
                "fill_ptr": "*i32", "origin_ptr": "*i32", "slot_ptr": "*i32",
                "A_ptr": "*fp32"},
               {"ROWS": 256, "BLOCK_S": L, "BLOCK_R": block, "BLOCK_K": K,
                "HAS_FOLD_COPY": True, "FOLD_DOT": True, "DT_GATED": False,
                "RECOMPUTE": True, "FOLD_COLS": cols, "DOT_PRECISION": "tf32x3"}, nw)


GDN_FUSED_PTRS = {"gbuf_ptr": "*fp32", "vbuf_ptr": "*bf16", "betabuf_ptr": "*fp32",
                  "fill_ptr": "*i32", "origin_ptr": "*i32", "slot_ptr": "*i32",
                  "qkv_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "A_log_ptr": "*fp32",
                  "dt_bias_ptr": "*bf16", "out_ptr": "*bf16", "parent_ptr": "*i32",
                  "proj_ptr": "*fp32"}
# state: (checkpoint / u ring, fold copy, k ring, has a fold copy)
GDN_STATES = {"fp32": ("*fp32", "*fp32", "*fp32", False), "bf16": ("*bf16", "*bf16", "*bf16", False),
              "bf16+fp32 copy": ("*bf16", "*fp32", "*fp32", True)}
# (MODE, T, BLOCK_S, TREE): decode, and a verify of 4 drafts as a chain and as a tree
FUSED_MODES = {"decode": (0, 1, L, False), "verify T=4": (1, 4, 32, False),
               "verify tree T=4": (1, 4, 32, True)}


def gdn_fused_case(state, mode, block=32):
    ck, fold, kring, has_fold = GDN_STATES[state]
    m, t, block_s, tree = FUSED_MODES[mode]
    return (gdn._gdn_replay_kernel,
            dict(GDN_FUSED_PTRS, ckpt_ptr=ck, fold_ptr=fold, kbuf_ptr=kring, ubuf_ptr=ck),
            {"T": t, "MODE": m, "TREE": tree, "PROJECTED": False, "BLOCK_S": block_s,
             "BLOCK_V": block, "BLOCK_K": 128,
             "USE_QK_L2NORM": True, "HAS_FOLD_COPY": has_fold, "STORAGE_ORDER": False,
             "DOT_PRECISION": "tf32x3"})


def mamba2_fused_case(state, mode, reconstruct=False, block=32):
    m, t, block_s, tree = FUSED_MODES[mode]
    return (m2._mamba2_replay_kernel, dict(MAMBA2_PTRS, ckpt_ptr=f"*{state}", fold_ptr=f"*{state}"),
            {"T": t, "MODE": m, "TREE": tree, "PROJECTED": False, "BLOCK_S": block_s,
             "BLOCK_P": block, "BLOCK_N": N,
             "RECONSTRUCT": reconstruct, "HAS_FOLD_COPY": False, "HAS_D": True, "HAS_Z": False,
             "HAS_DT_BIAS": True, "DT_SOFTPLUS": True, "STORAGE_ORDER": True,
             "DOT_PRECISION": "tf32x3"})


def gdn_fused():
    """The fused kernel, decode and verify, single and dual precision."""
    for state in GDN_STATES:
        for mode in FUSED_MODES:
            for block in (32, 64):
                for nw in (2, 4, 8):
                    report(f"GDN fused {mode} {state} block={block}",
                           *gdn_fused_case(state, mode, block), nw)


def mamba2_fused():
    """The fused kernel, decode and verify, both routes (ring in storage
    order, as below batch 8)."""
    for sdt in ("fp32", "bf16"):
        for mode in FUSED_MODES:
            for reconstruct in (False, True):
                for block in (16, 32):
                    for nw in (2, 4):
                        report(f"fused {mode} {sdt} reconstruct={reconstruct} block={block}",
                               *mamba2_fused_case(sdt, mode, reconstruct, block), nw)


def check() -> int:
    """Exit status 1 if an output-only fused decode or verify kernel, or a
    split route's projection (A) with the fold in it, converts a state tile
    to an MMA layout outside its flush branch (the launch shapes of the
    defaults: block 32, 4 warps; (A) with fold_cols 32 and 0 = one chunk).
    The reconstruct route and the flush-only launch need the tile in that
    layout by design."""
    bad = 0
    for state in ("fp32", "bf16"):
        cases = {}
        for mode in FUSED_MODES:
            cases[f"GDN fused {mode} {state}"] = gdn_fused_case(state, mode)
            cases[f"Mamba-2 fused {mode} {state}"] = mamba2_fused_case(state, mode)
        for cols in (32, 128):
            for outputs in (False, True):
                tag = " + outputs" if outputs else ""
                cases[f"GDN (A){tag} fold_cols={cols} {state}"] = gdn_projection_case(
                    state, cols, outputs=outputs)
                cases[f"Mamba-2 (A){tag} fold_cols={cols} {state}"] = mamba2_projection_case(
                    state, cols, outputs=outputs)
        for name, (fn, ptrs, consts) in cases.items():
            tiles = unconditional_mma_tiles(compile_sm90(fn, ptrs, consts, 4).asm["ttgir"])
            print(f"{name:<36} {'tiles to MMA layout on every step: ' + ' '.join(tiles) if tiles else 'ok'}")
            bad += bool(tiles)
    return 1 if bad + spilling_defaults() else 0


def spilling_defaults() -> int:
    """How many fused verify / flush-only launches at the launchers' default
    config for a serving batch (256) spill registers on sm_90 (printed); the
    verify modes also as the split verify route's (B) (``PROJECTED``, no
    state tile). Until 2026-12-04 they took decode's 64 rows / 2 warps there:
    verify T=4 spilled 1.7-2.9 KB a thread."""
    modes = {"verify T=4": FUSED_MODES["verify T=4"],
             "verify tree T=4": FUSED_MODES["verify tree T=4"], "flush": (MODE_FLUSH, 0, L, False)}
    modes.update({f"{k} (B)": v for k, v in modes.items() if k != "flush"})
    bad = 0
    for state, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for mode, (m, t, block_s, tree) in modes.items():
            for fam in ("GDN", "Mamba-2"):
                if fam == "GDN":
                    cfg = gdn.default_config(128, 128, dtype, 256, mode=m)
                    fn, ptrs, consts = gdn_fused_case(state, "decode", cfg.block)
                else:
                    cfg = m2.default_config(P, N, dtype, 256, mode=m)
                    fn, ptrs, consts = mamba2_fused_case(state, "decode", block=cfg.block)
                consts = dict(consts, MODE=m, T=t, TREE=tree, BLOCK_S=block_s,
                              STORAGE_ORDER=cfg.storage_order, PROJECTED=mode.endswith("(B)"))
                _, spill = resources(compile_sm90(fn, ptrs, consts, cfg.num_warps))
                name = f"{fam} {mode} {state} at block {cfg.block}, {cfg.num_warps} warps"
                print(f"{name:<44} {'ok' if spill == 0 else f'{spill} B spilled'}")
                bad += spill != 0
    return bad


def main():
    which = sys.argv[1:] or ["mamba2", "gdn"]
    if which == ["check"]:
        raise SystemExit(check())
    if "mamba2" in which:
        mamba2()
        mamba2_fused()
    if "gdn" in which:
        gdn_split()
        gdn_fused()


if __name__ == "__main__":
    main()
