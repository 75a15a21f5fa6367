"""Packed causal rows on a CUDA card: the three ways trainer can attend within examples, forward + backward.

  whole-row   SDPA over each packed row with a block-diagonal causal mask (B, 1, T, T): every pair of the row is
              scored, pairs across examples masked (what runs when per-segment attention is off)
  per-segment the examples gathered into one batch padded to the longest, SDPA with a (n, 1, L, L) mask (the
              shape of trainer's per-segment path with a single length group)
  varlen      ATen's variable-length flash attention: the real tokens as one stream, cumulative sequence
              lengths, causal; no pair across examples and no padding is scored

Needs a CUDA PyTorch and a card that runs flash attention (sm80+). Prints a table: time per forward + backward
(median of CUDA-event timings), attention FLOP/s counted on the causal pairs inside examples only, and the largest
difference of each path's output and input gradients from the first path that ran (varlen) (bf16 runs: ~1e-2 is rounding).

    python3 scripts/bench/gpu_packed_attention.py [--rows 8] [--length 2048] [--heads 16] [--kv-heads 2]
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
import torch.nn.functional as F


def segments_for(rows: int, length: int, low: int, high: int, rng: random.Random) -> list[list[int]]:
    """Per row, example lengths filling it (the last one clipped), like collate_packed's rows."""
    out = []
    for _ in range(rows):
        lengths, used = [], 0
        while used < length:
            n = min(rng.randint(low, high), length - used)
            lengths.append(n)
            used += n
        out.append(lengths)
    return out


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--min-example", type=int, default=64)
    parser.add_argument("--max-example", type=int, default=700)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    rng = random.Random(0)
    torch.manual_seed(0)
    B, T, H, Hkv, d = args.rows, args.length, args.heads, args.kv_heads, args.head_dim
    lengths = segments_for(B, T, args.min_example, args.max_example, rng)
    flat = [n for row in lengths for n in row]
    total = sum(flat)
    assert total == B * T
    cu = torch.tensor([0] + list(torch.tensor(flat).cumsum(0).tolist()), dtype=torch.int32, device=dev)
    max_len = max(flat)

    q = torch.randn(B, T, H, d, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(B, T, Hkv, d, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(B, T, Hkv, d, device=dev, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(B, T, H, d, device=dev, dtype=dtype)

    # Segment id per position and position within the segment.
    seg = torch.empty(B, T, dtype=torch.int64)
    pos = torch.empty(B, T, dtype=torch.int64)
    for b, row in enumerate(lengths):
        at = 0
        for i, n in enumerate(row):
            seg[b, at:at + n] = i + 1
            pos[b, at:at + n] = torch.arange(n)
            at += n
    seg, pos = seg.to(dev), pos.to(dev)
    row_mask = (seg[:, :, None] == seg[:, None, :]) & (pos[:, :, None] >= pos[:, None, :])  # (B, T, T)
    row_mask = row_mask[:, None]

    # Per-segment gather indices: slot (i, j) -> flattened position, padded slots repeat the first position.
    starts = cu[:-1].long()
    n_seg = len(flat)
    lens = torch.tensor(flat, device=dev)
    slot = torch.arange(max_len, device=dev)
    gather = (starts[:, None] + slot[None, :]).clone()
    real = slot[None, :] < lens[:, None]
    gather = torch.where(real, gather, starts[:, None].expand_as(gather))
    seg_mask = real[:, None, None, :] & (slot[None, None, :, None] >= slot[None, None, None, :])
    seg_mask = seg_mask | ~real[:, None, :, None]  # padding query slots see everything (no empty softmax row)
    scatter = (real.flatten().nonzero().squeeze(1))

    def whole_row():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=row_mask, enable_gqa=True)
        return out.transpose(1, 2)

    def per_segment():
        qf, kf, vf = q.reshape(B * T, H, d), k.reshape(B * T, Hkv, d), v.reshape(B * T, Hkv, d)
        qs = qf[gather].transpose(1, 2)
        ks = kf[gather].transpose(1, 2)
        vs = vf[gather].transpose(1, 2)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seg_mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(n_seg * max_len, H, d)[scatter]
        return out.reshape(B, T, H, d)

    def varlen():
        out = torch.ops.aten._flash_attention_forward(
            q.reshape(B * T, H, d), k.reshape(B * T, Hkv, d), v.reshape(B * T, Hkv, d), cu, cu, max_len, max_len,
            0.0, True, False)[0]
        return out.reshape(B, T, H, d)

    def step(fn):
        def run():
            q.grad = k.grad = v.grad = None
            fn().backward(grad_out)
        return run

    results = {}
    for name, fn in (("varlen", varlen), ("per-segment", per_segment), ("whole-row", whole_row)):
        q.grad = k.grad = v.grad = None
        try:
            out = fn()
            out.backward(grad_out)
            results[name] = (out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float(),
                             timed(step(fn), args.repeats))
        except Exception as error:  # a path this card or build cannot run: say so in its row
            results[name] = str(error).splitlines()[0][:100]

    # FLOPs inside examples, causal: forward 2 matmuls x 2 flops x pairs x d x H; backward 2.5x forward.
    pairs = sum(n * (n + 1) // 2 for n in flat)
    flops = 4 * pairs * d * H * 3.5
    print(f"{B} rows x {T} tokens, {n_seg} examples ({min(flat)}-{max_len} tokens), H={H} Hkv={Hkv} d={d}, "
          f"{args.dtype}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    ref_name = next((name for name, r in results.items() if not isinstance(r, str)), None)
    ref = results[ref_name] if ref_name else "none ran"
    print(f"{'path':<12} {'ms fwd+bwd':>10} {'TFLOP/s':>8} {'time vs ' + str(ref_name):>16} {'max|out diff|':>13} {'max|grad diff|':>14}")
    for name, r in results.items():
        if isinstance(r, str):
            print(f"{name:<12} failed: {r}")
            continue
        out_diff = grad_diff = float("nan")
        speed = float("nan")
        if not isinstance(ref, str):
            # Only real positions matter for the out diff (all positions here are real).
            out_diff = (r[0] - ref[0]).abs().max().item()
            grad_diff = max((a - b).abs().max().item() for a, b in zip(r[1:4], ref[1:4]))
            speed = r[4] / ref[4]
        print(f"{name:<12} {r[4] * 1e3:>10.3f} {flops / r[4] / 1e12:>8.1f} {speed:>15.2f}x {out_diff:>13.2e} "
              f"{grad_diff:>14.2e}")


if __name__ == "__main__":
    main()
