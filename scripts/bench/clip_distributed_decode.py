#!/usr/bin/env python3
"""Contrastive (CLIP) data parallelism: what decoding only each rank's share of the effective batch saves. Two
trainer binaries, BEFORE (every rank decodes and tokenizes the whole effective batch and embeds its share: pass a
build of an older commit with --before) and AFTER (this build: each rank decodes and tokenizes only its share), each
as 2 ranks x 1 thread (`trainer launch --nproc-per-node 2`, Gloo on 127.0.0.1) on configs/tiny-clip.json with the
same global batch, micro-batch and steps, run alternately. Prints a table: pairs/s of each side (steps after the
warm-up), their ratio, and the share of rank 0's run spent in collectives. The demo images are tiny (about 40 x 60
pixels: decoding them costs almost nothing); --image-size S re-encodes them as S x S JPEGs (quality 90, Pillow)
first, photo-sized sources whose decoding is real work next to tiny-clip's small towers.

    .venv/bin/python scripts/bench/clip_distributed_decode.py --before /path/to/old/trainer [--image-size 480]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BENCH_DIR, ROOT, TRAINER, load_average, log, machine_notes, median  # noqa: E402
from distributed_scaling import short_run  # noqa: E402


def large_images(size):
    """The training pairs with every image re-encoded as a `size` x `size` JPEG; returns the JSONL's path."""
    from PIL import Image

    root = os.path.join(ROOT, "data", "demo", "images")
    out = os.path.join(BENCH_DIR, "data", f"clip_captions_{size}")
    listing = os.path.join(out, "train-captions.jsonl")
    if os.path.exists(listing):
        return listing
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(root, "train-captions.jsonl")) as f:
        records = [json.loads(line) for line in f]
    for i, record in enumerate(records):
        path = os.path.join(out, f"{i:04d}.jpg")
        Image.open(os.path.join(root, record["image"])).convert("RGB").resize((size, size), Image.BICUBIC).save(
            path, quality=90)
        record["image"] = path
    with open(listing + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(listing + ".tmp", listing)
    return listing


def one_run(binary, out_dir, steps, batch, micro, train_files):
    """Trains tiny-clip on 2 ranks of 1 thread and 1 decoding worker each; returns the run, the step times, the pairs
    seen by step and rank 0's seconds in collectives."""
    extra = [f"data.train_files=[{json.dumps(train_files)}]"] if train_files else []
    return short_run(binary, "configs/tiny-clip.json", out_dir, 2, 1, steps, batch, micro, extra)

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True, help="a trainer binary whose ranks decode every pair")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=0,
                        help="re-encode the images as S x S JPEGs (0: as they are)")
    args = parser.parse_args()
    train_files = large_images(args.image_size) if args.image_size > 0 else None
    work = os.path.join(BENCH_DIR, "runs", "clip_distributed_decode")
    binaries = {"before": args.before, "after": TRAINER}
    sides = {name: [] for name in binaries}
    for r in range(args.repeats):
        for name in (["before", "after"] if r % 2 == 0 else ["after", "before"]):
            load = load_average()
            run, times, pairs, comm = one_run(binaries[name], os.path.join(work, name), args.steps, args.batch,
                                              args.micro, train_files)
            last = max(times)
            rate = (pairs[last] - pairs[args.warmup]) / (times[last] - times[args.warmup])
            sides[name].append({"rate": rate, "comm": comm / run.seconds})
            log(f"rep {r + 1}/{args.repeats} {name}: {rate:.0f} pairs/s, load {load}")
    rate = {k: median([s["rate"] for s in v]) for k, v in sides.items()}
    comm = {k: median([s["comm"] for s in v]) for k, v in sides.items()}
    print(f"{machine_notes()}\n")
    print("| model | images | batch | micro-batch | every rank decodes all: pairs/s | each rank its share: pairs/s "
          "| after / before | rank 0 time in collectives (before, after) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    images = f"{args.image_size} x {args.image_size} JPEG" if args.image_size > 0 else "demo (about 40 x 60)"
    print(f"| tiny-clip | {images} | {args.batch} | {args.micro} | {rate['before']:.0f} | {rate['after']:.0f} "
          f"| {rate['after'] / rate['before']:.2f}x | {comm['before']:.0%}, {comm['after']:.0%} of the run |")
    print(f"\n2 ranks x 1 thread each side; {args.repeats} runs of each side, alternately; medians; {args.steps} "
          f"steps, measured after {args.warmup} warm-up steps.")


if __name__ == "__main__":
    main()
