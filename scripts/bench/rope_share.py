#!/usr/bin/env python3
"""RoPE's cost per qwen2-100m step (issue 19: "RoPE applied in place", kept only if it measures worth it): the ops
trainer runs (src/models/decoder/decoder.cpp: q * cos + rotate_half(q) * sin, and the same for the keys), forward and backward,
12 layers, batch 8 x 120 positions, 12 query heads and 2 key heads of 64, one thread, fp32 and bf16; prints the
median of 7 timed steps. Compare with a step's time from vs_hf.py (docs/benchmarks.md).

    .venv/bin/python scripts/bench/rope_share.py
"""
import time

import torch

torch.set_num_threads(1)
B, T, D = 8, 120, 64
def rotate_half(x):
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return torch.cat((-x2, x1), -1)
pos = torch.arange(T, dtype=torch.float32)
inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
emb = torch.cat([torch.outer(pos, inv)] * 2, -1)
c, s = emb.cos()[None, None], emb.sin()[None, None]
def one(dtype):
    q = torch.randn(B, 12, T, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, 2, T, D, dtype=dtype, requires_grad=True)
    cc, ss = c.to(dtype), s.to(dtype)
    t0 = time.perf_counter()
    for _ in range(12):
        qo = q * cc + rotate_half(q) * ss
        ko = k * cc + rotate_half(k) * ss
        (qo.sum() + ko.sum()).backward()
    return time.perf_counter() - t0
for dtype in (torch.float32, torch.bfloat16):
    one(dtype)
    ts = sorted(one(dtype) for _ in range(7))
    print(dtype, f"{ts[3]*1000:.1f} ms per step of 12 layers (median of 7)")
