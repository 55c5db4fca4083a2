#!/usr/bin/env python3
"""Kernel benchmark: ReplaySSM decode vs SGLang 0.5.17's stock decode kernels,
side by side in one run, timed as the server runs them.

``--family mamba2`` (default). Stock arms, each called the way SGLang calls
it at decode (NemotronH: z=None, A fp32 [H,P,N] and D/dt_bias [H,P] expanded
with stride 0, dt [b,H,P] with stride 0, x/B/C views of one conv-output row,
int32 slot indices):
  * triton     -- ssu_dispatch.TritonSSUBackend     (--mamba-backend triton, default)
  * flashinfer -- ssu_dispatch.FlashInferSSUBackend (--mamba-backend flashinfer)

``--family gdn`` (Gated DeltaNet: Qwen3-Next, Qwen3.5). Arms, each called the
way SGLang's GDN backend calls it at decode (gdn_backend.py forward_decode ->
gdn_triton.py TritonGDNKernel.packed_decode: post-conv ``mixed_qkv`` [b,
2HK+HV*V] bf16, ``a``/``b`` [b, HV] bf16, ``A_log`` [HV] fp32, ``dt_bias``
[HV] bf16, scale K^-0.5, pool [S, HV, V, K], out [b, 1, HV, V] bf16, int32
slot indices, q/k L2 norm in the kernel):
  * triton        -- fused_recurrent_gated_delta_rule_packed_decode (the default
                     --linear-attn-decode-backend triton; the stock reference)
  * sglang_replay -- SGLang's own ReplaySSM decode (--enable-linear-replayssm):
                     fused_recurrent_gdn_replayssm_decode with its pool's
                     d/k (state dtype) and g (fp32) rings of L entries, per-row
                     write_pos and force_flush cursors
  * ours          -- gdn_replay_decode + cursors.commit(MODE_DECODE): k ring bf16,
                     u ring fp32 for an fp32 state (parity) / bf16 for bf16, g fp32;
                     route output_only (the fused kernel, default) or split
                     (projection, outputs, persistent fold: ``--routes
                     output_only,split``)

Timing. Every arm runs a *whole buffer cycle* of L consecutive steps captured
in one CUDA graph (ReplaySSM: L-1 plain steps + 1 flush step, each followed by
the once-per-step cursor commit; stock: L identical steps), with a read of a
256 MiB buffer before every step so each step starts with a cold L2 as in a
real model, where the other layers' states evict it. The same graph of L
L2-flushes alone is timed and subtracted. Reported ``us`` = per step,
amortised over the cycle (median of ``triton.testing.do_bench`` replays).
The commit kernel runs once per step for the whole model, not per layer:
``commit_us`` is reported on its own and ``us`` (ReplaySSM) includes
``commit_us / ssm_layers`` of the model. (GDN: how SGLang's ReplaySSM cursors
are driven is in the JSON ``timing`` note.)

Bandwidth: bytes each kernel must move per step (state, buffer entries,
inputs, outputs), over time, as a fraction of a device-to-device copy
measured in the same run.

Writes benchmarks/results/kernels_<family>.{json,md,png} (docs/RESULTS.md format).
``--dry-run`` runs the whole script on CPU (Triton interpreter, tiny shapes,
each graph replaced by one eager pass, no timing) to catch shape/API bugs.

usage: python scripts/bench_kernels.py [--family mamba2|gdn]
         [--batches 1,8,32,64,128,256,512] [--buffer-lens 8,16,32]
         [--shapes nemotron-h-8b,...] [--sweep] [--dry-run]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import sys
import time
import traceback

if "--dry-run" in sys.argv[1:]:
    # Triton decides interpreter vs compiler when it is imported and when each
    # kernel is decorated: set it before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
from triton.testing import do_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from provenance import provenance  # noqa: E402
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), default="mamba2")
    ap.add_argument("--shapes", default=None, help="default: every shape of the family")
    ap.add_argument("--batches", default="1,8,32,64,128,256,512")
    ap.add_argument("--state-dtypes", default="float32,bfloat16")
    ap.add_argument("--buffer-lens", default="8,16,32",
                    help="buffer lengths for the first shape; other shapes use --main-buffer-len")
    ap.add_argument("--main-buffer-len", type=int, default=16)
    ap.add_argument("--routes", default=None,
                    help="routes timed for the first shape at --main-buffer-len "
                         "(mamba2 default: output_only,reconstruct; also: split; gdn default: "
                         "auto = output_only; also: split)")
    ap.add_argument("--split-config", default="",
                    help="split route (both families): SplitConfig fields overriding the "
                         "default, e.g. out_heads=16,out_warps=4,fold_programs=528,fold_dot=0 "
                         "(--sweep sweeps block/num_warps of its projection kernel); several "
                         "alternatives separated by ';' time one split arm each, e.g. "
                         "'fold_programs=264;fold_programs=1056' ('' = the default)")
    ap.add_argument("--u-buffer-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="gdn: dtype of our u ring (auto: float32 for an fp32 state, else bf16)")
    ap.add_argument("--k-buffer-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="gdn: dtype of our (L2-normalised) key ring (auto: as the u ring; a "
                         "bf16 key ring costs fp32 parity ~1e-3, measured in the CPU dry run)")
    ap.add_argument("--gdn-fold-copy", action="store_true",
                    help="gdn: with a non-fp32 state, ReplaySSM arms also keep the fp32 fold "
                         "copy (dual precision: raw v/beta rings, fp32 key ring, u recomputed "
                         "at every flush); the comparators are unchanged")
    ap.add_argument("--slots", type=int, default=512, help="pool slots (>= largest batch)")
    ap.add_argument("--sweep", action="store_true",
                    help="first sweep launch configs (block, num_warps; the fused route also "
                         "the ring order) at the --sweep-batches")
    ap.add_argument("--sweep-batches", default="256",
                    help="batches the --sweep runs at; a batch >= 32 tunes every batch >= 32, "
                         "one below 32 the batches below 32 (the nearest swept one)")
    ap.add_argument("--stock", default="all",
                    help="stock backends to time, comma-separated (mamba2: triton,flashinfer; "
                         "gdn: triton), or 'all'; a diagnostic run may skip FlashInfer's JIT "
                         "build (~3 min cold) with --stock triton")
    ap.add_argument("--breakdown", action="store_true",
                    help="also record each ReplaySSM row's GPU time per kernel (torch "
                         "profiler over the cycle graph): mean, flush step (max), plain steps "
                         "(min)")
    ap.add_argument("--flush-phase", choices=["aligned", "staggered"], default="aligned",
                    help="cursors at the start of the timed cycle: 'aligned' = every row "
                         "empty, so all rows flush at the same step (a batch admitted at "
                         "once); 'staggered' = row i starts at fill i %% L, so 1/L of the "
                         "rows flush at every step (a batch admitted over time, or a pool "
                         "that staggers first flushes). Every row still runs L-1 plain "
                         "steps and one flush step per cycle")
    ap.add_argument("--rep-ms", type=float, default=60)
    ap.add_argument("--deadline-s", type=float, default=520)
    ap.add_argument("--out-dir", default=None, help="default: benchmarks/results "
                    "(--dry-run: a temporary folder)")
    ap.add_argument("--name", default=None, help="default: kernels_<family>")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU smoke test: interpreter, tiny shapes, no timing")
    args = ap.parse_args()
    args.name = args.name or f"kernels_{args.family}"
    if args.out_dir is None:
        args.out_dir = (os.path.join("/tmp", "bench_kernels_dry_run") if args.dry_run
                        else os.path.join(ROOT, "benchmarks", "results"))
    return args


# --------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------

class Timer:
    """Per-step time of a cycle of steps replayed from one CUDA graph, each
    step preceded by an L2 flush (a read of a buffer larger than L2)."""

    def __init__(self, rep_ms):
        self.rep_ms = rep_ms
        self.l2 = torch.empty(64 * 2**20, dtype=torch.float32, device="cuda")  # 256 MiB
        self.l2.uniform_()
        self.sink = torch.empty((), dtype=torch.float32, device="cuda")
        self._flush_cache = {}
        self._flush_names = None

    def flush_l2(self):
        torch.sum(self.l2, dim=0, out=self.sink)

    def _capture(self, fns):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for fn in fns:  # warm-up: exactly one cycle (keeps cursors aligned)
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for fn in fns:
                self.flush_l2()
                fn()
        torch.cuda.synchronize()
        return g

    def _graph_ms(self, fns):
        g = self._capture(fns)
        ms = do_bench(g.replay, warmup=10, rep=self.rep_ms, return_mode="median")
        del g
        return ms

    def breakdown(self, fns, replays=4):
        """GPU time of each kernel of the cycle graph, from the torch profiler
        (CUPTI traces the kernels inside a graph one by one), the L2 flush's
        own kernel left out: [{name, calls (per cycle), mean_us, min_us,
        max_us, us_per_step}], longest first. min/max separate the flush step
        from the plain ones (e.g. the split fold's scan-only launches)."""
        if self._flush_names is None:
            self._flush_names = set(self._kernel_durations([lambda: None], 1))
        durs = self._kernel_durations(fns, replays)
        out = []
        for name, ds in durs.items():
            if name in self._flush_names:
                continue
            out.append(dict(name=name[:120], calls=len(ds) // replays,
                            mean_us=round(sum(ds) / len(ds), 2), min_us=round(min(ds), 2),
                            max_us=round(max(ds), 2),
                            us_per_step=round(sum(ds) / replays / len(fns), 2)))
        return sorted(out, key=lambda k: -k["us_per_step"])

    def _kernel_durations(self, fns, replays):
        import tempfile
        from torch.profiler import ProfilerActivity, profile
        g = self._capture(fns)
        g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                g.replay()
            torch.cuda.synchronize()
        del g
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f).get("traceEvents", [])
        durs = {}
        for ev in events:
            if ev.get("cat") == "kernel" and "dur" in ev:
                durs.setdefault(ev["name"], []).append(float(ev["dur"]))
        return durs

    def flush_only_ms(self, n):
        if n not in self._flush_cache:
            self._flush_cache[n] = self._graph_ms([lambda: None] * n)
        return self._flush_cache[n]

    def per_step_us(self, fns):
        ms = self._graph_ms(fns) - self.flush_only_ms(len(fns))
        return max(ms, 0.0) * 1e3 / len(fns)

    def eager_us(self, fn):
        """Wall time of host-driven work (syncs included), outside any graph."""
        return do_bench(fn, warmup=10, rep=self.rep_ms, return_mode="median") * 1e3


class DryTimer:
    """--dry-run: run every step once, eagerly; report a dummy 1 us."""

    def per_step_us(self, fns):
        for fn in fns:
            fn()
        return 1.0

    def eager_us(self, fn):
        fn()
        return 1.0

    def breakdown(self, fns):
        for fn in fns:
            fn()
        return []


def copy_bandwidth():
    n = 1 << 30
    a = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 4 / (ms * 1e-3)


def bytes_moved(traffic, b, L, replay):
    """traffic = (state bytes, bytes of one buffer entry per row, input/output
    bytes[, flush extra]) of a step. Stock: state read + written. ReplaySSM:
    state read every step, written every L-th; on average (L-1)/2 entries read
    and (L-1)/L written; flush extra (a fold copy read and written) every L-th."""
    state, entry, io, *flush_extra = traffic
    if not replay:
        return 2 * state + io
    mean_fill = (L - 1) / 2
    return (state * (1 + 1 / L) + b * entry * (mean_fill + (L - 1) / L) + io
            + sum(flush_extra) / L)


def set_flush_phase(pool, idx, L, phase):
    """Cursors of the timed cycle (--flush-phase): every row empty
    ('aligned'), or row i of the batch at fill i % L with its entries at
    ring positions 0 .. fill-1 ('staggered'). Either state recurs after L
    decode steps, so the warm-up cycle before capture leaves it as set."""
    pool["origin"].zero_()
    pool["fill"].zero_()
    if phase == "staggered":
        rows = torch.arange(idx.shape[0], device=idx.device, dtype=torch.int32)
        pool["fill"][idx.long()] = rows % L


def fmt(v, spec=".1f"):
    return "n/a" if v is None else format(v, spec)


def rnd(v, n):
    return None if v is None else round(v, n)


def rel_diff(ref, x):
    ref = ref.float()
    return (ref - x.float()).abs().max().item() / max(ref.abs().max().item(), 1e-6)


# --------------------------------------------------------------------------
# families: what differs between Mamba-2 and GDN
# --------------------------------------------------------------------------

class Family:
    """Per-family hooks used by the shared main loop and writer."""
    name = title = ""
    shapes: dict = {}
    dry_shapes: dict = {}            # tiny shapes for --dry-run
    stock_backends: tuple = ()
    default_routes = "auto"
    sweep_grid: tuple = ()           # (block, num_warps) candidates
    block_key = "block"              # name of the block size in sweep rows
    extra_arm_names: tuple = ()      # comparators beyond the stock backends (row keys)
    timing_note = ""
    parity_text = ""

    def __init__(self, args, dev, g, S):
        self.args, self.dev, self.g, self.S = args, dev, g, S

    def layers(self, shape):
        return self.shapes[shape][-1]

    def extra_versions(self):
        return {}

    def fail_key(self, shape):
        return shape

    def row_extra(self, pool):
        return {}

    def extra_arms(self, timer, shape, state, c, idx, L, sdt_t, b):
        """Further comparators for a row: {name: (us or None, bytes)}."""
        return {}

    def cfg_fits(self, cfg, shape):
        return True

    def route_config(self, cfg, route, shape, sdt_t, b):
        """The config a route is launched with, from a swept/default one. Split
        route: a SplitConfig whose projection tile is the swept or default
        (block, num_warps), other fields default or --split-config."""
        route, variant = self.split_variant(route)
        if route not in self.m.SPLIT_ROUTES:
            return cfg
        base = self.default_config(shape, sdt_t, b, route=route)
        if cfg is not None:
            base = dataclasses.replace(base, block=cfg.block, num_warps=cfg.num_warps)
        over = {}
        for kv in filter(None, variant.split(",")):
            k, v = kv.split("=")
            typ = type(getattr(base, k))  # AttributeError names a wrong field
            over[k] = bool(int(v)) if typ is bool else typ(v)
        return dataclasses.replace(base, **over)

    def split_variant(self, route):
        """``split#i`` (one arm per ';'-separated --split-config alternative)
        -> ("split", the i-th alternative); any other route -> (route, the
        only alternative)."""
        alts = self.args.split_config.split(";")
        if "#" in route:
            base, i = route.split("#")
            return base, alts[int(i)]
        return route, alts[0] if len(alts) == 1 else ""

    def route_name(self, route, b, sdt_t):
        if "#" in route:
            base, variant = self.split_variant(route)
            return f"{base}[{variant}]" if variant else base
        return self.m.default_route(b, sdt_t) if route == "auto" else route

    def check_text(self, c):
        route = f" {c['route']}" if c.get("route") else ""
        return f"b={c['batch']}{route}: {fmt(c.get('max_rel_diff_vs_stock_triton'), '.1e')}"

    def plot_series(self):
        return [("speedup", "", "-")]


class Mamba2(Family):
    name, title = "mamba2", "Mamba-2"
    # (nheads, headdim, dstate, ngroups, SSM layers of the full model)
    shapes = {
        "nemotron-h-8b": (128, 64, 128, 8, 24),
        "nemotron-3-nano-4b": (96, 80, 128, 8, 21),
        "nemotron-3-super-120b": (128, 64, 128, 8, 40),
    }
    dry_shapes = {"dry-mamba2": (4, 16, 16, 2, 4)}
    stock_backends = ("triton", "flashinfer")
    default_routes = "output_only,reconstruct"
    sweep_grid = ((64, 2), (64, 4), (32, 2), (32, 4))
    block_key = "block_p"
    parity_text = "Parity vs stock triton SSU (fp32 state, L+1 steps incl. a flush)"
    plot_ylabel = "speedup vs fastest stock SGLang backend"

    def setup(self, shapes, sdts):
        from sglang_replayssm.kernels import mamba2_replay as m
        from sglang_replayssm.kernels.cursors import MODE_DECODE, commit, required_capacity
        self.m, self.MODE_DECODE, self.commit, self.required_capacity = (
            m, MODE_DECODE, commit, required_capacity)
        from sglang.kernels.ops.mamba.triton_ops.ssu_dispatch import (FlashInferSSUBackend,
                                                                       TritonSSUBackend)
        self.backends = {"triton": TritonSSUBackend()}
        if "flashinfer" not in self.args.stock_names:
            return
        try:
            self.backends["flashinfer"] = FlashInferSSUBackend()
        except Exception as e:  # recorded per row as "unavailable"
            print(f"flashinfer SSU backend unavailable: {e!r}"[:300])
        if self.dev == "cuda":
            # headdim 80 (nemotron-3-nano-4b) does not build in FlashInfer 0.6.15 (static_assert)
            prebuild_flashinfer([self.shapes[s] for s in shapes if self.shapes[s][1] % 64 == 0],
                                [DTYPES[d] for d in sdts])

    def extra_versions(self):
        try:
            import flashinfer
            return {"flashinfer": flashinfer.__version__}
        except Exception:
            return {"flashinfer": None}

    def fail_key(self, shape):
        return self.shapes[shape][1]  # FlashInfer builds per headdim

    def make_state(self, shape, sdt_t):
        H, P, N, G, _ = self.shapes[shape]
        return (torch.randn(self.S, H, P, N, device=self.dev, generator=self.g) * 0.1).to(sdt_t)

    def inputs(self, shape, b, sdt_t):
        H, P, N, G, _ = self.shapes[shape]
        dev, g = self.dev, self.g
        A_h = -torch.rand(H, device=dev, generator=g) - 0.05
        D_h = torch.randn(H, device=dev, generator=g).to(torch.bfloat16)
        dtb_h = (torch.randn(H, device=dev, generator=g) * 0.5).to(torch.bfloat16)
        conv = torch.randn(b, H * P + 2 * G * N, device=dev, generator=g).to(torch.bfloat16)
        x_, B_, C_ = torch.split(conv, [H * P, G * N, G * N], dim=-1)
        dt_raw = torch.randn(b, H, device=dev, generator=g).to(torch.bfloat16)
        return dict(
            A=A_h[:, None, None].expand(-1, P, N), D=D_h[:, None].expand(-1, P),
            dt_bias=dtb_h[:, None].expand(-1, P), x=x_.view(b, H, P), B=B_.view(b, G, N),
            C=C_.view(b, G, N), dt=dt_raw[:, :, None].expand(-1, -1, P))

    def out_like(self, c, dtype=None):
        return torch.empty_like(c["x"], dtype=dtype)

    def stock_fn(self, name, state, c, idx, out):
        backend = self.backends[name]
        return lambda: backend(state, c["x"], c["dt"], c["A"], c["B"], c["C"], D=c["D"], z=None,
                               dt_bias=c["dt_bias"], dt_softplus=True,
                               state_batch_indices=idx, out=out)

    def replay_pool(self, shape, L, sdt_t, window=1):
        """Rings with room for ``window`` draft tokens (1: decode only)."""
        H, P, N, G, _ = self.shapes[shape]
        S, dev, g = self.S, self.dev, self.g
        cap = self.required_capacity(L, window)
        return dict(
            x_buffer=torch.randn(S, H, cap, P, device=dev, generator=g).to(torch.bfloat16),
            B_buffer=torch.randn(S, G, cap, N, device=dev, generator=g).to(torch.bfloat16),
            dt_buffer=torch.rand(S, H, cap, device=dev, generator=g) * 0.1,
            fill=torch.zeros(S, dtype=torch.int32, device=dev),
            origin=torch.zeros(S, dtype=torch.int32, device=dev), cap=cap)

    def replay_fns(self, shape, state, pool, c, idx, out, L, route, cfg=None):
        cfg = self.route_config(cfg, route, shape, state.dtype, idx.shape[0])
        route = self.split_variant(route)[0]

        def step():
            self.m.mamba2_replay_decode(
                state, pool["x_buffer"], pool["B_buffer"], pool["dt_buffer"], pool["fill"],
                pool["origin"], idx, c["x"], c["dt"], c["A"], c["B"], c["C"], buffer_len=L,
                D=c["D"], dt_bias=c["dt_bias"], out=out, route=route, config=cfg)

        def cmt():
            self.commit(pool["fill"], pool["origin"], idx, mode=self.MODE_DECODE, buffer_len=L,
                        capacity=pool["cap"])
        return step, cmt

    def traffic(self, shape, b, es, pool=None):
        H, P, N, G, _ = self.shapes[shape]
        ab = 2  # bf16 activations
        io = b * (2 * H * P * ab + 2 * G * N * ab + H * ab)  # x, y, B, C, dt
        state = b * H * P * N * es
        entry = H * P * ab + G * N * ab + H * 4
        return state, entry, io

    def parity(self, shape, state0, pool, c, idx, L, cfg, route="auto"):
        """ReplaySSM vs stock triton on the same stream of L+1 steps (fp32 state)."""
        st_stock = state0.clone()
        st_ours = state0.clone()
        pool["fill"].zero_()
        pool["origin"].zero_()
        worst = 0.0
        for _ in range(L + 1):
            # fp32 outputs: a bf16 output would turn 1e-6 differences into 1-ulp flips
            o1 = self.out_like(c, torch.float32)
            o2 = torch.empty_like(o1)
            self.stock_fn("triton", st_stock, c, idx, o1)()
            s, cm = self.replay_fns(shape, st_ours, pool, c, idx, o2, L, route, cfg)
            s()
            cm()
            ref = o1.float().abs().max().item()
            worst = max(worst, (o1.float() - o2.float()).abs().max().item() / max(ref, 1e-6))
        pool["fill"].zero_()
        pool["origin"].zero_()
        return dict(route=self.route_name(route, idx.shape[0], state0.dtype),
                    max_rel_diff_vs_stock_triton=worst)

    def default_config(self, shape, sdt_t, b, route="output_only"):
        H, P, N, G, _ = self.shapes[shape]
        return self.m.default_config(P, N, sdt_t, b, route=route, heads_per_group=H // G)

    def cfg_fits(self, cfg, shape):
        return cfg.block <= max(16, triton.next_power_of_2(self.shapes[shape][1]))

    def md_columns(self):
        return [
            ("shape", lambda r: r["shape"]), ("state", lambda r: r["state_dtype"]),
            ("L", lambda r: str(r["buffer_len"])), ("route", lambda r: r["route"]),
            ("batch", lambda r: str(r["batch"])),
            ("ReplaySSM µs", lambda r: fmt(r["us"])),
            ("triton µs", lambda r: fmt(r.get("stock_triton_us"))),
            ("flashinfer µs", lambda r: fmt(r.get("stock_flashinfer_us"))),
            ("speedup vs fastest",
             lambda r: f"**{fmt(r['speedup'], '.2f')}×** ({r['stock_backend']})"),
            ("vs triton", lambda r: f"{fmt(r.get('speedup_vs_triton'), '.2f')}×"),
            ("ReplaySSM % copy BW",
             lambda r: "n/a" if r["bw_frac"] is None else f"{100 * r['bw_frac']:.0f}%"),
            ("flashinfer % copy BW", lambda r: fmt(r.get("stock_flashinfer_bw_frac"), ".0%")),
        ]


class GDN(Family):
    name, title = "gdn", "Gated DeltaNet"
    # (k-heads H, v-heads HV, K, V, GDN layers of the full model).
    # qwen3-next-80b: 48 layers, every 4th full attention -> 36 GDN
    # (sglang/srt/configs/qwen3_next.py defaults). qwen3.5-4b: 32 layers, every
    # 4th full attention -> 24 GDN; qwen3.5-122b: 48 layers, 12 attention -> 36
    # GDN (model cards, not checked against the checkpoints' config.json; the
    # head counts of both are the brief's).
    shapes = {
        "qwen3-next-80b": (16, 32, 128, 128, 36),
        "qwen3.5-4b": (16, 32, 128, 128, 24),
        "qwen3.5-122b": (16, 64, 128, 128, 36),
    }
    dry_shapes = {"dry-gdn": (2, 4, 32, 32, 4)}
    stock_backends = ("triton",)
    default_routes = "auto"
    # 128 = a whole V head per program: twice the bytes in flight per program
    # for the split route's bf16 projection (A), which streams below copy rate
    # for the projection (A); 1-2 warps for the fused kernel at batch 1, where
    # 128 programs of 4 warps leave the SMs nearly idle and every reduction
    # over K crosses warps (a shared-memory round trip and a barrier each)
    sweep_grid = ((128, 4), (128, 8), (64, 2), (64, 4), (32, 2), (32, 4), (16, 4),
                  (32, 1), (16, 1), (16, 2))
    block_key = "block_v"
    extra_arm_names = ("sglang_replay", "sglang_replay_with_cursor")
    parity_text = ("Parity vs stock triton packed decode (fp32 state, fp32 out, L+1 steps "
                   "incl. a flush), max relative output difference")
    plot_ylabel = "speedup (solid: vs stock triton; dashed: vs SGLang ReplaySSM)"
    # SGLang's radix track interval (server_args.py mamba_track_interval = 256):
    # GDN force-flushes rows with seq_len % 256 == 0; the benchmark's rows are not
    # on a boundary (as on 255 of 256 steps).
    track_interval = 256
    timing_note = (
        "; GDN: SGLang's ReplaySSM kernel reads a per-row write_pos [b] and force_flush [b] "
        "(int32) that SGLang refreshes *eagerly, outside the CUDA graph* before every replay "
        "(hybrid_linear_attn_backend.py _replay_metadata: copy write_pos_buf[slots] into the "
        "captured static buffer, then advance the per-slot pool cursor with torch.where + "
        "torch.unique + scatter). The graph here holds the L steps of one cycle, step p "
        "reading its own static write_pos tensor filled with p (the value SGLang's eager "
        "refresh would have put there; all rows in phase, like our cursors; with "
        "--flush-phase staggered row i holds (p + i) % L, again like ours) and an all-zero "
        "force_flush (no radix track boundary). sglang_replay_us is that kernel alone; the "
        "eager refresh+advance, reproduced op for op, is timed on its own outside any graph "
        "(sglang_replay_cursor_us, wall time incl. its host syncs, once per step for the whole "
        "model) and sglang_replay_with_cursor_us adds it amortised over the model's GDN layers "
        "(as our commit_us is in us). Not counted: with the flag on SGLang also loses its "
        "fused state-index fast path in _replay_metadata")

    def setup(self, shapes, sdts):
        from sglang_replayssm.kernels import gdn_replay as m
        from sglang_replayssm.kernels.cursors import MODE_DECODE, commit, required_capacity
        self.m, self.MODE_DECODE, self.commit, self.required_capacity = (
            m, MODE_DECODE, commit, required_capacity)
        from sglang.kernels.ops.attention.fla import fused_recurrent as fr
        if self.dev == "cpu" and getattr(fr, "exp", None) is triton.language.exp:
            # --dry-run only: the interpreter patches tl.exp, not fla.op's alias of it
            fr.exp = lambda x: triton.language.exp(x)
        self._packed = fr.fused_recurrent_gated_delta_rule_packed_decode
        try:
            from sglang.kernels.ops.attention.fla.fused_recurrent_linear_replayssm import (
                fused_recurrent_gdn_replayssm_decode)
            self._sgl_replay = fused_recurrent_gdn_replayssm_decode
        except Exception as e:  # rows then carry sglang_replay_us = None
            print(f"SGLang ReplaySSM kernel unavailable: {e!r}"[:300])
            self._sgl_replay = None

    def make_state(self, shape, sdt_t):
        H, HV, K, V, _ = self.shapes[shape]
        return (torch.randn(self.S, HV, V, K, device=self.dev, generator=self.g) * 0.1).to(sdt_t)

    def inputs(self, shape, b, sdt_t):
        """What Qwen3NextGatedDeltaNet hands the attention backend: post-conv mixed_qkv,
        a/b from fused_qkvzba_split_reshape_cat (contiguous bf16), A_log (fp32 param),
        dt_bias (model-dtype param)."""
        H, HV, K, V, _ = self.shapes[shape]
        dev, g = self.dev, self.g
        A_log = torch.log(torch.rand(HV, device=dev, generator=g) * 0.95 + 0.05)
        dt_bias = (torch.randn(HV, device=dev, generator=g) * 0.5).to(torch.bfloat16)
        mixed_qkv = torch.randn(b, 2 * H * K + HV * V, device=dev,
                                generator=g).to(torch.bfloat16)
        a = torch.randn(b, HV, device=dev, generator=g).to(torch.bfloat16)
        beta_in = torch.randn(b, HV, device=dev, generator=g).to(torch.bfloat16)
        return dict(mixed_qkv=mixed_qkv, a=a, b=beta_in, A_log=A_log, dt_bias=dt_bias,
                    scale=K ** -0.5, H=H, HV=HV, K=K, V=V)

    def out_like(self, c, dtype=None):
        # TritonGDNKernel.packed_decode: mixed_qkv.new_empty(B, 1, HV, V)
        return c["mixed_qkv"].new_empty(c["mixed_qkv"].shape[0], 1, c["HV"], c["V"],
                                        dtype=dtype)

    def _gate_kwargs(self, c):
        return dict(mixed_qkv=c["mixed_qkv"], a=c["a"], b=c["b"], A_log=c["A_log"],
                    dt_bias=c["dt_bias"], scale=c["scale"])

    def stock_fn(self, name, state, c, idx, out):
        kw = self._gate_kwargs(c)
        return lambda: self._packed(**kw, initial_state=state, out=out, ssm_state_indices=idx,
                                    use_qk_l2norm_in_kernel=True)

    def u_dtype(self, sdt_t):
        if self.args.u_buffer_dtype != "auto":
            return DTYPES[self.args.u_buffer_dtype]
        return torch.float32 if sdt_t == torch.float32 else torch.bfloat16

    def k_dtype(self, sdt_t):
        if self.args.k_buffer_dtype != "auto":
            return DTYPES[self.args.k_buffer_dtype]
        if self.fold_copy(sdt_t):
            return torch.float32  # the fold needs the normalised keys unrounded
        return self.u_dtype(sdt_t)

    def fold_copy(self, sdt_t):
        return self.args.gdn_fold_copy and sdt_t != torch.float32

    def replay_pool(self, shape, L, sdt_t, window=1):
        """Rings with room for ``window`` draft tokens (1: decode only)."""
        H, HV, K, V, _ = self.shapes[shape]
        S, dev = self.S, self.dev
        cap = self.required_capacity(L, window)
        pool = dict(
            k_buffer=torch.zeros(S, H, cap, K, dtype=self.k_dtype(sdt_t), device=dev),
            u_buffer=torch.zeros(S, HV, cap, V, dtype=self.u_dtype(sdt_t), device=dev),
            g_buffer=torch.zeros(S, HV, cap, dtype=torch.float32, device=dev),
            fill=torch.zeros(S, dtype=torch.int32, device=dev),
            origin=torch.zeros(S, dtype=torch.int32, device=dev), cap=cap)
        if self.fold_copy(sdt_t):
            pool["fold"] = dict(
                checkpoint_fold=torch.zeros(S, HV, V, K, dtype=torch.float32, device=dev),
                v_buffer=torch.zeros(S, HV, cap, V, dtype=torch.bfloat16, device=dev),
                beta_buffer=torch.zeros(S, HV, cap, dtype=torch.float32, device=dev))
        return pool

    def replay_fns(self, shape, state, pool, c, idx, out, L, route, cfg=None):
        cfg = self.route_config(cfg, route, shape, state.dtype, idx.shape[0])
        route = self.split_variant(route)[0]
        out3 = out[:, 0]  # [b, HV, V] view of the [b, 1, HV, V] output

        def step():
            self.m.gdn_replay_decode(
                state, pool["k_buffer"], pool["u_buffer"], pool["g_buffer"], pool["fill"],
                pool["origin"], idx, c["mixed_qkv"], c["a"], c["b"], c["A_log"], c["dt_bias"],
                c["scale"], buffer_len=L, num_k_heads=c["H"], out=out3, route=route,
                config=cfg, **pool.get("fold", {}))

        def cmt():
            self.commit(pool["fill"], pool["origin"], idx, mode=self.MODE_DECODE, buffer_len=L,
                        capacity=pool["cap"])
        return step, cmt

    def traffic(self, shape, b, es, pool=None):
        """pool: ours ({k,u}_buffer) or SGLang's rings ({k,d}); None = stock."""
        H, HV, K, V, _ = self.shapes[shape]
        ab = 2  # bf16 activations
        io = b * ((2 * H * K + HV * V) * ab + 2 * HV * ab + HV * V * ab)  # qkv, a, b, out
        state = b * HV * V * K * es
        entry = 0
        if pool is not None:
            k_ring = pool["k_buffer"] if "k_buffer" in pool else pool["k"]
            u_ring = pool["u_buffer"] if "u_buffer" in pool else pool["d"]
            # k shared per k-head, u per v-head, g fp32 per v-head
            entry = H * K * k_ring.element_size() + HV * V * u_ring.element_size() + HV * 4
            if "fold" in pool:  # raw v (bf16) and beta (fp32) per v-head; the fp32
                # fold copy read and written by every flush
                entry += HV * V * 2 + HV * 4
                return state, entry, io, 2 * b * HV * V * K * 4
        return state, entry, io

    def row_extra(self, pool):
        return dict(u_buffer_dtype=str(pool["u_buffer"].dtype).replace("torch.", ""),
                    k_buffer_dtype=str(pool["k_buffer"].dtype).replace("torch.", ""),
                    fold_copy="float32" if "fold" in pool else None)

    # ---- SGLang's own ReplaySSM decode ----

    def sglang_rings(self, shape, L, sdt_t):
        """As MambaPool allocates them under --enable-linear-replayssm (memory_pool.py):
        d [slots, HV, L, V] and k [slots, H, L, K] in the SSM dtype, g [slots, HV, L]
        fp32, zeros; one layer's slice. write_pos: the pool's per-slot cursor."""
        H, HV, K, V, _ = self.shapes[shape]
        S, dev = self.S, self.dev
        return dict(d=torch.zeros(S, HV, L, V, dtype=sdt_t, device=dev),
                    k=torch.zeros(S, H, L, K, dtype=sdt_t, device=dev),
                    g=torch.zeros(S, HV, L, dtype=torch.float32, device=dev),
                    write_pos=torch.zeros(S, dtype=torch.int32, device=dev))

    def sglang_call(self, state, rings, c, idx, out, write_pos, force_flush):
        """TritonGDNKernel.packed_decode's ReplaySSM branch (gdn_triton.py)."""
        kw = self._gate_kwargs(c)
        return lambda: self._sgl_replay(
            **kw, initial_state=state, d_cache=rings["d"], k_cache=rings["k"],
            g_cache=rings["g"], out=out, ssm_state_indices=idx, write_pos=write_pos,
            force_flush=force_flush, use_qk_l2norm_in_kernel=True)

    def sglang_cursor_fn(self, rings, idx, L, static_wp, static_ff):
        """The per-step eager cursor work of HybridLinearAttnBackend._replay_metadata
        (decode, not capturing): snapshot the pool cursor of each row into the captured
        static buffer, refresh force_flush from seq_lens % mamba_track_interval, then
        advance the pool cursor (a flush, natural or forced, resets it to 0)."""
        dev, b = self.dev, idx.shape[0]
        wp_buf = rings["write_pos"]
        seq_lens_cpu = torch.full((b,), 1001, dtype=torch.int64)  # not a track boundary
        interval = self.track_interval

        def advance():
            slots = idx.to(torch.long)
            safe_slots = slots.clamp(min=0)
            static_wp[:b].copy_(wp_buf[safe_slots])
            ff_mask = ((seq_lens_cpu[:b].to(torch.int64) % interval) == 0).cpu()
            force_flush_dev = ff_mask.to(device=dev, dtype=torch.int32)
            static_ff.copy_(force_flush_dev)
            valid_mask = slots >= 0
            valid_slots = slots[valid_mask]
            if valid_slots.numel() > 0:
                cur_pos = wp_buf[safe_slots]
                flushed = (cur_pos == (L - 1)) | (force_flush_dev != 0)
                next_pos = torch.where(flushed, torch.zeros_like(cur_pos), (cur_pos + 1) % L)
                uniq_slots, inv = torch.unique(valid_slots, return_inverse=True)
                new_vals = torch.empty(uniq_slots.shape[0], dtype=wp_buf.dtype, device=dev)
                new_vals[inv] = next_pos[valid_mask].to(wp_buf.dtype)
                wp_buf[uniq_slots] = new_vals
        return advance

    def extra_arms(self, timer, shape, state, c, idx, L, sdt_t, b):
        if self._sgl_replay is None:
            raise RuntimeError("SGLang's ReplaySSM kernel could not be imported")
        rings = self.sglang_rings(shape, L, sdt_t)
        nbytes = bytes_moved(self.traffic(shape, b, state.element_size(), rings), b, L, True)
        out = self.out_like(c)
        zeros = torch.zeros(b, dtype=torch.int32, device=self.dev)
        # one static write_pos per phase of the cycle (see timing_note); with
        # --flush-phase staggered row i is at (p + i) % L, as our cursors are
        lag = (torch.arange(b, dtype=torch.int32, device=self.dev) % L
               if self.args.flush_phase == "staggered" else 0)
        wps = [(p + lag) % L + torch.zeros(b, dtype=torch.int32, device=self.dev)
               for p in range(L)]
        us_k = timer.per_step_us([self.sglang_call(state, rings, c, idx, out, wp, zeros)
                                  for wp in wps])
        static_wp = torch.zeros(b, dtype=torch.int32, device=self.dev)
        static_ff = torch.zeros(b, dtype=torch.int32, device=self.dev)
        us_cur = timer.eager_us(self.sglang_cursor_fn(rings, idx, L, static_wp, static_ff))
        nl = self.layers(shape)
        return {"sglang_replay": (us_k, nbytes),
                "sglang_replay_with_cursor": (us_k + us_cur / nl, nbytes),
                "_fields": dict(sglang_replay_cursor_us=round(us_cur, 2),
                                sglang_replay_ring_dtype=str(sdt_t).replace("torch.", ""))}

    # ---- parity ----

    def parity(self, shape, state0, pool, c, idx, L, cfg, route="auto"):
        """Ours (and SGLang's ReplaySSM) vs the stock packed decode on the same stream
        of L+1 steps from the same start state: fp32 state, fp32 out. Also the
        checkpoint after the cycle's flush (step L-1) vs the stock state."""
        res = {}
        slots = idx.long()
        st_stock = state0.clone()
        st_ours = state0.clone()
        pool["fill"].zero_()
        pool["origin"].zero_()
        outs = []
        ref_state = None
        worst = worst_state = 0.0
        for t in range(L + 1):
            o1 = self.out_like(c, torch.float32)
            o2 = torch.empty_like(o1)
            self.stock_fn("triton", st_stock, c, idx, o1)()
            s, cm = self.replay_fns(shape, st_ours, pool, c, idx, o2, L, route, cfg)
            s()
            cm()
            outs.append(o1)
            worst = max(worst, rel_diff(o1, o2))
            if t == L - 1:  # the cycle's flush step: the checkpoint holds the state
                ref_state = st_stock[slots].clone()
                worst_state = rel_diff(ref_state, st_ours[slots])
        pool["fill"].zero_()
        pool["origin"].zero_()
        res["route"] = self.route_name(route, idx.shape[0], state0.dtype)
        res["max_rel_diff_vs_stock_triton"] = worst
        res["max_rel_state_diff_after_flush"] = worst_state
        res.update(self.row_extra(pool))  # the ring dtypes behind these numbers
        del st_ours, st_stock
        if self._sgl_replay is not None:
            try:  # SGLang's kernel driven by its own eager cursor code
                st_sgl = state0.clone()
                rings = self.sglang_rings(shape, L, torch.float32)
                b = idx.shape[0]
                wp = torch.zeros(b, dtype=torch.int32, device=self.dev)
                ff = torch.zeros(b, dtype=torch.int32, device=self.dev)
                adv = self.sglang_cursor_fn(rings, idx, L, wp, ff)
                w_out = w_state = 0.0
                for t in range(L + 1):
                    o3 = self.out_like(c, torch.float32)
                    adv()  # snapshot write_pos for this step, advance the pool cursor
                    self.sglang_call(st_sgl, rings, c, idx, o3, wp, ff)()
                    w_out = max(w_out, rel_diff(outs[t], o3))
                    if t == L - 1:
                        w_state = rel_diff(ref_state, st_sgl[slots])
                res["max_rel_diff_sglang_replay_vs_stock_triton"] = w_out
                res["max_rel_state_diff_sglang_replay_after_flush"] = w_state
            except Exception as e:
                res["sglang_replay_parity_error"] = repr(e)[:200]
        return res

    def check_text(self, c):
        return (f"{c['shape']} b={c['batch']} {c.get('route')}: ours "
                f"{fmt(c.get('max_rel_diff_vs_stock_triton'), '.1e')}"
                f" (state {fmt(c.get('max_rel_state_diff_after_flush'), '.1e')}; k ring "
                f"{c.get('k_buffer_dtype')}, u ring {c.get('u_buffer_dtype')}), SGLang ReplaySSM "
                f"{fmt(c.get('max_rel_diff_sglang_replay_vs_stock_triton'), '.1e')}")

    def default_config(self, shape, sdt_t, b, route="output_only"):
        H, HV, K, V, _ = self.shapes[shape]
        return self.m.default_config(V, K, sdt_t, b, route=route,
                                     fold_copy=self.fold_copy(sdt_t))

    def cfg_fits(self, cfg, shape):
        return cfg.block <= max(16, triton.next_power_of_2(self.shapes[shape][3]))

    def md_columns(self):
        pct = lambda v: fmt(v, ".0%")  # noqa: E731
        return [
            ("shape", lambda r: r["shape"]),
            # a dual-precision row: the state column is the read copy's dtype
            ("state", lambda r: r["state_dtype"] + (f" + {r['fold_copy']} fold copy"
                                                    if r.get("fold_copy") else "")),
            ("L", lambda r: str(r["buffer_len"])), ("route", lambda r: r["route"]),
            ("u ring", lambda r: r.get("u_buffer_dtype", "n/a")),
            ("batch", lambda r: str(r["batch"])),
            ("ReplaySSM µs", lambda r: fmt(r["us"])),
            ("stock triton µs", lambda r: fmt(r.get("stock_triton_us"))),
            ("SGLang ReplaySSM µs", lambda r: fmt(r.get("sglang_replay_us"))),
            ("SGLang ReplaySSM + cursors µs",
             lambda r: fmt(r.get("sglang_replay_with_cursor_us"))),
            ("speedup vs stock", lambda r: f"**{fmt(r['speedup'], '.2f')}×**"),
            ("vs SGLang ReplaySSM", lambda r: f"{fmt(r.get('speedup_vs_sglang_replay'), '.2f')}×"),
            ("ReplaySSM % copy BW", lambda r: pct(r["bw_frac"])),
            ("stock % copy BW", lambda r: pct(r.get("stock_triton_bw_frac"))),
            ("SGLang ReplaySSM % copy BW", lambda r: pct(r.get("sglang_replay_bw_frac"))),
        ]

    def plot_series(self):
        return [("speedup", "", "-"), ("speedup_vs_sglang_replay", " vs SGLang ReplaySSM", "--")]


FAMILIES = {"mamba2": Mamba2, "gdn": GDN}


def prebuild_flashinfer(shapes, sdts):
    """Build FlashInfer's JIT SSU modules in parallel (minutes when cold); the
    keys match what FlashInferSSUBackend asks for with bf16 activations."""
    from concurrent.futures import ThreadPoolExecutor
    try:
        from flashinfer.mamba.selective_state_update import get_selective_state_update_module
    except ImportError as e:
        print(f"flashinfer prebuild skipped: {e!r}")
        return
    keys = {(P, N, sdt) for (_, P, N, _, _) in shapes for sdt in sdts}
    if not keys:
        return
    with ThreadPoolExecutor(max_workers=len(keys)) as ex:
        futs = [ex.submit(get_selective_state_update_module, torch.device("cuda"), sdt,
                          torch.bfloat16, torch.bfloat16, torch.float32, torch.int32, P, N, 1,
                          torch.int32, torch.int64, state_scale_dtype=None, philox_rounds=0)
                for (P, N, sdt) in keys]
        for f in futs:
            try:
                f.result()
            except Exception as e:  # the backend call will JIT it on first use instead
                print(f"flashinfer prebuild failed: {repr(e)[:200]}")


# --------------------------------------------------------------------------
# the shared main loop
# --------------------------------------------------------------------------

def main():
    args = parse()
    Fam = FAMILIES[args.family]
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    import sglang

    t0 = time.time()
    if args.dry_run:
        Fam.shapes = dict(Fam.dry_shapes)
        dev = "cpu"
        args.slots = min(args.slots, 8)
        batches = [int(b) for b in args.batches.split(",") if int(b) <= args.slots][:2] or [1]
        Ls = [int(x) for x in args.buffer_lens.split(",")][:2]
        args.main_buffer_len = Ls[0] if args.main_buffer_len not in Ls else args.main_buffer_len
    else:
        dev = "cuda"
        batches = [int(b) for b in args.batches.split(",")]
        Ls = [int(x) for x in args.buffer_lens.split(",")]
    shapes = (args.shapes.split(",") if args.shapes and not args.dry_run else list(Fam.shapes))
    unknown = [s for s in shapes if s not in Fam.shapes]
    if unknown:
        raise SystemExit(f"unknown {args.family} shapes {unknown}; known: {list(Fam.shapes)}")
    sdts = args.state_dtypes.split(",")
    routes = (args.routes or Fam.default_routes).split(",")
    n_alts = len(args.split_config.split(";"))
    if n_alts > 1:  # one split arm per --split-config alternative
        routes = [v for r in routes
                  for v in ([f"{r}#{i}" for i in range(n_alts)] if r == "split" else [r])]
    S = max(args.slots, max(batches))

    fam_versions = {}
    res = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        **provenance(ROOT),
        "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run, no timing)",
        "family": args.family,
        "versions": {},
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "timing": "CUDA-graph replay of a whole buffer cycle (L steps, L2 flushed before "
                  "each step, flush-only graph subtracted), do_bench median, per step"
                  + Fam.timing_note,
        "rows": [], "sweep": [], "checks": [], "errors": [],
    }
    if args.family != "mamba2":  # keep the Mamba-2 file's header as it was
        res["shapes"] = {s: dict(zip(("H", "HV", "K", "V", "ssm_layers"), Fam.shapes[s]))
                         for s in shapes}
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, args.name + ".json")

    def dump():
        res["elapsed_s"] = round(time.time() - t0, 1)
        with open(json_path + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(json_path + ".tmp", json_path)

    def late(frac=1.0):
        return time.time() - t0 > args.deadline_s * frac

    def error(msg):
        res["errors"].append(msg)
        print(msg[:300], flush=True)

    if args.dry_run:
        copy_bw = 1e12
        timer = DryTimer()
    else:
        copy_bw = copy_bandwidth()
        timer = Timer(args.rep_ms)
    res["copy_bandwidth_TBps"] = round(copy_bw / 1e12, 3)
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s", flush=True)
    g = torch.Generator(device=dev)
    g.manual_seed(0)
    stock_names = (list(Fam.stock_backends) if args.stock == "all"
                   else [n for n in args.stock.split(",") if n])
    bad = [n for n in stock_names if n not in Fam.stock_backends]
    if bad or not stock_names:
        raise SystemExit(f"--stock {args.stock}: {args.family} stock backends are "
                         f"{list(Fam.stock_backends)}")
    args.stock_names = stock_names
    fam = Fam(args, dev, g, S)
    fam.setup(shapes, sdts)
    fam_versions = fam.extra_versions()
    res["versions"] = {"torch": torch.__version__, "triton": triton.__version__,
                       "sglang": sglang.__version__, **fam_versions, "cuda": torch.version.cuda}
    from sglang_replayssm.kernels.common import LaunchConfig

    # work list: (shape, sdt, batch, [(L, route)])
    plan = []
    for si, shape in enumerate(shapes):
        for sdt in sdts:
            for b in batches:
                arms = []
                for L in (Ls if si == 0 else [args.main_buffer_len]):
                    for r in (routes if (si == 0 and L == args.main_buffer_len) else ["auto"]):
                        arms.append((L, r))
                plan.append((shape, sdt, b, arms))
    bar = tqdm(total=len(plan), desc="bench", file=sys.stdout) if tqdm else None

    def new_idx(b):
        return torch.randperm(S, device=dev, generator=g)[:b].to(torch.int32)

    # ---- launch-config sweep (first shape, L=main, both dtypes) ----
    # best[(sdt, route, batch)] = config; the main loop uses the nearest swept batch
    best_cfg = {}
    sweep_batches = ([int(x) for x in args.sweep_batches.split(",")] if not args.dry_run
                     else (batches[-1],))
    if args.sweep:
        shape = shapes[0]
        L = args.main_buffer_len
        for sdt in sdts:
            try:
                sdt_t = DTYPES[sdt]
                state = fam.make_state(shape, sdt_t)
                pool = fam.replay_pool(shape, L, sdt_t)
                for b in sweep_batches:
                    idx = new_idx(b)
                    set_flush_phase(pool, idx, L, args.flush_phase)
                    c = fam.inputs(shape, b, sdt_t)
                    out = fam.out_like(c)
                    for route in routes:
                        cands = []
                        # the first route's launch configs, and the split route's
                        # projection tile
                        swept = route == routes[0] or route == "split"
                        # the fused kernels' ring order matters where a step is
                        # latency bound (small batch); the split kernels read in
                        # logical order
                        base = fam.split_variant(route)[0]
                        base = fam.m.default_route(b, sdt_t) if base == "auto" else base
                        split = base in fam.m.SPLIT_ROUTES
                        grid = [(blk, nw, so) for blk, nw in (fam.sweep_grid if swept else [])
                                for so in ((False,) if split or b >= 32 else (False, True))]
                        for blk, nw, so in grid:
                            cfg = fam.route_config(LaunchConfig(blk, nw, so), route, shape,
                                                   sdt_t, b)
                            if late(0.5):
                                break
                            try:
                                s, cm = fam.replay_fns(shape, state, pool, c, idx, out, L, route,
                                                       cfg)
                                us = timer.per_step_us([lambda: (s(), cm())] * L)
                                cands.append((us, cfg))
                            except Exception as e:  # e.g. out of resources
                                us = None
                                res["errors"].append(f"sweep {route} {cfg}: {e!r}"[:300])
                            res["sweep"].append(dict(shape=shape, state_dtype=sdt, batch=b,
                                                     buffer_len=L, route=route,
                                                     **{fam.block_key: blk}, num_warps=nw,
                                                     storage_order=so, us_with_commit=us))
                            print(f"sweep {sdt} b={b} {route} {cfg}: {us}", flush=True)
                        if cands:
                            best_cfg[(sdt, route, b)] = min(cands, key=lambda t: t[0])[1]
                    dump()
                del state, pool
            except Exception as e:
                error(f"sweep {shape} {sdt}: {e!r}"[:300] + traceback.format_exc()[-600:])
            if dev == "cuda":
                torch.cuda.empty_cache()

    def pick_cfg(sdt, route, b, shape):
        """The swept best for the nearest swept batch on the same side of 32,
        else the launcher default."""
        r = routes[0] if route == "auto" else route
        near = [sb for (s_, r_, sb) in best_cfg if s_ == sdt and r_ == r and (sb >= 32) == (b >= 32)]
        cfg = (best_cfg[(sdt, r, min(near, key=lambda sb: abs(math.log2(sb / b))))]
               if near else None)
        if cfg is None or not fam.cfg_fits(cfg, shape):
            cfg = fam.default_config(shape, DTYPES[sdt], b)
        return fam.route_config(cfg, fam.route_name(route, b, DTYPES[sdt]), shape, DTYPES[sdt],
                                b)

    states = {}
    stock_failed = set()
    for shape, sdt, b, arms in plan:
        if late():
            error(f"deadline reached before {shape} {sdt} b={b}")
            break
        try:
            nl = fam.layers(shape)
            sdt_t = DTYPES[sdt]
            key = (shape, sdt)
            if key not in states:
                states.clear()
                if dev == "cuda":
                    torch.cuda.empty_cache()
                states[key] = fam.make_state(shape, sdt_t)
            state = states[key]
            es = state.element_size()
            idx = new_idx(b)
            c = fam.inputs(shape, b, sdt_t)
            out = fam.out_like(c)
            Ls_stock = args.main_buffer_len
            stock = {}
            for name in stock_names:
                fk = (name, fam.fail_key(shape), sdt)
                if fk in stock_failed:  # e.g. no FlashInfer build for headdim 80
                    stock[name] = None
                    continue
                try:
                    stock[name] = timer.per_step_us([fam.stock_fn(name, state, c, idx, out)]
                                                    * Ls_stock)
                except Exception as e:  # e.g. FlashInfer has no build for this headdim
                    stock[name] = None
                    stock_failed.add(fk)
                    res["errors"].append(f"stock {name} unavailable for {shape} {sdt} b={b}: "
                                         f"{repr(e)[:160]}")
            avail = {k: v for k, v in stock.items() if v is not None}
            best = min(avail, key=avail.get) if avail else None
            stock_bytes = bytes_moved(fam.traffic(shape, b, es), b, 1, False)
            extras = {}  # per L: comparators of this (shape, sdt, b)
            for L, route in arms:
                if late():
                    error(f"deadline reached before {shape} {sdt} b={b} L={L} {route}")
                    break
                pool = cfg = None
                try:
                    pool = fam.replay_pool(shape, L, sdt_t)
                    # parity vs stock of the main route and of every timed route on
                    # the first shape (one check per route at L=main)
                    if sdt == "float32" and L == args.main_buffer_len and (
                            route in ("auto", routes[0]) or len(arms) > 1):
                        try:
                            chk = fam.parity(shape, state, pool, c, idx, L,
                                             pick_cfg(sdt, route, b, shape), route)
                            res["checks"].append(dict(shape=shape, batch=b, buffer_len=L, **chk))
                        except Exception as e:
                            error(f"parity {shape} b={b} L={L}: {e!r}"[:300])
                    cfg = pick_cfg(sdt, route, b, shape)
                    set_flush_phase(pool, idx, L, args.flush_phase)
                    s, cm = fam.replay_fns(shape, state, pool, c, idx, out, L, route, cfg)
                    us_all = timer.per_step_us([lambda: (s(), cm())] * L)
                    us_commit = timer.per_step_us([cm] * L)
                    us_k = max(us_all - us_commit, 0.0)
                    us = us_k + us_commit / nl
                    kernels = (timer.breakdown([lambda: (s(), cm())] * L) if args.breakdown
                               else None)
                except Exception as e:  # the row keeps the other arms, with us = None
                    error(f"ReplaySSM {shape} {sdt} b={b} L={L} {route}: {e!r}"[:300]
                          + traceback.format_exc()[-600:])
                    us = us_k = us_commit = kernels = None
                nbytes = bytes_moved(fam.traffic(shape, b, es, pool), b, L, True)

                def ratio(v):  # a comparator's time over ours = our speedup over it
                    return None if v is None or not us else round(v / us, 3)

                def bw(nb, v):
                    return None if not v else round(nb / (v * 1e-6) / copy_bw, 3)

                row = dict(shape=shape, batch=b, state_dtype=sdt, buffer_len=L,
                           route=fam.route_name(route, b, sdt_t),
                           config=repr(cfg), flush_phase=args.flush_phase,
                           us=rnd(us, 2), kernel_us=rnd(us_k, 2), commit_us=rnd(us_commit, 2),
                           commit_amortised_over_layers=nl,
                           stock_backend=best, stock_us=rnd(stock.get(best), 2),
                           speedup=ratio(stock.get(best)),
                           bw_frac=bw(nbytes, us),
                           bytes_moved=int(nbytes), stock_bytes_moved=int(stock_bytes))
                if kernels is not None:
                    row["breakdown"] = kernels
                for k, v in stock.items():
                    row[f"stock_{k}_us"] = rnd(v, 2)
                    row[f"speedup_vs_{k}"] = ratio(v)
                    row[f"stock_{k}_bw_frac"] = bw(stock_bytes, v)
                if pool is not None:
                    row.update(fam.row_extra(pool))
                pool = None
                if L not in extras:
                    try:
                        extras[L] = fam.extra_arms(timer, shape, state, c, idx, L, sdt_t, b)
                    except Exception as e:  # its keys stay, as None
                        error(f"extra arms {shape} {sdt} b={b} L={L}: {e!r}"[:300]
                              + traceback.format_exc()[-400:])
                        extras[L] = {name: (None, 0) for name in fam.extra_arm_names}
                for name, val in extras[L].items():
                    if name == "_fields":
                        row.update(val)
                        continue
                    v, nb = val
                    row[f"{name}_us"] = rnd(v, 2)
                    row[f"speedup_vs_{name}"] = ratio(v)
                    row[f"{name}_bw_frac"] = bw(nb, v)
                    if nb:
                        row[f"{name}_bytes_moved"] = int(nb)
                res["rows"].append(row)
                more = "".join(f" | {k[:-3]} {fmt(row[k])}" for k in row
                               if k.endswith("_us") and k.startswith("sglang"))
                print(f"{shape} {sdt} b={b} L={L} {row['route']}: {fmt(us)} us "
                      f"(stock {best} {fmt(stock.get(best))}) x{fmt(row['speedup'], '.2f')} "
                      f"bw {fmt(row['bw_frac'], '.2f')}{more}", flush=True)
            dump()
        except Exception as e:
            error(f"{shape} {sdt} b={b}: {e!r}"[:300] + traceback.format_exc()[-600:])
            dump()
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    dump()
    try:
        write_md_png(res, args, fam)
    except Exception as e:
        error(f"write_md_png: {e!r}"[:300] + traceback.format_exc()[-600:])
        dump()
    print(f"wrote {json_path} in {time.time() - t0:.0f}s")


def write_markdown(base, lines, errors):
    """base.md: the table lines, then the run's errors (RESULTS.md's .md)."""
    if errors:
        lines = lines + ["", "Errors / skipped:"] + [f"- {e[:200]}" for e in errors]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def pyplot():
    """matplotlib.pyplot on the file-only backend, or None without matplotlib
    (the .png is then left out)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_md_png(res, args, fam):
    base = os.path.join(args.out_dir, args.name)
    vers = ", ".join(f"{k} {v}" for k, v in res["versions"].items() if k != "cuda")
    cols = fam.md_columns()
    lines = [f"# {args.name}", "",
             f"`{res['command']}` at `{res['git_commit']}` on {res['gpu']} "
             f"({vers}); copy bandwidth {res.get('copy_bandwidth_TBps')} TB/s.", "",
             res["timing"] + ". Speedup = fastest stock / ReplaySSM.", "",
             "| " + " | ".join(h for h, _ in cols) + " |",
             "|" + "---|" * len(cols)]
    for r in res["rows"]:
        lines.append("| " + " | ".join(f(r) for _, f in cols) + " |")
    if res["checks"]:
        lines += ["", fam.parity_text + (": max relative output difference "
                                         if fam.name == "mamba2" else ": ")
                  + ", ".join(fam.check_text(c) for c in res["checks"])]
    split = [r for r in res["rows"] if r.get("breakdown")]
    if split:
        lines += ["", "GPU time per kernel (torch profiler over the cycle graph; µs per call: "
                      "mean, plain steps (min), flush step (max); per step = amortised):", "",
                  "| shape | state | L | route | batch | kernel | calls / cycle | mean | min | "
                  "max | per step |", "|" + "---|" * 11]
        for r in split:
            for k in r["breakdown"]:
                lines.append(f"| {r['shape']} | {r['state_dtype']} | {r['buffer_len']} | "
                             f"{r['route']} | {r['batch']} | `{k['name'][:48]}` | {k['calls']} | "
                             f"{k['mean_us']} | {k['min_us']} | {k['max_us']} | "
                             f"{k['us_per_step']} |")
    write_markdown(base, lines, res["errors"])
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    seen = {}
    for r in res["rows"]:
        k = (r["shape"], r["state_dtype"], r["buffer_len"], r["route"])
        seen.setdefault(k, []).append(r)
    for k, rows in seen.items():
        rows = sorted(rows, key=lambda r: r["batch"])
        color = None
        for key, suffix, ls in fam.plot_series():
            pts = [(r["batch"], r[key]) for r in rows if r.get(key) is not None]
            if not pts:
                continue
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ls=ls,
                              color=color, label=f"{k[0]} {k[1]} L={k[2]} {k[3]}{suffix}")
            color = line.get_color()
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel(fam.plot_ylabel)
    ax.set_title(f"{fam.title} ReplaySSM decode, amortised over the buffer cycle ({res['gpu']})")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
