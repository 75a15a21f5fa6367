#!/usr/bin/env python3
"""Data parallelism for image classification on this machine's cores: 2 ranks x 1 thread (`trainer launch
--nproc-per-node 2`, Gloo on 127.0.0.1; each rank decodes and trains half of every effective batch) against 1 process
x 1 thread (1 decoding worker) and 1 process x 2 threads (2 decoding workers), configs/tiny-vit.json with the same
global batch, micro-batch and steps, run in rotation. Prints a table: images/s of each side (steps after the warm-up),
the ratios, peak RSS (one process; the launcher's largest rank) and the share of rank 0's run spent in collectives
(waiting for the other rank included).

    .venv/bin/python scripts/bench/image_distributed.py [--steps 40] [--batch 32] [--repeats 3]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BENCH_DIR, TRAINER, load_average, log, machine_notes, median  # noqa: E402
from distributed_scaling import short_run  # noqa: E402


def one_run(out_dir, ranks, threads, steps, batch, micro):
    """Trains tiny-vit on `ranks` processes of `threads` intra-op threads and as many decoding workers each; returns
    the run, the step times, the images seen by step and rank 0's seconds in collectives."""
    return short_run(TRAINER, "configs/tiny-vit.json", out_dir, ranks, threads, steps, batch, micro)

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = os.path.join(BENCH_DIR, "runs", "image_distributed")
    sides = {(1, 1): [], (1, 2): [], (2, 1): []}
    order = list(sides)
    for r in range(args.repeats):
        for ranks, threads in order[r % 3:] + order[:r % 3]:
            load = load_average()
            run, times, images, comm = one_run(os.path.join(work, f"{ranks}x{threads}"), ranks, threads, args.steps,
                                               args.batch, args.micro)
            last = max(times)
            rate = (images[last] - images[args.warmup]) / (times[last] - times[args.warmup])
            sides[(ranks, threads)].append({"rate": rate, "rss": run.peak_rss, "comm": comm / run.seconds})
            log(f"rep {r + 1}/{args.repeats} {ranks} rank(s) x {threads} thread(s): {rate:.0f} images/s, load {load}")
    rate = {k: median([s["rate"] for s in v]) for k, v in sides.items()}
    rss = {k: median([s["rss"] for s in v]) / 2**20 for k, v in sides.items()}
    print(f"{machine_notes()}\n")
    print("| model | batch | micro-batch | 1 process x 1 thread: images/s | 1 process x 2 threads: images/s "
          "| 2 ranks x 1 thread: images/s | 2 ranks / 1 x 1 | 2 ranks / 1 x 2 "
          "| peak RSS (1x1, 1x2, largest rank) | rank 0 time in collectives |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| tiny-vit | {args.batch} | {args.micro} | {rate[(1, 1)]:.0f} | {rate[(1, 2)]:.0f} | {rate[(2, 1)]:.0f} "
          f"| {rate[(2, 1)] / rate[(1, 1)]:.2f}x | {rate[(2, 1)] / rate[(1, 2)]:.2f}x "
          f"| {rss[(1, 1)]:.0f}, {rss[(1, 2)]:.0f}, {rss[(2, 1)]:.0f} MiB "
          f"| {median([s['comm'] for s in sides[(2, 1)]]):.0%} of the run |")
    print(f"\n{args.repeats} runs of each side, in rotation; medians; {args.steps} steps, measured after "
          f"{args.warmup} warm-up steps.")


if __name__ == "__main__":
    main()
