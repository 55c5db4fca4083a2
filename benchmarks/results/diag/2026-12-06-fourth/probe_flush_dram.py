"""One-off probe (2026-12-06, fourth session): DRAM and L2 traffic of GDN's
split projection (A) on a plain step and on a flush step, Qwen3-Next shape,
b=256, L=16, under Nsight Compute:

  ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,\
gpu__time_duration.sum -k regex:_gdn_split_projection python3 probe_flush_dram.py [fp32|bf16]

Launch 1 is a plain step (every row at fill 0), launch 2 a flush step
(every row at fill L-1, a full ring of history). A second argument "keep"
times SplitConfig.keep_tile_in_l2 (needs 68eaafb, reverted)."""
import sys

import torch

from sglang_replayssm.kernels import gdn_replay as gdn
from sglang_replayssm.kernels.cursors import required_capacity

dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1] if len(sys.argv) > 1 else "fp32"]
b, H, HV, K, V, L = 256, 16, 32, 128, 128, 16
S, cap = b + 1, required_capacity(L, 1)
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
ckpt = (torch.randn(S, HV, V, K, device=dev, generator=g) * 0.05).to(dt)
kb = torch.nn.functional.normalize(torch.randn(S, H, cap, K, device=dev, generator=g), dim=-1).to(dt)
ub = (torch.randn(S, HV, cap, V, device=dev, generator=g) * 0.1).to(dt)
gb = -torch.rand(S, HV, cap, device=dev, generator=g) * 0.1
fill = torch.zeros(S, dtype=torch.int32, device=dev)
origin = torch.zeros_like(fill)
slots = torch.randperm(S - 1, device=dev)[:b].to(torch.int32)
qkv = torch.randn(b, 2 * H * K + HV * V, device=dev, generator=g).to(torch.bfloat16)
a = torch.randn(b, HV, device=dev, generator=g).to(torch.bfloat16)
bb = torch.randn(b, HV, device=dev, generator=g).to(torch.bfloat16)
A_log = torch.randn(HV, device=dev, generator=g) * 0.5
dt_bias = torch.randn(HV, device=dev, generator=g).to(torch.bfloat16)
config = gdn.default_config(V, K, dt, b, route="split")
if sys.argv[2:] == ["keep"]:
    import dataclasses
    config = dataclasses.replace(config, keep_tile_in_l2=True)
for f in (0, L - 1):  # plain step, then flush step (cursors are not committed)
    fill.fill_(f)
    gdn.gdn_replay_decode(ckpt, kb, ub, gb, fill, origin, slots, qkv, a, bb, A_log, dt_bias,
                          K ** -0.5, buffer_len=L, num_k_heads=H, route="split",
                          config=config)
torch.cuda.synchronize()
state = ckpt[0].numel() * ckpt.element_size() * b
print(f"state bytes {state / 1e6:.1f} MB ({dt})")
