"""Command line of sglang-replayssm (``sglang-replayssm`` or ``python -m sglang_replayssm``).

    sglang-replayssm check [--json]
        What serving needs: the SGLang version against the pin, torch/triton,
        the GPU, the SGLang plugin entry point, and whether every kernel
        compiles and matches its float64 reference on a small case.

    sglang-replayssm demo [--tokens N --layers L ...] [--json]
        Decodes through a small stack of Mamba-2 SSM layers twice, with the
        stock eager recurrence and with ReplaySSM (checkpoint + input buffer),
        and prints how far the outputs differ and the state traffic of each.

Without a CUDA device the kernels run under the Triton interpreter. Triton
decides at decoration time whether a ``@triton.jit`` function is interpreted,
so ``TRITON_INTERPRET=1`` must be in the environment before the kernel
modules are imported: this module imports torch, triton and the kernels only
inside functions, after :func:`_setup_backend` has looked at the device.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

OK, WARN, FAIL = "OK", "WARN", "FAIL"
KERNEL_RTOL = 1e-4          # check: fp32 kernels vs float64 references
DEMO_RTOL_FP32 = 1e-3       # demo: ReplaySSM vs stock, fp32 state
BF16_MARGIN = 1.5           # demo, bf16 state: ReplaySSM vs exact <= margin x stock vs exact
TYPICAL_SHAPE = (80, 64, 128, 1)   # H, P, N, G of a Mamba-2 2.7B layer (for scale)
PLUGIN_GROUP = "sglang.srt.plugins"
INTERPRET_NOTE = ("no CUDA device: kernels will run under the Triton interpreter "
                  "(TRITON_INTERPRET=1), slow, for testing only")
_KERNEL_MODULES = ("sglang_replayssm.kernels.mamba2_replay", "sglang_replayssm.kernels.cursors")


# --------------------------------------------------------------------------
# backend selection (must run before the kernels are imported)
# --------------------------------------------------------------------------

def _setup_backend(device: str = "auto"):
    """Pick the torch device and make Triton usable on it.

    Returns ``(device, notes)``. On a machine without CUDA (or with
    ``device="cpu"``) sets ``os.environ["TRITON_INTERPRET"] = "1"`` unless it
    already is, and says so in ``notes``.
    """
    import torch

    notes = []
    has_cuda = torch.cuda.is_available()
    if device == "auto":
        device = "cuda" if has_cuda else "cpu"
    if device.startswith("cuda") and not has_cuda:
        raise SystemExit("error: --device cuda requested but torch sees no CUDA device")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise SystemExit(f"error: unsupported --device {device!r} (use auto, cpu or cuda)")
    interp = os.environ.get("TRITON_INTERPRET", "")
    if device == "cpu":
        if interp != "1":
            late = [m for m in _KERNEL_MODULES if m in sys.modules]
            os.environ["TRITON_INTERPRET"] = "1"
            was = "unset" if interp == "" else f"{interp!r}"
            notes.append(f"TRITON_INTERPRET was {was}: set it to 1 for this process "
                         "(kernels run under the Triton interpreter)")
            if late:
                notes.append("the kernel modules were imported before TRITON_INTERPRET was set; "
                             "they are compiled for a GPU and will fail on CPU "
                             "(set TRITON_INTERPRET=1 before starting Python)")
        # the tensors here are tiny and the interpreter runs every program in
        # Python: torch's worker threads only spin against it (measured 2x
        # slower with them on a 2-core machine)
        torch.set_num_threads(1)
    elif interp == "1":
        notes.append("TRITON_INTERPRET=1 is set although a CUDA device is present: the kernels "
                     "run under the interpreter (slow); unset it to compile them")
    return device, notes


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------

def _item(name, status, detail, **extra):
    d = {"name": name, "status": status, "detail": detail}
    d.update(extra)
    return d


def _first_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"


def _check_sglang():
    from importlib import metadata

    from . import SGLANG_PIN
    try:
        v = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return _item("sglang", FAIL, f"not installed (ReplaySSM needs sglang=={SGLANG_PIN})",
                     installed=None, pin=SGLANG_PIN)
    if v == SGLANG_PIN:
        return _item("sglang", OK, f"{v} (pin {SGLANG_PIN})", installed=v, pin=SGLANG_PIN)
    return _item("sglang", WARN, f"{v} installed, but ReplaySSM is pinned to and tested with "
                                 f"{SGLANG_PIN} only", installed=v, pin=SGLANG_PIN)


def _check_torch_triton():
    import torch
    out = [_item("torch", OK, f"{torch.__version__}"
                 + (f" (CUDA {torch.version.cuda})" if torch.version.cuda else " (no CUDA build)"),
                 version=torch.__version__, cuda=torch.version.cuda)]
    try:
        import triton
        out.append(_item("triton", OK, triton.__version__, version=triton.__version__))
    except Exception as e:  # noqa: BLE001 - report any import failure
        out.append(_item("triton", FAIL, f"cannot import triton: {_first_line(e)}", version=None))
    return out


def _check_device(device):
    import torch
    if device == "cpu":
        note = INTERPRET_NOTE if not torch.cuda.is_available() else (
            "--device cpu: kernels will run under the Triton interpreter (TRITON_INTERPRET=1), "
            "slow, for testing only")
        return _item("device", WARN, note, cuda=False, gpu=None, capability=None)
    idx = torch.device(device).index or 0
    name = torch.cuda.get_device_name(idx)
    cap = torch.cuda.get_device_capability(idx)
    cc = f"{cap[0]}.{cap[1]}"
    if cap < (8, 0):
        return _item("device", WARN, f"{name}, compute capability {cc}: the kernels are written "
                                     "for sm_80+ (tf32/bf16 tensor cores); untested here",
                     cuda=True, gpu=name, capability=cc)
    return _item("device", OK, f"{name}, compute capability {cc}", cuda=True, gpu=name,
                 capability=cc)


def _check_plugin():
    from importlib.metadata import entry_points
    try:
        eps = [ep for ep in entry_points(group=PLUGIN_GROUP)
               if ep.value.startswith("sglang_replayssm")]
    except Exception as e:  # noqa: BLE001
        return _item("sglang plugin", WARN, f"cannot list entry points: {_first_line(e)}",
                     registered=False)
    if eps:
        names = ", ".join(f"{ep.name} = {ep.value}" for ep in eps)
        return _item("sglang plugin", OK, f"registered in {PLUGIN_GROUP}: {names}",
                     registered=True, entry_points=[ep.value for ep in eps])
    return _item("sglang plugin", WARN, "not registered (integration not installed yet)",
                 registered=False)


class _CheckPool:
    """What both families' check pools share: 3 slots, rows using slots
    [2, -1, 0] (2 live rows, 1 padded row, so the checks cover slot
    indirection and padding too), seeded inputs, and the comparisons against
    the float64 eager state ``self.state``. Every tensor, the reference state
    included, lives on ``device`` (the references run on any device)."""

    S = 3

    def __init__(self, device, buffer_len, window, seed):
        import torch

        from .kernels.cursors import required_capacity

        self.torch, self.dev, self.L = torch, device, buffer_len
        self.cap = required_capacity(buffer_len, window)
        self.gen = torch.Generator().manual_seed(seed)
        self.slots = torch.tensor([2, -1, 0], dtype=torch.int32, device=device)
        self.live = self.slots >= 0
        self.live_slots = self.slots[self.live].long()
        self.fill = torch.zeros(self.S, dtype=torch.int32, device=device)
        self.origin = torch.zeros(self.S, dtype=torch.int32, device=device)

    def _randn(self, *shape):
        return self.torch.randn(*shape, generator=self.gen).to(self.dev)

    def _zeros(self, *shape):
        return self.torch.zeros(*shape, device=self.dev)

    def rel(self, y, y_ref):
        """max |y - y_ref| / max |y_ref| over the live rows."""
        y = y[self.live].double()
        r = y_ref[self.live].double()
        return (y - r).abs().max().item() / max(r.abs().max().item(), 1e-30)

    def _state_rel(self, recurrence_copy):
        c = recurrence_copy[self.live_slots].double()
        r = self.state[self.live_slots]
        return (c - r).abs().max().item() / max(r.abs().max().item(), 1e-30)

    def padded_untouched(self) -> bool:
        now = [t[1] for t in self._padded_views()]
        return all(bool(self.torch.equal(a, b)) for a, b in zip(self.pad_before, now))


class _Mamba2Pool(_CheckPool):
    """A small Mamba-2 ReplaySSM pool plus the float64 eager state it must track."""

    H, P, N, G = 4, 16, 16, 2

    def __init__(self, device, buffer_len, window=1, seed=0):
        super().__init__(device, buffer_len, window, seed)
        H, P, N, G, S = self.H, self.P, self.N, self.G, self.S
        self.ckpt = self._randn(S, H, P, N) * 0.5
        self.state = self.ckpt.double().clone()          # eager float64 reference state
        self.xb = self._zeros(S, H, self.cap, P)
        self.Bb = self._zeros(S, G, self.cap, N)
        self.db = self._zeros(S, H, self.cap)
        self.A = -self.torch.exp(self.torch.rand(H, generator=self.gen)
                                 * math.log(4.0)).to(device)
        self.D = self._randn(H)
        self.dt_bias = self._randn(H) * 0.3
        self.pad_before = [t[1].clone() for t in self._padded_views()]

    def _padded_views(self):
        return (self.ckpt, self.xb, self.Bb, self.db)

    def inputs(self, T=None):
        b, H, P, N, G = self.slots.shape[0], self.H, self.P, self.N, self.G
        w = () if T is None else (T,)
        return dict(x=self._randn(b, *w, H, P), dt=self._randn(b, *w, H),
                    B=self._randn(b, *w, G, N), C=self._randn(b, *w, G, N),
                    z=self._randn(b, *w, H, P))

    def kw(self):
        return dict(buffer_len=self.L, D=self.D, dt_bias=self.dt_bias, validate=True)

    def pool(self):
        return (self.ckpt, self.xb, self.Bb, self.db, self.fill, self.origin, self.slots)

    def ref_step(self, state, inp, j=None, use_z=True):
        from .reference import selective_state_update_ref
        pick = (lambda t: t) if j is None else (lambda t: t[:, j])
        return selective_state_update_ref(
            state, pick(inp["x"]), pick(inp["dt"]), self.A, pick(inp["B"]), pick(inp["C"]),
            D=self.D, z=pick(inp["z"]) if use_z else None, dt_bias=self.dt_bias,
            state_batch_indices=self.slots)

    def state_rel(self):
        return self._state_rel(self.ckpt)


def _kc_cursors(device):
    import torch

    from .kernels import cursors as cur
    L, T = 8, 3
    cap = cur.required_capacity(L, T)
    g = torch.Generator().manual_seed(1)
    S = 16
    bad = []
    for mode in (cur.MODE_DECODE, cur.MODE_VERIFY, cur.MODE_FLUSH):
        fill = torch.randint(0, L, (S,), generator=g, dtype=torch.int32)
        origin = torch.randint(0, cap, (S,), generator=g, dtype=torch.int32)
        slots = torch.randperm(S, generator=g)[:10].to(torch.int32)
        slots[::4] = -1
        acc = torch.randint(0, T + 1, (10,), generator=g, dtype=torch.int32)
        f1, o1 = fill.clone().to(device), origin.clone().to(device)
        kw = dict(mode=mode, buffer_len=L, capacity=cap, window=T if mode == cur.MODE_VERIFY else 1)
        cur.commit(f1, o1, slots.to(device), accepted=acc.to(device) if mode == cur.MODE_VERIFY
                   else None, **kw)
        cur.commit_ref(fill, origin, slots, acc, kw["window"], L, cap, mode)
        f1, o1 = f1.cpu(), o1.cpu()
        if not (torch.equal(f1, fill) and torch.equal(o1, origin)):
            bad.append(("decode", "verify", "flush")[mode])
    if bad:
        return FAIL, f"commit differs from commit_ref in mode(s) {', '.join(bad)}", None
    return OK, "commit matches commit_ref in decode, verify and flush modes", 0.0


def _kc_decode(device, route):
    from .kernels.cursors import MODE_DECODE, commit
    from .kernels.mamba2_replay import mamba2_replay_decode
    p = _Mamba2Pool(device, buffer_len=4, seed=2)
    steps = 2 * p.L
    err = 0.0
    for step in range(steps):
        inp = p.inputs()
        use_z = step % 2 == 0           # half the steps gated, half not
        y = mamba2_replay_decode(*p.pool(), inp["x"], inp["dt"], p.A, inp["B"], inp["C"],
                                 z=inp["z"] if use_z else None, route=route, **p.kw())
        commit(p.fill, p.origin, p.slots, mode=MODE_DECODE, buffer_len=p.L, capacity=p.cap)
        err = max(err, p.rel(y, p.ref_step(p.state, inp, use_z=use_z)))
    serr = p.state_rel()
    if not p.padded_untouched():
        return FAIL, "the padded row's slot was modified", max(err, serr)
    if bool((p.fill[p.live_slots] != 0).any()):
        return FAIL, f"fill should be 0 after {steps} steps, got {p.fill.tolist()}", max(err, serr)
    return None, (f"outputs {err:.1e}, checkpoint {serr:.1e} (max rel err over {steps} steps "
                  f"= 2 buffer cycles of {p.L})"), max(err, serr)


def _check_drafts(p, y, inp, accepted, parents=None, paths=None):
    """A verify step of pool ``p`` (either family): draft j's outputs y[:, j]
    against the eager reference stepped along its own path from ``p.state``
    (``parents``: draft j's parent's window index, -1 for the history; None:
    a chain); then each live row's reference state becomes the one at the
    end of its accepted path (``paths[row][:accepted[row]]``; None: the
    chain's first drafts). Returns the max rel err."""
    T = y.shape[1]
    parents = [-1] + list(range(T - 1)) if parents is None else parents
    states, err = [], 0.0
    for j, parent in enumerate(parents):
        st = (p.state if parent < 0 else states[parent]).clone()
        err = max(err, p.rel(y[:, j], p.ref_step(st, inp, j=j)))
        states.append(st)
    for row, a in enumerate(accepted):
        s = int(p.slots[row])
        if s >= 0 and a > 0:
            p.state[s] = states[a - 1 if paths is None else paths[row][a - 1]][s]
    return err


def _after_verify_flush(p, err, T, steps=3):
    """Both families' verify check, after its flush launch: commit the flush,
    compare the state, check the padded row; err = the drafts' worst output
    error."""
    from .kernels.cursors import MODE_FLUSH, commit
    commit(p.fill, p.origin, p.slots, mode=MODE_FLUSH, buffer_len=p.L, capacity=p.cap)
    serr = p.state_rel()
    if not p.padded_untouched():
        return FAIL, "the padded row's slot was modified", max(err, serr)
    return None, (f"outputs {err:.1e} over {steps} steps of {T} drafts (flush inside verify "
                  f"included), state after accept + flush {serr:.1e}"), max(err, serr)


def _kc_verify(device, route):
    import torch

    from .kernels.cursors import MODE_DECODE, MODE_VERIFY, commit
    from .kernels.mamba2_replay import (mamba2_replay_decode, mamba2_replay_flush,
                                        mamba2_replay_verify)
    T = 2
    p = _Mamba2Pool(device, buffer_len=5, window=T, seed=3)
    inp = p.inputs()
    mamba2_replay_decode(*p.pool(), inp["x"], inp["dt"], p.A, inp["B"], inp["C"], z=inp["z"],
                         route=route, **p.kw())
    commit(p.fill, p.origin, p.slots, mode=MODE_DECODE, buffer_len=p.L, capacity=p.cap)
    p.ref_step(p.state, inp)
    err = 0.0
    # fills go [1,1] -> [2,3] -> [4,1 after a flush] -> [flush, 3]: both flush paths
    for accepted in ([1, 0, 2], [2, 0, 1], [1, 0, 2]):
        inp = p.inputs(T)
        y = mamba2_replay_verify(*p.pool(), inp["x"], inp["dt"], p.A, inp["B"], inp["C"],
                                 z=inp["z"], route=route, **p.kw())
        acc = torch.tensor(accepted, dtype=torch.int32, device=device)
        commit(p.fill, p.origin, p.slots, mode=MODE_VERIFY, buffer_len=p.L, capacity=p.cap,
               window=T, accepted=acc, validate=True)
        err = max(err, _check_drafts(p, y, inp, accepted))
    mamba2_replay_flush(*p.pool(), p.A, buffer_len=p.L, validate=True)
    return _after_verify_flush(p, err, T)


def _kc_flush(device):
    from .kernels.cursors import MODE_DECODE, MODE_FLUSH, commit
    from .kernels.mamba2_replay import mamba2_replay_decode, mamba2_replay_flush
    p = _Mamba2Pool(device, buffer_len=4, seed=4)

    def step():
        inp = p.inputs()
        y = mamba2_replay_decode(*p.pool(), inp["x"], inp["dt"], p.A, inp["B"], inp["C"],
                                 z=inp["z"], **p.kw())
        commit(p.fill, p.origin, p.slots, mode=MODE_DECODE, buffer_len=p.L, capacity=p.cap)
        return p.rel(y, p.ref_step(p.state, inp))

    err = max(step(), step())                      # fill = 2 < buffer_len: nothing folded yet
    mamba2_replay_flush(*p.pool(), p.A, buffer_len=p.L, validate=True)
    commit(p.fill, p.origin, p.slots, mode=MODE_FLUSH, buffer_len=p.L, capacity=p.cap)
    serr = p.state_rel()
    if bool((p.fill[p.live_slots] != 0).any()):
        return FAIL, f"fill should be 0 after a flush, got {p.fill.tolist()}", serr
    err = max(err, step())                         # decoding goes on from the new checkpoint
    if not p.padded_untouched():
        return FAIL, "the padded row's slot was modified", max(err, serr)
    return None, (f"checkpoint after folding 2 buffered tokens {serr:.1e}, "
                  f"outputs around it {err:.1e} (max rel err)"), max(err, serr)


class _GDNPool(_CheckPool):
    """A small Gated DeltaNet ReplaySSM pool plus its float64 eager state:
    1 k-head, 2 v-heads (GVA 2), K = V = 16.
    fold=True: a bf16 read copy and an fp32 fold copy (dual precision)."""

    H, HV, K, V = 1, 2, 16, 16

    def __init__(self, device, buffer_len, window=1, seed=0, fold=False):
        super().__init__(device, buffer_len, window, seed)
        H, HV, K, V, S = self.H, self.HV, self.K, self.V, self.S
        h0 = self._randn(S, HV, V, K) * 0.3
        self.state = h0.double().clone()                  # eager float64 reference state
        self.fold = h0.clone() if fold else None
        self.ckpt = h0.to(self.torch.bfloat16) if fold else h0
        self.kb = self._zeros(S, H, self.cap, K)
        self.ub = self._zeros(S, HV, self.cap, V)
        self.gb = self._zeros(S, HV, self.cap)
        self.vb = self._zeros(S, HV, self.cap, V) if fold else None
        self.bb = self._zeros(S, HV, self.cap) if fold else None
        self.A_log = self._randn(HV) * 0.5
        self.dt_bias = self._randn(HV)
        self.pad_before = [t[1].clone() for t in self._padded_views()]

    def _padded_views(self):
        views = [self.ckpt, self.kb, self.ub, self.gb]
        return views + ([self.fold, self.vb, self.bb] if self.fold is not None else [])

    def inputs(self, T=None):
        b = self.slots.shape[0]
        w = () if T is None else (T,)
        dim = 2 * self.H * self.K + self.HV * self.V
        return dict(qkv=self._randn(b, *w, dim), a=self._randn(b, *w, self.HV),
                    b=self._randn(b, *w, self.HV))

    def pool(self):
        return (self.ckpt, self.kb, self.ub, self.gb, self.fill, self.origin, self.slots)

    def kw(self):
        kw = dict(buffer_len=self.L, num_k_heads=self.H, validate=True)
        if self.fold is not None:
            kw.update(checkpoint_fold=self.fold, v_buffer=self.vb, beta_buffer=self.bb)
        return kw

    def args(self, inp, j=None):
        pick = (lambda t: t) if j is None else (lambda t: t[:, j])
        return (pick(inp["qkv"]), pick(inp["a"]), pick(inp["b"]), self.A_log, self.dt_bias,
                self.K ** -0.5)

    def ref_step(self, state, inp, j=None):
        from .reference import gdn_prepare_ref, gdn_step_ref
        qkv, a, b, A_log, dt_bias, scale = self.args(inp, j)
        r = gdn_prepare_ref(qkv, a, b, A_log, dt_bias, self.H, self.HV, self.K, self.V, scale)
        return gdn_step_ref(state, r["q"], r["k"], r["v"], r["g"], r["beta"],
                            state_batch_indices=self.slots)

    def state_rel(self):
        """The recurrence's copy (the fold copy with dual precision) vs float64."""
        return self._state_rel(self.fold if self.fold is not None else self.ckpt)


def _kc_gdn_decode(device, route, fold=False):
    from .kernels.cursors import MODE_DECODE, commit
    from .kernels.gdn_replay import gdn_replay_decode
    p = _GDNPool(device, buffer_len=4, seed=5, fold=fold)
    steps = 2 * p.L
    err = 0.0
    for _ in range(steps):
        inp = p.inputs()
        y = gdn_replay_decode(*p.pool(), *p.args(inp), route=route, **p.kw())
        commit(p.fill, p.origin, p.slots, mode=MODE_DECODE, buffer_len=p.L, capacity=p.cap)
        err = max(err, p.rel(y, p.ref_step(p.state, inp)))
    serr = p.state_rel()
    if not p.padded_untouched():
        return FAIL, "the padded row's slot was modified", max(err, serr)
    if fold:
        # outputs read the bf16 copy; the recurrence lives in the fp32 fold copy
        status = FAIL if err > 2e-2 else None
        return status, (f"fold copy {serr:.1e} (max rel err after {steps} steps = 2 buffer "
                        f"cycles), outputs from the bf16 copy {err:.1e}"), serr
    return None, (f"outputs {err:.1e}, checkpoint {serr:.1e} (max rel err over {steps} steps "
                  f"= 2 buffer cycles of {p.L})"), max(err, serr)


def _kc_gdn_verify_flush(device):
    import torch

    from .kernels.cursors import MODE_VERIFY, commit
    from .kernels.gdn_replay import gdn_replay_flush, gdn_replay_verify
    T = 2
    p = _GDNPool(device, buffer_len=5, window=T, seed=6)
    err = 0.0
    # fills 0 -> [1, 2] -> [3, 4] -> both rows flush inside the third verify (fill + 2 >= 5)
    for accepted in ([1, 0, 2], [2, 0, 2], [1, 0, 1]):
        inp = p.inputs(T)
        y = gdn_replay_verify(*p.pool(), *p.args(inp), **p.kw())
        commit(p.fill, p.origin, p.slots, mode=MODE_VERIFY, buffer_len=p.L, capacity=p.cap,
               window=T, accepted=torch.tensor(accepted, dtype=torch.int32, device=device),
               validate=True)
        err = max(err, _check_drafts(p, y, inp, accepted))
    gdn_replay_flush(*p.pool(), buffer_len=p.L, num_k_heads=p.H, validate=True)
    return _after_verify_flush(p, err, T)


# a draft tree of 4 (two branches off the first draft) and, per row of the
# check pools' [2, -1, 0], the accepted path: 0 -> 2 -> 3, and 0 -> 1
_TREE_PARENTS = [-1, 0, 0, 2]
_TREE_PATHS = ([0, 2, 3, 0], [0, 0, 0, 0], [0, 1, 0, 0])
_TREE_ACCEPTED = [3, 0, 2]


def _kc_tree_verify(device, family):
    """Two tree verify steps (a flush inside the second), accept_path moving
    each row's accepted path into place, commit, then a flush."""
    import torch

    from .kernels import cursors as cur
    from .kernels.gdn_replay import gdn_replay_flush, gdn_replay_verify
    from .kernels.mamba2_replay import mamba2_replay_flush, mamba2_replay_verify
    T = len(_TREE_PARENTS)
    gdn = family == "gdn"
    p = (_GDNPool if gdn else _Mamba2Pool)(device, buffer_len=6, window=T, seed=7)
    i32 = dict(dtype=torch.int32, device=device)
    parents = torch.tensor([_TREE_PARENTS] * 3, **i32)
    path, acc = torch.tensor(_TREE_PATHS, **i32), torch.tensor(_TREE_ACCEPTED, **i32)
    rings = [p.kb, p.ub, p.gb] if gdn else [p.xb, p.Bb, p.db]
    err = 0.0
    for _ in range(2):  # fills 0 -> [3, 2] -> the first row flushes (3 + 4 >= 6)
        inp = p.inputs(T)
        if gdn:
            y = gdn_replay_verify(*p.pool(), *p.args(inp), parents=parents, **p.kw())
        else:
            y = mamba2_replay_verify(*p.pool(), inp["x"], inp["dt"], p.A, inp["B"], inp["C"],
                                     z=inp["z"], parents=parents, **p.kw())
        cur.accept_path(rings, p.fill, p.origin, p.slots, path, acc, capacity=p.cap,
                        parents=parents, validate=True)
        cur.commit(p.fill, p.origin, p.slots, mode=cur.MODE_VERIFY, buffer_len=p.L,
                   capacity=p.cap, window=T, accepted=acc, validate=True)
        err = max(err, _check_drafts(p, y, inp, _TREE_ACCEPTED, _TREE_PARENTS, _TREE_PATHS))
    if gdn:
        gdn_replay_flush(*p.pool(), buffer_len=p.L, num_k_heads=p.H, validate=True)
    else:
        mamba2_replay_flush(*p.pool(), p.A, buffer_len=p.L, validate=True)
    return _after_verify_flush(p, err, T, steps=2)


def _kernel_checks(device):
    checks = [("kernel cursors.commit", lambda: _kc_cursors(device))]
    for route in ("output_only", "reconstruct", "split"):
        checks.append((f"kernel decode ({route})", lambda r=route: _kc_decode(device, r)))
    for route in ("output_only", "reconstruct"):
        checks.append((f"kernel verify ({route})", lambda r=route: _kc_verify(device, r)))
    checks.append(("kernel flush", lambda: _kc_flush(device)))
    for route in ("output_only", "split"):
        checks.append((f"kernel GDN decode ({route})",
                       lambda r=route: _kc_gdn_decode(device, r)))
    checks.append(("kernel GDN decode (bf16 + fp32 fold copy)",
                   lambda: _kc_gdn_decode(device, "split", fold=True)))
    checks.append(("kernel GDN verify + flush", lambda: _kc_gdn_verify_flush(device)))
    for family in ("mamba2", "gdn"):
        checks.append((f"kernel tree verify + accept_path ({family})",
                       lambda f=family: _kc_tree_verify(device, f)))
    out = []
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            status, detail, err = fn()
        except Exception as e:  # noqa: BLE001 - a kernel that fails to compile or run is a FAIL
            out.append(_item(name, FAIL, _first_line(e), max_rel_err=None,
                             seconds=round(time.perf_counter() - t0, 2)))
            continue
        if status is None:
            status = OK if (err is not None and err < KERNEL_RTOL) else FAIL
            if status == FAIL:
                detail += f": above the tolerance {KERNEL_RTOL:g}"
        out.append(_item(name, status, detail, max_rel_err=err,
                         seconds=round(time.perf_counter() - t0, 2)))
    return out


def run_check(device="auto"):
    """All checks as a report dict (what ``check --json`` prints)."""
    from . import SGLANG_PIN, __version__
    t0 = time.perf_counter()
    device, notes = _setup_backend(device)
    items = [_check_sglang(), *_check_torch_triton(), _check_device(device)]
    if device == "cpu":
        items.append(_item("triton backend", OK, "interpreter (TRITON_INTERPRET=1)"
                           + (", set by this command" if notes else ""), interpret=True))
    items.append(_check_plugin())
    if any(i["name"] == "triton" and i["status"] == FAIL for i in items):
        items.append(_item("kernels", FAIL, "skipped: triton is not importable"))
    else:
        items.extend(_kernel_checks(device))
    fails = sum(i["status"] == FAIL for i in items)
    warns = sum(i["status"] == WARN for i in items)
    return {"sglang_replayssm": __version__, "sglang_pin": SGLANG_PIN, "device": device,
            "interpret": _interpreting(), "notes": notes, "checks": items, "fails": fails,
            "warns": warns, "ok": fails == 0, "seconds": round(time.perf_counter() - t0, 2),
            "kernel_rtol": KERNEL_RTOL}


def _cmd_check(args):
    report = run_check(args.device)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"sglang-replayssm {report['sglang_replayssm']} check")
        for n in report["notes"]:
            print(f"note: {n}")
        print()
        width = max(len(i["name"]) for i in report["checks"])
        for i in report["checks"]:
            t = f"  [{i['seconds']:.1f} s]" if "seconds" in i else ""
            print(f"  {i['status']:<4}  {i['name']:<{width}}  {i['detail']}{t}")
        print()
        verdict = "OK" if report["ok"] else "FAIL"
        print(f"result: {verdict} ({report['fails']} FAIL, {report['warns']} WARN) "
              f"in {report['seconds']:.1f} s")
    return 0 if report["ok"] else 1


# --------------------------------------------------------------------------
# demo
# --------------------------------------------------------------------------

# Defaults: a small Mamba-2 stack on a GPU; a smaller one under the Triton
# interpreter, where every program of every launch runs in Python (about
# 60 ms per layer and token at the CPU shape, 2 rows): 256 tokens x 2 layers
# took about 35 s on a 2-core machine with another process busy.
DEMO_DEFAULTS = {
    "cuda": dict(tokens=256, layers=4, heads=8, headdim=32, dstate=32, groups=2),
    "cpu": dict(tokens=256, layers=2, heads=4, headdim=32, dstate=64, groups=2),
}


def state_traffic(heads, headdim, dstate, groups, buffer_len, state_bytes, act_bytes):
    """Analytic state bytes read/written per token, per layer and request row.

    Stock (eager ``selective_state_update``): the whole state ``|S|`` is read
    and written every token.

    ReplaySSM, averaged over a buffer cycle of ``buffer_len`` tokens: the
    checkpoint ``|S|`` is read every token and written once per cycle (the
    flush); an input-buffer entry (x [H, P] and B [G, N] in the activation
    dtype, dt [H] in fp32) is written by every token but the flushing one
    (``(L-1)/L`` per token), and the token at fill ``f`` reads the ``f``
    buffered entries (``(L-1)/2`` per token on average). Inputs both methods
    read anyway (x, B, C, dt of the current token) are not counted; B reads
    shared by the heads of a group are counted once (L2).
    """
    L = buffer_len
    S = heads * headdim * dstate * state_bytes
    E = (heads * headdim + groups * dstate) * act_bytes + heads * 4
    stock = {"read": float(S), "written": float(S)}
    replay = {"read": S + E * (L - 1) / 2, "written": S / L + E * (L - 1) / L}
    for d in (stock, replay):
        d["total"] = d["read"] + d["written"]
    return {"state_bytes": S, "buffer_entry_bytes": E, "stock": stock, "replayssm": replay,
            "ratio": stock["total"] / replay["total"]}


def _fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024


class _Stack:
    """A deterministic stack of Mamba-2 SSM layers (no conv, no MLP).

    Layer l maps its input u [b, d] (d = H * P) through a fixed random
    projection to x [b, H, P], B, C [b, G, N] and the raw dt [b, H], runs the
    SSM, and passes ``u + rmsnorm(y)`` to the next layer. A, dt_bias and D
    follow Mamba-2's initialisation ranges (-A and softplus(dt_bias)
    log-uniform in [1, 16] and [1e-3, 1e-1], D = 1).
    """

    def __init__(self, torch, layers, H, P, N, G, seed, device):
        g = torch.Generator().manual_seed(seed)
        self.H, self.P, self.N, self.G = H, P, N, G
        self.d = d = H * P
        self.width = H * P + 2 * G * N + H
        self.layers = []
        for _ in range(layers):
            W = torch.randn(d, self.width, generator=g, dtype=torch.float64) / math.sqrt(d)
            A = -torch.exp(torch.rand(H, generator=g, dtype=torch.float64) * math.log(16.0))
            dt0 = torch.exp(torch.rand(H, generator=g, dtype=torch.float64)
                            * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3))
            dt_bias = dt0 + torch.log(-torch.expm1(-dt0))      # inverse softplus
            D = torch.ones(H, dtype=torch.float64)
            self.layers.append({k: v.to(device) for k, v in
                                dict(W=W, A=A, dt_bias=dt_bias, D=D).items()})

    def params(self, l, dtype):
        return {k: v.to(dtype) for k, v in self.layers[l].items()}

    def split(self, proj):
        """Views into the projection, as SGLang splits in_proj's output."""
        b, H, P, N, G = proj.shape[0], self.H, self.P, self.N, self.G
        o = 0
        x = proj[:, o:o + H * P].view(b, H, P)
        o += H * P
        B = proj[:, o:o + G * N].view(b, G, N)
        o += G * N
        C = proj[:, o:o + G * N].view(b, G, N)
        o += G * N
        dt = proj[:, o:o + H]
        return x, B, C, dt

    @staticmethod
    def next_input(u, y):
        y = y.reshape(u.shape)
        return u + y * (y.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()


def _eager_step(torch, state, slots, x, dt, A, B, C, D, dt_bias):
    """The stock eager decode step (SGLang's ``selective_state_update``
    semantics, no z): read the whole state, update it, write it back (rounded
    to the state dtype), in the dtype of x (fp32 or float64)."""
    H, G = x.shape[1], B.shape[1]
    h = state[slots].to(x.dtype)
    dte = torch.nn.functional.softplus(dt + dt_bias)               # [b, H]
    Bh = B.repeat_interleave(H // G, dim=1)                        # [b, H, N]
    Ch = C.repeat_interleave(H // G, dim=1)
    h = h * torch.exp(dte * A)[..., None, None] + (dte[..., None] * x)[..., None] * Bh[:, :, None]
    state[slots] = h.to(state.dtype)
    return (h * Ch[:, :, None]).sum(-1) + D[:, None] * x


def _worst(ys, ref):
    """max |ys - ref| and max over (token, layer) of max|ys - ref| / max|ref|,
    with the (token, layer) of the latter. ys, ref: [tokens, layers, b, H, P]."""
    diff = (ys.double() - ref.double()).abs().flatten(2).amax(-1)  # [tokens, layers]
    scale = ref.double().abs().flatten(2).amax(-1).clamp_min(1e-30)
    rel = diff / scale
    k = int(rel.argmax())
    t, l = divmod(k, rel.shape[1])
    return float(diff.max()), float(rel.max()), (t, l)


def run_demo(args):
    """Run the demo; returns the report dict (what ``demo --json`` prints)."""
    device, notes = _setup_backend(args.device)
    import torch
    from tqdm import tqdm

    from .kernels.cursors import MODE_DECODE, MODE_FLUSH, commit, required_capacity
    from .kernels.mamba2_replay import mamba2_replay_decode, mamba2_replay_flush

    dflt = DEMO_DEFAULTS["cpu" if device == "cpu" or _interpreting() else "cuda"]
    for k, v in dflt.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    T, nl, H, P, N, G = args.tokens, args.layers, args.heads, args.headdim, args.dstate, args.groups
    L, b = args.buffer_len, args.batch
    for name, v in (("tokens", T), ("layers", nl), ("heads", H), ("headdim", P), ("dstate", N),
                    ("groups", G), ("buffer-len", L), ("batch", b)):
        if v < 1:
            raise SystemExit(f"error: --{name} must be >= 1, got {v}")
    if H % G:
        raise SystemExit(f"error: --heads ({H}) must be a multiple of --groups ({G})")
    sdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.state_dtype]
    act = torch.float32
    tol = args.tolerance if args.tolerance is not None else (
        DEMO_RTOL_FP32 if sdt == torch.float32 else None)

    stack = _Stack(torch, nl, H, P, N, G, args.seed, device)
    cap = required_capacity(L, 1)
    S = b + 1                         # one spare slot; rows use slots b, b-1, .., 1
    slots = torch.arange(b, 0, -1, dtype=torch.int32, device=device)
    sl = slots.long()
    g = torch.Generator().manual_seed(args.seed + 1)
    h0 = [torch.randn(S, H, P, N, generator=g, dtype=torch.float64).to(device) * 0.3
          for _ in range(nl)]          # the state a prefill left behind
    pr32 = [stack.params(l, act) for l in range(nl)]
    pr64 = [stack.params(l, torch.float64) for l in range(nl)]
    stock = [h.to(sdt) for h in h0]
    exact = [h.clone() for h in h0]
    ckpt = [h.to(sdt) for h in h0]
    xbuf = [torch.zeros(S, H, cap, P, dtype=act, device=device) for _ in range(nl)]
    bbuf = [torch.zeros(S, G, cap, N, dtype=act, device=device) for _ in range(nl)]
    dbuf = [torch.zeros(S, H, cap, dtype=torch.float32, device=device) for _ in range(nl)]
    fill = torch.zeros(S, dtype=torch.int32, device=device)
    origin = torch.zeros(S, dtype=torch.int32, device=device)

    shape = (T, nl, b, H, P)
    y_stock = torch.empty(shape, dtype=act, device=device)
    y_rep = torch.empty(shape, dtype=act, device=device)
    y_exact = torch.empty(shape, dtype=torch.float64, device=device)
    flush_rows = 0
    t0 = time.perf_counter()
    bar = tqdm(range(T), desc="decoding", unit="tok", disable=args.no_progress,
               file=sys.stderr, dynamic_ncols=True)
    for t in bar:
        u0 = torch.randn(b, stack.d, generator=g, dtype=torch.float64).to(device)  # embeddings
        u_s, u_r, u_e = u0.to(act), u0.to(act), u0
        for l in range(nl):
            p, q = pr32[l], pr64[l]
            # (a) stock: eager recurrence, whole state read and written
            x, B, C, dt = stack.split(u_s @ p["W"])
            ys = _eager_step(torch, stock[l], sl, x, dt, p["A"], B, C, p["D"], p["dt_bias"])
            # exact: the same recurrence in float64 (a yardstick for both)
            x, B, C, dt = stack.split(u_e @ q["W"])
            ye = _eager_step(torch, exact[l], sl, x, dt, q["A"], B, C, q["D"], q["dt_bias"])
            # (b) ReplaySSM: checkpoint read, input appended to the buffer
            x, B, C, dt = stack.split(u_r @ p["W"])
            yr = mamba2_replay_decode(ckpt[l], xbuf[l], bbuf[l], dbuf[l], fill, origin, slots,
                                      x, dt, p["A"], B, C, buffer_len=L, D=p["D"],
                                      dt_bias=p["dt_bias"])
            y_stock[t, l], y_rep[t, l], y_exact[t, l] = ys, yr, ye
            u_s, u_r, u_e = (stack.next_input(u_s, ys), stack.next_input(u_r, yr),
                             stack.next_input(u_e, ye))
        flush_rows += int(((fill[sl] + 1) >= L).sum())   # the rule the kernels applied
        commit(fill, origin, slots, mode=MODE_DECODE, buffer_len=L, capacity=cap)
    bar.close()
    # end of the request: fold what is still buffered, so the checkpoint is
    # the full state again (as before saving it to a prefix cache)
    pending = int((fill[sl] > 0).sum())
    for l in range(nl):
        mamba2_replay_flush(ckpt[l], xbuf[l], bbuf[l], dbuf[l], fill, origin, slots,
                            pr32[l]["A"], buffer_len=L)
    commit(fill, origin, slots, mode=MODE_FLUSH, buffer_len=L, capacity=cap)
    elapsed = time.perf_counter() - t0

    abs_d, rel_d, where = _worst(y_rep, y_stock)
    _, rel_se, _ = _worst(y_stock, y_exact)
    _, rel_re, _ = _worst(y_rep, y_exact)
    fin = max(((ckpt[l][sl].double() - stock[l][sl].double()).abs().max()
               / stock[l][sl].double().abs().max()).item() for l in range(nl))
    sb = torch.empty((), dtype=sdt).element_size()
    traffic = state_traffic(H, P, N, G, L, sb, torch.empty((), dtype=act).element_size())
    if tol is not None:
        passed, criterion = rel_d <= tol, f"max rel diff vs stock <= {tol:g}"
    else:
        # a bf16 state: stock rounds it every token, ReplaySSM once per flush,
        # so the two differ by bf16 rounding; ask that ReplaySSM be no farther
        # from the exact recurrence than stock is (with a margin)
        passed = rel_re <= BF16_MARGIN * rel_se
        criterion = f"ReplaySSM vs exact <= {BF16_MARGIN:g} x stock vs exact"
    typical = state_traffic(*TYPICAL_SHAPE, L, sb, 2)
    return {
        "device": device, "interpret": _interpreting(), "notes": notes,
        "config": dict(tokens=T, layers=nl, heads=H, headdim=P, dstate=N, groups=G,
                       buffer_len=L, batch=b, state_dtype=args.state_dtype,
                       act_dtype="float32", seed=args.seed),
        "max_abs_diff": abs_d, "max_rel_diff": rel_d, "worst_token_layer": list(where),
        "max_rel_diff_stock_vs_exact": rel_se, "max_rel_diff_replayssm_vs_exact": rel_re,
        "final_state_max_rel_diff": fin,
        "flushes_per_row": flush_rows / b, "checkpoint_writes": flush_rows * nl,
        "end_flush_rows": pending,
        "traffic_per_token_per_layer": traffic, "bytes_ratio": traffic["ratio"],
        "typical_shape": dict(zip(("heads", "headdim", "dstate", "groups"), TYPICAL_SHAPE),
                              act_dtype="bfloat16", bytes_ratio=typical["ratio"]),
        "tolerance": tol, "criterion": criterion, "passed": passed,
        "seconds": round(elapsed, 2),
    }


def _print_demo(r):
    c = r["config"]
    for n in r["notes"]:
        print(f"note: {n}")
    print(f"ReplaySSM demo on {r['device']}" + (" (Triton interpreter)" if r["interpret"] else ""))
    print(f"  {c['layers']} Mamba-2 layers (H={c['heads']} P={c['headdim']} N={c['dstate']} "
          f"G={c['groups']}), batch {c['batch']}, {c['tokens']} tokens, buffer_len "
          f"{c['buffer_len']}, {c['state_dtype']} state, {c['act_dtype']} activations, "
          f"seed {c['seed']}")
    print("  stock = the eager recurrence in torch fp32 (selective_state_update semantics: the "
          "whole state read and written every token); ReplaySSM = mamba2_replay_decode per "
          "layer + one cursors.commit per token")
    caveat = "; interpreter timings say nothing about GPU speed" if r["interpret"] else ""
    print(f"  decoded in {r['seconds']:.1f} s (both methods{caveat})")
    print()
    t, l = r["worst_token_layer"]
    print("outputs, ReplaySSM vs stock (each layer's y, all tokens and layers; relative = "
          "max|diff| / max|stock y| per token and layer):")
    print(f"  max abs diff {r['max_abs_diff']:.3e}   max rel diff {r['max_rel_diff']:.3e} "
          f"(token {t}, layer {l}, 0-based)")
    print(f"  vs an exact float64 recurrence: stock {r['max_rel_diff_stock_vs_exact']:.3e}, "
          f"ReplaySSM {r['max_rel_diff_replayssm_vs_exact']:.3e}")
    print(f"  final state after the end-of-request flush vs stock state: max rel diff "
          f"{r['final_state_max_rel_diff']:.3e}")
    print(f"flushes: {r['flushes_per_row']:g} per request row (one every {c['buffer_len']} "
          f"tokens) = {r['checkpoint_writes']} checkpoint writes over {c['batch']} rows x "
          f"{c['layers']} layers, + {r['end_flush_rows']} row(s) flushed at the end")
    tr = r["traffic_per_token_per_layer"]
    print()
    print(f"state traffic per token, per layer and request row (analytic, from the shapes and "
          f"dtypes; |S| = {_fmt_bytes(tr['state_bytes'])}, buffer entry "
          f"{_fmt_bytes(tr['buffer_entry_bytes'])}):")
    print(f"  {'':<10}{'read':>12}{'written':>12}{'total':>12}")
    for name, key in (("stock", "stock"), ("ReplaySSM", "replayssm")):
        d = tr[key]
        print(f"  {name:<10}{_fmt_bytes(d['read']):>12}{_fmt_bytes(d['written']):>12}"
              f"{_fmt_bytes(d['total']):>12}")
    ty = r["typical_shape"]
    print(f"  ratio stock / ReplaySSM: {r['bytes_ratio']:.2f}x (at most 2x: the checkpoint is "
          "still read every token)")
    print(f"  for scale, at H={ty['heads']} P={ty['headdim']} N={ty['dstate']} G={ty['groups']} "
          f"(a Mamba-2 2.7B layer), bf16 activations, the same state dtype and buffer_len: "
          f"{ty['bytes_ratio']:.2f}x")
    print()
    verdict = "OK" if r["passed"] else "FAIL"
    print(f"result: {verdict} ({r['criterion']}: "
          f"{'holds' if r['passed'] else 'does not hold'})")


def _cmd_demo(args):
    try:
        r = run_demo(args)
    except ValueError as e:   # the launchers' argument checks, e.g. an unsupported shape
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        _print_demo(r)
    return 0 if r["passed"] else 1


# --------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------

def build_parser():
    from . import __version__
    ap = argparse.ArgumentParser(prog="sglang-replayssm",
                                 description="ReplaySSM decoding kernels for SGLang.")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser("check", help="check versions, device, plugin and kernels",
                       description="Report what serving with ReplaySSM needs: OK/WARN/FAIL "
                                   "per item; exit status 1 if anything FAILs.")
    c.add_argument("--json", action="store_true", help="print a JSON report")
    c.add_argument("--device", default="auto", help="auto (default), cuda or cpu")
    c.set_defaults(func=_cmd_check)

    d = sub.add_parser(
        "demo", help="decode through a small SSM stack, stock vs ReplaySSM",
        description="Decode through a stack of Mamba-2 layers with the stock eager recurrence "
                    "and with ReplaySSM; print the output difference, the flushes and the "
                    "state traffic. Defaults depend on the device: "
                    + "; ".join(f"{k}: " + ", ".join(f"{a}={v}" for a, v in dd.items())
                                for k, dd in DEMO_DEFAULTS.items()) + ".")
    for name, help_ in (("tokens", "tokens to decode"), ("layers", "SSM layers in the stack"),
                        ("heads", "SSM heads H"), ("headdim", "head dim P"),
                        ("dstate", "state dim N"), ("groups", "B/C groups G")):
        d.add_argument(f"--{name}", type=int, default=None,
                       help=f"{help_} (default: {DEMO_DEFAULTS['cuda'][name]} on CUDA, "
                            f"{DEMO_DEFAULTS['cpu'][name]} under the interpreter)")
    d.add_argument("--buffer-len", type=int, default=16, help="tokens per flush (default 16)")
    d.add_argument("--batch", type=int, default=2, help="request rows (default 2)")
    d.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32")
    d.add_argument("--device", default="auto", help="auto (default), cuda or cpu")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--tolerance", type=float, default=None,
                   help=f"max rel diff vs stock allowed (default {DEMO_RTOL_FP32:g} for a "
                        "float32 state; for bfloat16 the default test is that ReplaySSM be "
                        f"no farther from an exact float64 recurrence than {BF16_MARGIN:g}x "
                        "stock's distance)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.add_argument("--json", action="store_true", help="print a JSON report")
    d.set_defaults(func=_cmd_demo)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
