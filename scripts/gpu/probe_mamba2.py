#!/usr/bin/env python3
"""Diagnostics for the Mamba-2 decode kernel on the GPU (not a benchmark of
record): register/shared-memory footprint, per-phase step times (empty
buffer, half full, flush step), a read-only roofline kernel and decode-kernel
variants (state load hoisted before the cursor loads; fold by a loop of FMA
outer products over ring entries read one at a time; fold in a second
launch). Prints JSON lines; results go to benchmarks/NOTES.md by hand.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_kernels import Timer, copy_bandwidth  # noqa: E402

from sglang_replayssm.kernels import mamba2_replay as m  # noqa: E402
from sglang_replayssm.kernels.common import LaunchConfig, softplus  # noqa: E402
from sglang_replayssm.kernels.cursors import MODE_DECODE, commit, required_capacity  # noqa: E402

H, P, N, G = 128, 64, 128, 8


@triton.jit
def _read_roofline(ckpt_ptr, slot_ptr, C_ptr, out_ptr, s_slot, s_head, s_p, s_C_row, s_C_g,
                   hpg, BLOCK_P: tl.constexpr, N: tl.constexpr):
    pid_p = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, N)
    h = tl.load(ckpt_ptr + slot * s_slot + head * s_head + offs_p[:, None] * s_p + offs_n[None, :])
    c = tl.load(C_ptr + row * s_C_row + (head // hpg) * s_C_g + offs_n).to(tl.float32)
    y = tl.sum(h.to(tl.float32) * c[None, :], axis=1)
    tl.store(out_ptr + (row * 128 + head) * 64 + offs_p, y)


@triton.jit
def _probe_decode(ckpt_ptr, xbuf_ptr, bbuf_ptr, dtbuf_ptr, fill_ptr, origin_ptr, slot_ptr,
                  x_ptr, dt_ptr, B_ptr, C_ptr, A_ptr, D_ptr, dtb_ptr, out_ptr,
                  hpg, buffer_len, capacity,
                  s_ck_slot, s_ck_head, s_ck_p, s_xb_slot, s_xb_head, s_xb_pos,
                  s_bb_slot, s_bb_group, s_bb_pos, s_db_slot, s_db_head,
                  s_x_row, s_x_head, s_dt_row, s_B_row, s_B_group, s_C_row, s_o_row, s_o_head,
                  BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, N: tl.constexpr,
                  HOIST: tl.constexpr, FOLD: tl.constexpr):
    # FOLD: 0 = tl.dot fold in the flush row's program; 1 = FMA outer products,
    # one ring entry at a time; 2 = no fold here (second launch), every row
    # appends its token (capacity >= buffer_len)
    pid_p = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:
        return
    group = head // hpg
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, N)
    offs_s = tl.arange(0, BLOCK_S)
    ck_off = slot * s_ck_slot + head * s_ck_head + offs_p[:, None] * s_ck_p + offs_n[None, :]
    if HOIST:
        h = tl.load(ckpt_ptr + ck_off).to(tl.float32)
    C_q = tl.load(C_ptr + row * s_C_row + group * N + offs_n).to(tl.float32)
    x_q = tl.load(x_ptr + row * s_x_row + head * s_x_head + offs_p).to(tl.float32)
    B_q = tl.load(B_ptr + row * s_B_row + group * s_B_group + offs_n).to(tl.float32)
    A = tl.load(A_ptr + head)
    dt_q = softplus(tl.load(dt_ptr + row * s_dt_row + head).to(tl.float32)
                    + tl.load(dtb_ptr + head).to(tl.float32))
    fill = tl.load(fill_ptr + slot)
    origin = tl.load(origin_ptr + slot)
    is_hist = offs_s < fill
    is_cur = offs_s == fill
    ring = origin + offs_s
    ring = tl.where(ring >= capacity, ring - capacity, ring)
    dt_h = tl.load(dtbuf_ptr + slot * s_db_slot + head * s_db_head + ring, mask=is_hist, other=0.0)
    dt = tl.where(is_cur, dt_q, dt_h)
    cum = tl.cumsum(dt * A, axis=0)
    xs = tl.load(xbuf_ptr + slot * s_xb_slot + head * s_xb_head + ring[:, None] * s_xb_pos
                 + offs_p[None, :], mask=is_hist[:, None], other=0.0).to(tl.float32)
    xs += tl.where(is_cur[:, None], x_q[None, :], 0.0)
    Bs = tl.load(bbuf_ptr + slot * s_bb_slot + group * s_bb_group + ring[:, None] * s_bb_pos
                 + offs_n[None, :], mask=is_hist[:, None], other=0.0).to(tl.float32)
    Bs += tl.where(is_cur[:, None], B_q[None, :], 0.0)
    if not HOIST:
        h = tl.load(ckpt_ptr + ck_off).to(tl.float32)
    cum_q = tl.sum(tl.where(is_cur, cum, 0.0), axis=0)
    w = tl.where(offs_s <= fill, tl.exp(tl.minimum(cum_q - cum, 0.0)) * dt, 0.0)
    flush = fill + 1 >= buffer_len
    if FOLD == 0 and flush:
        h = h * tl.exp(cum_q) + tl.dot(tl.trans(xs * w[:, None]), Bs, input_precision="tf32x3")
        tl.store(ckpt_ptr + ck_off, h.to(ckpt_ptr.dtype.element_ty))
        y = tl.sum(h * C_q[None, :], axis=1)
    elif FOLD == 1 and flush:
        h = h * tl.exp(cum_q)
        run = 0.0
        for s in range(0, buffer_len - 1):  # a decode flush row has fill == L - 1
            r = origin + s
            r = tl.where(r >= capacity, r - capacity, r)
            d = tl.load(dtbuf_ptr + slot * s_db_slot + head * s_db_head + r)
            run += d * A
            ws = tl.exp(tl.minimum(cum_q - run, 0.0)) * d
            xv = tl.load(xbuf_ptr + slot * s_xb_slot + head * s_xb_head + r * s_xb_pos
                         + offs_p).to(tl.float32)
            bv = tl.load(bbuf_ptr + slot * s_bb_slot + group * s_bb_group + r * s_bb_pos
                         + offs_n).to(tl.float32)
            h += (xv * ws)[:, None] * bv[None, :]
        h += (x_q * dt_q)[:, None] * B_q[None, :]
        tl.store(ckpt_ptr + ck_off, h.to(ckpt_ptr.dtype.element_ty))
        y = tl.sum(h * C_q[None, :], axis=1)
    else:
        cb = tl.sum(Bs * C_q[None, :], axis=1)
        y = tl.exp(cum_q) * tl.sum(h * C_q[None, :], axis=1) + tl.sum(xs * (w * cb)[:, None], axis=0)
    y += tl.load(D_ptr + head).to(tl.float32) * x_q
    tl.store(out_ptr + row * s_o_row + head * s_o_head + offs_p, y.to(out_ptr.dtype.element_ty))
    if FOLD == 2:
        write = True
    else:
        write = fill + 1 < buffer_len
    if write:
        rq = origin + fill
        rq = tl.where(rq >= capacity, rq - capacity, rq)
        tl.store(xbuf_ptr + slot * s_xb_slot + head * s_xb_head + rq * s_xb_pos + offs_p,
                 x_q.to(xbuf_ptr.dtype.element_ty))
        if pid_p == 0:
            tl.store(dtbuf_ptr + slot * s_db_slot + head * s_db_head + rq, dt_q)
            if head % hpg == 0:
                tl.store(bbuf_ptr + slot * s_bb_slot + group * s_bb_group + rq * s_bb_pos + offs_n,
                         B_q.to(bbuf_ptr.dtype.element_ty))


@triton.jit
def _probe_flush(ckpt_ptr, xbuf_ptr, bbuf_ptr, dtbuf_ptr, fill_ptr, origin_ptr, slot_ptr, A_ptr,
                 hpg, buffer_len, capacity, s_ck_slot, s_ck_head, s_ck_p, s_xb_slot, s_xb_head,
                 s_xb_pos, s_bb_slot, s_bb_group, s_bb_pos, s_db_slot, s_db_head,
                 BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, N: tl.constexpr):
    """Second launch: rows whose buffer the decode step filled fold it all."""
    pid_p = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:
        return
    fill = tl.load(fill_ptr + slot)
    if fill + 1 < buffer_len:
        return
    origin = tl.load(origin_ptr + slot)
    group = head // hpg
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, N)
    offs_s = tl.arange(0, BLOCK_S)
    live = offs_s <= fill
    ring = origin + offs_s
    ring = tl.where(ring >= capacity, ring - capacity, ring)
    A = tl.load(A_ptr + head)
    dt = tl.load(dtbuf_ptr + slot * s_db_slot + head * s_db_head + ring, mask=live, other=0.0)
    cum = tl.cumsum(dt * A, axis=0)
    total = tl.sum(dt * A, axis=0)
    w = tl.where(live, tl.exp(tl.minimum(total - cum, 0.0)) * dt, 0.0)
    xs = tl.load(xbuf_ptr + slot * s_xb_slot + head * s_xb_head + ring[:, None] * s_xb_pos
                 + offs_p[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    Bs = tl.load(bbuf_ptr + slot * s_bb_slot + group * s_bb_group + ring[:, None] * s_bb_pos
                 + offs_n[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    ck_off = slot * s_ck_slot + head * s_ck_head + offs_p[:, None] * s_ck_p + offs_n[None, :]
    h = tl.load(ckpt_ptr + ck_off).to(tl.float32)
    h = h * tl.exp(total) + tl.dot(tl.trans(xs * w[:, None]), Bs, input_precision="tf32x3")
    tl.store(ckpt_ptr + ck_off, h.to(ckpt_ptr.dtype.element_ty))


def kstats(jitfn):
    out = []
    for dev_cache in jitfn.device_caches.values():
        for k in dev_cache[0].values():
            try:
                k._init_handles()
            except Exception:
                pass
            out.append(dict(regs=k.n_regs, spills=k.n_spills, shared=k.metadata.shared,
                            warps=k.metadata.num_warps,
                            consts={str(n): v for n, v in (k.src.constants.items()
                                                           if hasattr(k.src, "constants") else [])
                                    if isinstance(v, (int, bool))}))
    return out


def main():
    dev = "cuda"
    torch.manual_seed(0)
    S, L = 512, 16
    timer = Timer(rep_ms=40)
    bw = copy_bandwidth()
    print(json.dumps(dict(copy_TBps=bw / 1e12)), flush=True)
    results = []

    def emit(**kw):
        results.append(kw)
        print(json.dumps(kw), flush=True)

    for sdt in (torch.float32, torch.bfloat16):
        state = (torch.randn(S, H, P, N, device=dev) * 0.1).to(sdt)
        cap = required_capacity(L, 1)
        xb = torch.randn(S, H, cap, P, device=dev).to(torch.bfloat16)
        bb = torch.randn(S, G, cap, N, device=dev).to(torch.bfloat16)
        db = torch.rand(S, H, cap, device=dev) * 0.1
        fill = torch.zeros(S, dtype=torch.int32, device=dev)
        origin = torch.zeros(S, dtype=torch.int32, device=dev)
        A_h = -torch.rand(H, device=dev) - 0.05
        D_h = torch.randn(H, device=dev).to(torch.bfloat16)
        dtb_h = (torch.randn(H, device=dev) * 0.5).to(torch.bfloat16)
        es = state.element_size()
        for b in (256, 1):
            idx = torch.randperm(S, device=dev)[:b].to(torch.int32)
            conv = torch.randn(b, H * P + 2 * G * N, device=dev).to(torch.bfloat16)
            x_, B_, C_ = torch.split(conv, [H * P, G * N, G * N], dim=-1)
            x, B, C = x_.view(b, H, P), B_.view(b, G, N), C_.view(b, G, N)
            dt_raw = torch.randn(b, H, device=dev).to(torch.bfloat16)
            out = torch.empty_like(x)
            A_e = A_h[:, None, None].expand(-1, P, N)
            D_e, dtb_e = D_h[:, None].expand(-1, P), dtb_h[:, None].expand(-1, P)
            dt_e = dt_raw[:, :, None].expand(-1, -1, P)
            state_bytes = b * H * P * N * es
            tag = dict(dtype=str(sdt).split(".")[-1], batch=b)

            def real(cfg):
                return lambda: m.mamba2_replay_decode(
                    state, xb, bb, db, fill, origin, idx, x, dt_e, A_e, B, C, buffer_len=L,
                    D=D_e, dt_bias=dtb_e, out=out, config=cfg)

            def cmt():
                commit(fill, origin, idx, mode=MODE_DECODE, buffer_len=L, capacity=cap)

            def cycle_us(step):
                fill.zero_(); origin.zero_()
                us = timer.per_step_us([lambda: (step(), cmt())] * L)
                fill.zero_(); origin.zero_()
                return us

            def fixed_us(step, f):
                fill.fill_(f); origin.zero_()
                us = timer.per_step_us([step] * 4)
                fill.zero_()
                return us

            cfgs = [(64, 1), (64, 2), (64, 4), (32, 1), (32, 2), (32, 4), (16, 2)]
            for blk, nw in cfgs:
                cfg = LaunchConfig(blk, nw)
                fn = real(cfg)
                emit(kind="real", **tag, block=blk, warps=nw, cycle_us=cycle_us(fn),
                     fill0_us=fixed_us(fn, 0), fill8_us=fixed_us(fn, 8),
                     flush_us=fixed_us(fn, L - 1))
            # roofline: read the state, one reduction, nothing else
            for blk, nw in ((64, 1), (64, 2), (64, 4), (32, 2), (32, 4)):
                yo = torch.empty(b, H, P, device=dev)
                fn = lambda blk=blk, nw=nw: _read_roofline[(P // blk, H, b)](
                    state, idx, C, yo, state.stride(0), state.stride(1), state.stride(2),
                    C.stride(0), C.stride(1), H // G, BLOCK_P=blk, N=N, num_warps=nw)
                us = timer.per_step_us([fn] * 4)
                emit(kind="roofline", **tag, block=blk, warps=nw, us=us,
                     bw_frac=state_bytes / (us * 1e-6) / bw)

            def probe(blk, nw, hoist, fold):
                dtv = dt_raw

                def fn():
                    _probe_decode[(P // blk, H, b)](
                        state, xb, bb, db, fill, origin, idx, x, dtv, B, C, A_h, D_h, dtb_h, out,
                        H // G, L, cap, state.stride(0), state.stride(1), state.stride(2),
                        xb.stride(0), xb.stride(1), xb.stride(2), bb.stride(0), bb.stride(1),
                        bb.stride(2), db.stride(0), db.stride(1), x.stride(0), x.stride(1),
                        dtv.stride(0), B.stride(0), B.stride(1), C.stride(0), out.stride(0),
                        out.stride(1), BLOCK_S=16, BLOCK_P=blk, N=N, HOIST=hoist, FOLD=fold,
                        num_warps=nw)
                    if fold == 2:
                        _probe_flush[(P // blk, H, b)](
                            state, xb, bb, db, fill, origin, idx, A_h, H // G, L, cap,
                            state.stride(0), state.stride(1), state.stride(2), xb.stride(0),
                            xb.stride(1), xb.stride(2), bb.stride(0), bb.stride(1), bb.stride(2),
                            db.stride(0), db.stride(1), BLOCK_S=16, BLOCK_P=blk, N=N,
                            num_warps=nw)
                return fn

            # correctness of the probe variants vs the real kernel over 2 cycles
            if b == 256:
                for hoist, fold in ((0, 0), (1, 0), (1, 1), (1, 2)):
                    s0 = state.clone(); xb0 = xb.clone(); bb0 = bb.clone(); db0 = db.clone()
                    fill.zero_(); origin.zero_()
                    ref_out, ref_state = [], None
                    f_real = real(LaunchConfig(64, 2))
                    for _ in range(2 * L):
                        f_real(); cmt(); ref_out.append(out.float().clone())
                    ref_state = state.float().clone()
                    state.copy_(s0); xb.copy_(xb0); bb.copy_(bb0); db.copy_(db0)
                    fill.zero_(); origin.zero_()
                    f_p = probe(64, 2, hoist, fold)
                    err = 0.0
                    for t in range(2 * L):
                        f_p(); cmt()
                        err = max(err, (out.float() - ref_out[t]).abs().max().item())
                    serr = (state.float() - ref_state).abs().max().item()
                    state.copy_(s0); xb.copy_(xb0); bb.copy_(bb0); db.copy_(db0)
                    fill.zero_(); origin.zero_()
                    emit(kind="probe_check", **tag, hoist=hoist, fold=fold, out_err=err,
                         state_err=serr)
            for blk, nw in ((64, 1), (64, 2), (64, 4), (32, 2), (32, 4)):
                for hoist, fold in ((0, 0), (1, 0), (1, 1), (0, 1), (1, 2)):
                    fn = probe(blk, nw, hoist, fold)
                    emit(kind="probe", **tag, block=blk, warps=nw, hoist=hoist, fold=fold,
                         cycle_us=cycle_us(fn), fill8_us=fixed_us(fn, 8),
                         flush_us=fixed_us(fn, L - 1))
            del conv, x_, B_, C_
        for name, jf in (("real", m._mamba2_replay_kernel), ("probe", _probe_decode),
                         ("flush", _probe_flush), ("roofline", _read_roofline)):
            for st in kstats(jf):
                emit(kind="kstats", kernel=name, **st)
        del state, xb, bb, db
        torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out_dir, "probe_mamba2.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"probe done in {time.time() - t0:.0f}s")
