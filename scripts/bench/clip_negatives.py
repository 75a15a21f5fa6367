#!/usr/bin/env python3
"""What the two contrastive modes cost (docs/clip.md): one step's forward and backward of a small random CLIP
(4 + 4 layers of width 256, 64 px images in 8 px patches, 32-token captions) over one effective batch, run as one
autograd graph (the whole batch in memory), with gradient caching in micro-batches, and with micro-batch
negatives. The three sides alternate in one process (build/trainer_clip_parity bench); medians of the rounds.
Peak is the CPU budget allocator's highest live tensor bytes during the step, above the weights. Prints a
Markdown table.

    .venv/bin/python scripts/bench/clip_negatives.py [--tool build/trainer_clip_parity] [--batch 64] [--micro 8 16]
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, machine_notes, table  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", default=os.path.join(ROOT, "build", "trainer_clip_parity"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    full = None
    for micro in args.micro:
        result = subprocess.run([args.tool, "bench", str(args.batch), str(micro), str(args.rounds)], check=True,
                                capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        for line in result.stdout.splitlines():
            side = json.loads(line)
            if side["side"].startswith("full"):
                if full is not None:
                    continue
                full = side
            rows.append(side)
    out = []
    for side in rows:
        out.append([side["side"], side["batch"], side["micro_batch"], f"{side['peak_bytes'] / 2**20:.1f}",
                    f"{side['peak_bytes'] / full['peak_bytes']:.2f}x", f"{side['seconds']:.3f}",
                    f"{side['seconds'] / full['seconds']:.2f}x"])
    print(table(["side", "effective batch", "micro-batch", "peak MiB", "peak vs one graph", "seconds / step",
                 "time vs one graph"], out))
    print()
    print(machine_notes())


if __name__ == "__main__":
    main()
