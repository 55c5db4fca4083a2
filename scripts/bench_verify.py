#!/usr/bin/env python3
"""Verify benchmark: one speculative verify step (T draft tokens per row, a
chain or a tree) of ReplaySSM vs SGLang 0.5.17's stock verify, side by side
in one run, timed as the server runs them (CUDA graph, cold L2).

Per SSM layer and step, each arm does what the server does for that layer;
the work SGLang does once per step for all layers is timed on one layer's
tensors (its cost scales with the layers) or, for our cursors, amortised:
  * stock (the snapshotting verify, SGLang's default for spec decoding):
      GDN      fused_sigmoid_gating_delta_rule_update(disable_state_update=True,
               intermediate_states_buffer [R, T, HV, V, K], cache_steps=T,
               retrieve_parent_token) -- gdn_triton.py TritonGDNKernel.target_verify
               (GDN tree verify always runs this Triton kernel)
      Mamba-2  selective_state_update with the same verify arguments through
               ssu_dispatch's backends (mamba.py target verify); FlashInfer
               takes chains only (it refuses retrieve_parent_token)
    then fused_mamba_state_scatter_with_mask, the scatter of the accepted
    draft's snapshot into the pool (update_mamba_state_after_mtp_verify), on
    one layer's state.
  * ours: {gdn,mamba2}_replay_verify (output-only: one checkpoint read, the
    drafts appended to the ring, the checkpoint written only when the flush
    rule fires), for a tree cursors.accept_path on one layer's rings, and
    cursors.commit(MODE_VERIFY) amortised over the model's SSM layers.
Not timed in either arm: the conv-window snapshot and its rollback (both
need one), the drafting itself and the attention layers.

Acceptance: every row accepts ``--accepted`` tokens per step (the bonus
token included) along one path: a chain's first drafts, a tree's first
children. Stock's cost does not depend on it; ours does through the flush
rule, so ours is timed over the whole steady cursor cycle: from a flush, the
steps until the next one (fills A, 2A, ... until fill + T >= L), each step a
verify; the stock arm runs the same number of identical steps. Trees are
complete binary trees (``--drafts tree:8`` = EAGLE's topk 2 over 3 levels
plus the root: parents -1, 0, 0, 1, 1, 2, 2, 3).

Writes benchmarks/results/kernels_verify.{json,md,png}. ``--dry-run`` runs it
all on CPU (Triton interpreter, tiny shapes, one eager pass per step, no
timing) to catch shape and API bugs.

usage: python scripts/bench_verify.py [--families gdn,mamba2] [--batches 1,64,256]
         [--drafts chain:4,tree:8] [--accepted 2] [--buffer-len 16] [--configs 16x8]
         [--dry-run]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
import traceback

if "--dry-run" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import bench_kernels as bk  # noqa: E402
from provenance import provenance  # noqa: E402

DEFAULT_SHAPES = {"gdn": "qwen3-next-80b", "mamba2": "nemotron-h-8b"}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="gdn,mamba2")
    ap.add_argument("--shapes", default=None,
                    help="family=shape,... (default: gdn=qwen3-next-80b,mamba2=nemotron-h-8b)")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--state-dtypes", default="float32")
    ap.add_argument("--buffer-len", type=int, default=16)
    ap.add_argument("--drafts", default="chain:4,tree:8",
                    help="draft windows, KIND:T with KIND chain or tree")
    ap.add_argument("--accepted", type=int, default=2,
                    help="tokens accepted per row and step, the bonus token included")
    ap.add_argument("--stock", default="all",
                    help="mamba2 stock backends: triton,flashinfer or all (FlashInfer's JIT "
                         "build takes ~3 min cold; it verifies chains only)")
    ap.add_argument("--configs", default="",
                    help="extra launch shapes for our verify kernels, timed beside the "
                         "default: comma-separated ROWSxWARPS (e.g. 16x8,64x4); each row "
                         "gains us_<ROWSxWARPS>, its speedup and register spill is the "
                         "launch's own business (scripts/kernel_regs.py)")
    ap.add_argument("--routes", default="",
                    help="other routes of our verify, timed beside the default (auto): "
                         "comma-separated (e.g. split); each row gains us_<route>")
    ap.add_argument("--slots", type=int, default=512)
    ap.add_argument("--rep-ms", type=float, default=40)
    ap.add_argument("--deadline-s", type=float, default=520)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--name", default="kernels_verify")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.out_dir is None:
        args.out_dir = (os.path.join("/tmp", "bench_verify_dry_run") if args.dry_run
                        else os.path.join(ROOT, "benchmarks", "results"))
    args.windows = []
    for w in args.drafts.split(","):
        kind, _, t = w.partition(":")
        if kind not in ("chain", "tree") or not t.isdigit() or int(t) < 1:
            raise SystemExit(f"--drafts: {w!r} is not chain:T or tree:T")
        args.windows.append((kind, int(t)))
    for kind, T in args.windows:
        if not 1 <= args.accepted <= (T if kind == "chain" else len(first_child_path(T))):
            raise SystemExit(f"--accepted {args.accepted}: {kind}:{T} has no accepted path "
                             f"that long")
        if T >= args.buffer_len:
            raise SystemExit(f"--drafts {kind}:{T}: T must be < --buffer-len {args.buffer_len}")
    args.config_list = []
    for cfg in filter(None, args.configs.split(",")):
        rows, _, warps = cfg.partition("x")
        if not (rows.isdigit() and warps.isdigit()) or int(rows) & (int(rows) - 1) \
                or int(warps) not in (1, 2, 4, 8, 16):
            raise SystemExit(f"--configs: {cfg!r} is not ROWSxWARPS (rows a power of 2, "
                             f"warps 1/2/4/8/16)")
        args.config_list.append((cfg, int(rows), int(warps)))
    # the other arms of ours: (name, route, (rows, warps) or None)
    args.alt_arms = [(name, "auto", (rows, warps)) for name, rows, warps in args.config_list]
    args.alt_arms += [(r, r, None) for r in filter(None, args.routes.split(","))]
    # what bench_kernels' families read from their args
    args.u_buffer_dtype = args.k_buffer_dtype = "auto"
    args.gdn_fold_copy = False
    args.split_config = ""
    return args


def binary_tree(T: int) -> list[int]:
    """Parents of a complete binary tree of T drafts in breadth-first order."""
    return [-1] + [(j - 1) // 2 for j in range(1, T)]


def first_child_path(T: int) -> list[int]:
    path = [0]
    while 2 * path[-1] + 1 < T:
        path.append(2 * path[-1] + 1)
    return path


def cycle_steps(L: int, T: int, A: int) -> int:
    """Verify steps from a flush to the next one, accepting A a step (the
    commit rule: a row whose fill + T >= L folds its committed history)."""
    fill, n = A, 0
    while True:
        n += 1
        if fill + T >= L:
            return n
        fill += A


def scatter_step(dst, src, dst_idx, step_idx):
    """SGLang's post-verify scatter of the accepted snapshot, one layer."""
    if dst.is_cuda:
        from sglang.kernels.ops.mamba.mamba_state_scatter_triton import (
            fused_mamba_state_scatter_with_mask)
        fused_mamba_state_scatter_with_mask(dst.unsqueeze(0), src.unsqueeze(0), dst_idx,
                                            step_idx)
    else:  # --dry-run: the same gather-scatter in PyTorch (SGLang's kernel is CUDA-only)
        rows = torch.arange(dst_idx.shape[0])
        dst[dst_idx.long()] = src[rows, step_idx.long()]


class _VerifyArms:
    """What both families' arms share: bench_kernels' family (shapes, inputs,
    pools), SGLang's per-draft snapshot buffer (its verify writes row i's
    draft j state at [i, j]) and the stock output as [b, T, ...]."""

    def __init__(self, fam):
        self.fam = fam

    def snapshot_buffer(self, state, b, T):
        return state.new_empty(b, T, *state.shape[1:])

    def stock_out(self, out_box, b, T):
        return out_box[0].reshape(b, T, -1)


class GDNVerify(_VerifyArms):
    def __init__(self, fam):
        super().__init__(fam)
        from sglang.kernels.ops.attention.fla.fused_sigmoid_gating_recurrent import (
            fused_sigmoid_gating_delta_rule_update)
        self.stock_kernel = fused_sigmoid_gating_delta_rule_update
        self.stock_backends = ("triton",)

    def inputs(self, shape, b, T, sdt_t):
        c = self.fam.inputs(shape, b * T, sdt_t)
        c["mixed_qkv"] = c["mixed_qkv"].view(b, T, -1)
        c["a"] = c["a"].view(b, T, -1)
        c["b"] = c["b"].view(b, T, -1)
        return c

    def fp32_inputs(self, c):
        """The stock verify returns outputs in the activations' dtype: fp32
        activations for the parity check."""
        return {**c, **{k: c[k].float() for k in ("mixed_qkv", "a", "b")}}

    def stock_fn(self, name, state, c, idx, parents, snap, out_box):
        b, T, dim = c["mixed_qkv"].shape
        H, HV, K, V = c["H"], c["HV"], c["K"], c["V"]
        mixed = c["mixed_qkv"].reshape(b * T, dim)
        q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
        cu = torch.arange(0, b * T + 1, T, dtype=torch.int32, device=idx.device)
        snap_idx = torch.arange(b, dtype=torch.int32, device=idx.device)

        def step():
            out_box[0] = self.stock_kernel(
                A_log=c["A_log"], a=c["a"].reshape(b * T, HV), dt_bias=c["dt_bias"],
                softplus_beta=1.0, softplus_threshold=20.0, q=q.view(1, b * T, H, K),
                k=k.view(1, b * T, H, K), v=v.view(1, b * T, HV, V),
                b=c["b"].reshape(b * T, HV), initial_state_source=state,
                initial_state_indices=idx, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                is_kda=False, disable_state_update=True, intermediate_states_buffer=snap,
                intermediate_state_indices=snap_idx, cache_steps=T,
                retrieve_parent_token=parents)
        return step

    def ours_fn(self, state, pool, c, idx, parents, L, out, config=None, route="auto"):
        def step():
            self.fam.m.gdn_replay_verify(
                state, pool["k_buffer"], pool["u_buffer"], pool["g_buffer"], pool["fill"],
                pool["origin"], idx, c["mixed_qkv"], c["a"], c["b"], c["A_log"], c["dt_bias"],
                c["scale"], buffer_len=L, num_k_heads=c["H"], out=out, parents=parents,
                config=config, route=route)
        return step

    def ours_out(self, c, dtype):
        b, T, _ = c["mixed_qkv"].shape
        return c["mixed_qkv"].new_empty(b, T, c["HV"], c["V"], dtype=dtype)

    def rings(self, pool):
        return [pool["k_buffer"], pool["u_buffer"], pool["g_buffer"]]


class Mamba2Verify(_VerifyArms):
    def __init__(self, fam):
        super().__init__(fam)
        self.stock_backends = tuple(fam.backends)

    def inputs(self, shape, b, T, sdt_t):
        c = self.fam.inputs(shape, b * T, sdt_t)
        H, P, N, G, _ = self.fam.shapes[shape]
        for k in ("x", "dt"):
            c[k] = c[k].view(b, T, H, P)
        for k in ("B", "C"):
            c[k] = c[k].view(b, T, G, N)
        return c

    def fp32_inputs(self, c):
        return c  # the stock verify writes into our fp32 `out`

    def stock_fn(self, name, state, c, idx, parents, snap, out_box):
        backend = self.fam.backends[name]
        b, T = c["x"].shape[:2]
        snap_idx = torch.arange(b, dtype=torch.int32, device=idx.device)
        if out_box[0] is None:
            out_box[0] = torch.empty_like(c["x"])

        def step():
            backend(state, c["x"], c["dt"], c["A"], c["B"], c["C"], D=c["D"], z=None,
                    dt_bias=c["dt_bias"], dt_softplus=True, state_batch_indices=idx,
                    out=out_box[0], disable_state_update=True, intermediate_states_buffer=snap,
                    cache_steps=T, retrieve_parent_token=parents,
                    intermediate_state_indices=snap_idx)
        return step

    def ours_fn(self, state, pool, c, idx, parents, L, out, config=None, route="auto"):
        def step():
            self.fam.m.mamba2_replay_verify(
                state, pool["x_buffer"], pool["B_buffer"], pool["dt_buffer"], pool["fill"],
                pool["origin"], idx, c["x"], c["dt"], c["A"], c["B"], c["C"], buffer_len=L,
                D=c["D"], dt_bias=c["dt_bias"], out=out, parents=parents, config=config,
                route=route)
        return step

    def ours_out(self, c, dtype):
        return torch.empty_like(c["x"], dtype=dtype)

    def rings(self, pool):
        return [pool["x_buffer"], pool["B_buffer"], pool["dt_buffer"]]


VERIFY = {"gdn": GDNVerify, "mamba2": Mamba2Verify}


def main(argv=None):
    args = parse(argv)
    import sglang
    from sglang_replayssm.kernels.common import LaunchConfig
    from sglang_replayssm.kernels.cursors import MODE_VERIFY, accept_path, commit
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None

    t0 = time.time()
    dev = "cpu" if args.dry_run else "cuda"
    families = args.families.split(",")
    unknown = [f for f in families if f not in VERIFY]
    if unknown:
        raise SystemExit(f"--families: unknown {unknown}; known: {sorted(VERIFY)}")
    shapes = dict(DEFAULT_SHAPES)
    for kv in filter(None, (args.shapes or "").split(",")):
        f, _, s = kv.partition("=")
        shapes[f] = s
    batches = [int(x) for x in args.batches.split(",")]
    if args.dry_run:
        args.slots = 8
        batches = [b for b in batches if b <= args.slots][:2] or [1]
        for f in families:
            shapes[f] = next(iter(bk.FAMILIES[f].dry_shapes))
    S = max(args.slots, max(batches))
    L, A = args.buffer_len, args.accepted
    res = {
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT)]
                                        + (sys.argv[1:] if argv is None else list(argv))),
        **provenance(ROOT),
        "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run, no timing)",
        "versions": {"torch": torch.__version__, "triton": triton.__version__,
                     "sglang": sglang.__version__, "cuda": torch.version.cuda},
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "timing": "CUDA-graph replay of n verify steps (ours: the steady cursor cycle from a "
                  "flush to the next, n = cycle_steps; stock: n identical steps), L2 flushed "
                  "before each step, flush-only graph subtracted, do_bench median, per step and "
                  "SSM layer: stock = verify + scatter of one layer; ours = verify + (tree) "
                  "accept_path on one layer's rings + commit / SSM layers of the model",
        "accepted": A, "buffer_len": L,
        "rows": [], "errors": [],
    }
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, args.name + ".json")

    def dump():
        res["elapsed_s"] = round(time.time() - t0, 1)
        with open(json_path + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(json_path + ".tmp", json_path)

    def error(msg):
        res["errors"].append(msg)
        print(msg[:300], flush=True)

    if args.dry_run:
        copy_bw, timer = 1e12, bk.DryTimer()
    else:
        copy_bw, timer = bk.copy_bandwidth(), bk.Timer(args.rep_ms)
    res["copy_bandwidth_TBps"] = round(copy_bw / 1e12, 3)
    g = torch.Generator(device=dev)
    g.manual_seed(0)

    # batch-major: a run cut by its deadline keeps every family at the first batches
    plan = [(f, sdt, b, w) for b in batches for f in families
            for sdt in args.state_dtypes.split(",") for w in args.windows]
    bar = tqdm(total=len(plan), desc="verify", file=sys.stdout) if tqdm else None
    arms = {}
    for f in families:
        Fam = bk.FAMILIES[f]
        if args.dry_run:
            Fam.shapes = dict(Fam.dry_shapes)
        args.stock_names = (list(Fam.stock_backends) if args.stock == "all" or f != "mamba2"
                            else args.stock.split(","))
        fam = Fam(args, dev, g, S)
        fam.setup([shapes[f]], args.state_dtypes.split(","))
        arms[f] = VERIFY[f](fam)
        if f == "mamba2":
            res["versions"].update(fam.extra_versions())

    for f, sdt, b, (kind, T) in plan:
        if time.time() - t0 > args.deadline_s:
            error(f"deadline reached before {f} {sdt} b={b} {kind}:{T}")
            break
        try:
            arm, fam, shape = arms[f], arms[f].fam, shapes[f]
            sdt_t = bk.DTYPES[sdt]
            nl = fam.layers(shape)
            state = fam.make_state(shape, sdt_t)
            idx = torch.randperm(S, device=dev, generator=g)[:b].to(torch.int32)
            c = arm.inputs(shape, b, T, sdt_t)
            tree = kind == "tree"
            parents = (torch.tensor(binary_tree(T), dtype=torch.int32, device=dev)
                       .repeat(b, 1) if tree else None)
            path_list = first_child_path(T) if tree else list(range(T))
            path = torch.zeros(b, T, dtype=torch.int32, device=dev)
            path[:, :len(path_list)] = torch.tensor(path_list, dtype=torch.int32)
            accepted = torch.full((b,), A, dtype=torch.int32, device=dev)
            last_step = path[:, A - 1].contiguous()  # the accepted snapshot stock scatters
            pool = fam.replay_pool(shape, L, sdt_t, window=T)
            cap = pool["cap"]
            n = cycle_steps(L, T, A)
            row = dict(family=f, shape=shape, batch=b, state_dtype=sdt, buffer_len=L,
                       draft=kind, window=T, accepted=A, cycle_steps=n,
                       parents=binary_tree(T) if tree else None, accepted_path=path_list[:A],
                       commit_amortised_over_layers=nl)

            # parity: ours with an empty buffer vs stock, from the same checkpoint
            # (SGLang's verify kernels do not run under the Triton interpreter)
            if sdt == "float32" and not args.dry_run:
                try:
                    c32 = arm.fp32_inputs(c)
                    box = [None]
                    snap = arm.snapshot_buffer(state, b, T)
                    ref_fn = arm.stock_fn("triton", state, c32, idx, parents, snap, box)
                    if box[0] is not None:
                        box[0] = box[0].float()
                    ref_fn()
                    ref = arm.stock_out(box, b, T).float()
                    # the default, then each other arm (an empty buffer: no
                    # flush, the checkpoint is left as it was)
                    for name, route, launch in [(None, "auto", None)] + args.alt_arms:
                        out32 = arm.ours_out(c32, torch.float32)
                        pool["fill"].zero_()
                        pool["origin"].zero_()
                        arm.ours_fn(state, pool, c32, idx, parents, L, out32, route=route,
                                    config=LaunchConfig(*launch) if launch else None)()
                        key = ("max_rel_diff_vs_stock_triton" if name is None
                               else f"max_rel_diff_{name}_vs_stock_triton")
                        row[key] = bk.rnd(bk.rel_diff(ref, out32.reshape(b, T, -1)), 9)
                    del snap, box
                except Exception as e:
                    error(f"parity {f} b={b} {kind}:{T}: {e!r}"[:300]
                          + traceback.format_exc()[-400:])

            # stock: verify + scatter, n identical steps
            snap = arm.snapshot_buffer(state, b, T)
            st_state = state.clone()
            for name in () if args.dry_run else arm.stock_backends:
                if tree and name == "flashinfer":
                    row[f"stock_{name}_us"] = None  # chains only
                    continue
                try:
                    box = [None]
                    v = arm.stock_fn(name, st_state, c, idx, parents, snap, box)

                    def stock_step(v=v):
                        v()
                        scatter_step(st_state, snap, idx, last_step)
                    row[f"stock_{name}_us"] = bk.rnd(timer.per_step_us([stock_step] * n), 2)
                except Exception as e:
                    row[f"stock_{name}_us"] = None
                    error(f"stock {name} {f} b={b} {kind}:{T}: {e!r}"[:300])
            del snap, st_state

            # ours: the steady cycle from a flush (every row at fill A)
            out = arm.ours_out(c, None)
            verify = arm.ours_fn(state, pool, c, idx, parents, L, out)

            def move():
                if tree:
                    accept_path(arm.rings(pool), pool["fill"], pool["origin"], idx, path,
                                accepted, capacity=cap)

            def cmt():
                commit(pool["fill"], pool["origin"], idx, mode=MODE_VERIFY, buffer_len=L,
                       capacity=cap, window=T, accepted=accepted)

            def start():
                pool["origin"].zero_()
                pool["fill"].zero_()
                pool["fill"][idx.long()] = A
            start()
            us_all = timer.per_step_us([lambda: (verify(), move(), cmt())] * n)
            start()
            us_commit = timer.per_step_us([cmt] * n)
            row.update(us=bk.rnd(max(us_all - us_commit, 0.0) + us_commit / nl, 2),
                       commit_us=bk.rnd(us_commit, 2))
            for name, route, launch in args.alt_arms:
                try:
                    alt = arm.ours_fn(state, pool, c, idx, parents, L, out, route=route,
                                      config=LaunchConfig(*launch) if launch else None)
                    start()
                    us_alt = timer.per_step_us([lambda alt=alt: (alt(), move(), cmt())] * n)
                    row[f"us_{name}"] = bk.rnd(max(us_alt - us_commit, 0.0) + us_commit / nl, 2)
                except Exception as e:
                    row[f"us_{name}"] = None
                    error(f"ours {name} {f} b={b} {kind}:{T}: {e!r}"[:300])
            if tree:
                start()
                row["accept_path_us"] = bk.rnd(timer.per_step_us([move] * n), 2)

            timed = {k[6:-3]: v for k, v in row.items()
                     if k.startswith("stock_") and k.endswith("_us") and v is not None}
            best = min(timed, key=timed.get) if timed else None
            row.update(stock_backend=best, stock_us=timed.get(best),
                       speedup=bk.rnd(timed[best] / row["us"], 3) if best and row["us"] else None)
            for k, v in timed.items():
                row[f"speedup_vs_{k}"] = bk.rnd(v / row["us"], 3) if row["us"] else None
            # bytes: stock reads the state, writes T snapshots, the scatter reads and
            # writes one (a lower bound for a tree, whose drafts re-read their
            # parents' snapshots); ours reads the checkpoint, writes it once a cycle,
            # reads the ring's fill (A .. nA over the cycle) plus the window, writes T
            state_b, entry, io, *_ = fam.traffic(shape, b, state.element_size(), pool)
            io_t = T * io
            stock_bytes = (T + 3) * state_b + io_t
            ours_bytes = (state_b * (1 + 1 / n) + b * entry * (A * (n + 1) / 2 + 2 * T) + io_t)
            row.update(bytes_moved=int(ours_bytes), stock_bytes_moved=int(stock_bytes),
                       bw_frac=(bk.rnd(ours_bytes / (row["us"] * 1e-6) / copy_bw, 3)
                                if row["us"] and not args.dry_run else None),
                       stock_bw_frac=(bk.rnd(stock_bytes / (row["stock_us"] * 1e-6) / copy_bw, 3)
                                      if row["stock_us"] and not args.dry_run else None))
            res["rows"].append(row)
            alts = "".join(f", {name} {bk.fmt(row[f'us_{name}'])}"
                           for name, *_ in args.alt_arms)
            print(f"{f} {shape} {sdt} b={b} {kind}:{T} A={A}: ours {bk.fmt(row['us'])} us"
                  f"{alts}, stock {best} {bk.fmt(row['stock_us'])} us, "
                  f"x{bk.fmt(row['speedup'], '.2f')}, parity "
                  f"{row.get('max_rel_diff_vs_stock_triton')}", flush=True)
            del pool, state
            if dev == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:
            error(f"{f} {sdt} b={b} {kind}:{T}: {e!r}"[:300] + traceback.format_exc()[-600:])
        dump()
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    dump()
    write_md_png(res, args)
    print(f"wrote {json_path} in {time.time() - t0:.0f}s")
    return 0


def write_md_png(res, args):
    base = os.path.join(args.out_dir, args.name)
    vers = ", ".join(f"{k} {v}" for k, v in res["versions"].items() if k != "cuda")
    lines = [f"# {args.name}", "",
             f"`{res['command']}` at `{res['git_commit']}` on {res['gpu']} ({vers}); copy "
             f"bandwidth {res['copy_bandwidth_TBps']} TB/s.", "",
             res["timing"] + ". Speedup = fastest stock / ReplaySSM. Accepted per step: "
             f"{res['accepted']} (bonus included), buffer length {res['buffer_len']}.", "",
             "| family | shape | state | draft | T | batch | cycle steps | ReplaySSM µs | "
             "stock µs (backend) | speedup | vs triton | commit µs | accept_path µs | "
             "ReplaySSM % copy BW | stock % copy BW | parity |",
             "|" + "---|" * 16]
    order = sorted(res["rows"], key=lambda r: (r["family"], r["state_dtype"], r["draft"],
                                               r["batch"]))
    for r in order:
        lines.append(
            f"| {r['family']} | {r['shape']} | {r['state_dtype']} | {r['draft']} | {r['window']} "
            f"| {r['batch']} | {r['cycle_steps']} | {bk.fmt(r['us'])} | "
            f"{bk.fmt(r['stock_us'])} ({r['stock_backend']}) | "
            f"**{bk.fmt(r['speedup'], '.2f')}×** | {bk.fmt(r.get('speedup_vs_triton'), '.2f')}× | "
            f"{bk.fmt(r['commit_us'])} | {bk.fmt(r.get('accept_path_us'))} | "
            f"{bk.fmt(r['bw_frac'], '.0%')} | {bk.fmt(r['stock_bw_frac'], '.0%')} | "
            f"{bk.fmt(r.get('max_rel_diff_vs_stock_triton'), '.1e')} |")
    lines += ["", "parity: max relative output difference vs the stock triton verify, fp32 "
                  "state, fp32 outputs, empty buffer (same checkpoint)."]
    if args.alt_arms:
        names = [name for name, *_ in args.alt_arms]
        lines += ["", "Other arms of our verify, µs per step and layer as above: launch "
                      "shapes (rows x warps, `--configs`) and routes (`--routes`); the "
                      "default is route auto at the launcher's `default_config`:", "",
                  "| family | draft | T | batch | default | " + " | ".join(names) + " |",
                  "|" + "---|" * (5 + len(names))]
        for r in order:
            lines.append(f"| {r['family']} | {r['draft']} | {r['window']} | {r['batch']} | "
                         f"{bk.fmt(r['us'])} | "
                         + " | ".join(bk.fmt(r.get(f"us_{n}")) for n in names) + " |")
    bk.write_markdown(base, lines, res["errors"])
    plt = bk.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    series = {}
    for r in res["rows"]:
        if r["speedup"] is not None:
            key = f"{r['shape']} {r['state_dtype']} {r['draft']}:{r['window']}"
            series.setdefault(key, []).append((r["batch"], r["speedup"]))
    for key, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
    if not series:  # a dry run times nothing
        plt.close(fig)
        return
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("speedup vs fastest stock verify (+ scatter)")
    ax.set_title(f"ReplaySSM verify, {res['accepted']} accepted a step ({res['gpu']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
