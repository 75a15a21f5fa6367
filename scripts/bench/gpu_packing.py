#!/usr/bin/env python3
"""Packed rows on a CUDA card: trainer's attention paths for packed causal rows, against padded rows, same run.

    TRAINER_BINARY=build-gpu/trainer python3 scripts/bench/gpu_packing.py [--model qwen2-100m] [--steps 30]

Sides (the same examples every step, data in file order, AdamW, bf16-mixed unless --precision says otherwise):
  padded        data.packing=false: each micro-batch padded to its longest example
  whole-row     data.packing=true, TRAINER_PACKED_ATTENTION=whole-row: SDPA over each packed row with the
                block-diagonal mask (every pair of the row scored, pairs across examples masked)
  per-example   data.packing=true, TRAINER_PACKED_ATTENTION=per-example: examples gathered into length groups,
                SDPA per group
  varlen        data.packing=true, the default (auto): ATen's variable-length flash attention on the real tokens

Target tokens/s over the steps after --warmup (from the per-step progress lines, timestamped on arrival; the
medians of --repeats alternating runs), peak device memory (metrics.jsonl memory_peak), and the last step's loss:
every side trains the same examples, so the losses agree within bf16 rounding. Needs a CUDA build of trainer and
the Python with transformers that writes the model's config.json (vs_hf.model_dir); random weights.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, TRAINER, ensure_data, fresh_dir, run_measured, table, write_json  # noqa: E402
from vs_hf import model_dir, tokens_per_second, trainer_steps  # noqa: E402

SIDES = {
    "padded": ({"packing": False}, None),
    "whole-row": ({"packing": True}, "whole-row"),
    "per-example": ({"packing": True}, "per-example"),
    "varlen": ({"packing": True}, "auto"),
}


def run_side(name, model, data, out, args):
    data_options, mode = SIDES[name]
    config = {
        "model": {"path": model, "init": "random"},
        "data": {"train_files": [data], "shuffle": False, "max_length": args.max_length, **data_options},
        "training": {"batch_size": args.batch, "micro_batch_size": args.batch, "max_steps": args.steps, "seed": 1},
        "optimizer": {"lr": 1e-4},
        "precision": {"mode": args.precision},
        "device": {"type": args.device},
        "checkpoint": {"output_dir": out, "save_final": False, "every_steps": 0},
        "evaluation": {"every_steps": 0},
        "logging": {"every_steps": 1, "tensorboard": False, "progress": "plain"},
    }
    fresh_dir(out)
    path = os.path.join(out, "config.json")
    write_json(path, config)
    env = dict(os.environ)
    env.pop("TRAINER_PACKED_ATTENTION", None)
    if mode:
        env["TRAINER_PACKED_ATTENTION"] = mode
    run = run_measured([TRAINER, "--config", path], env=env)
    if run.returncode != 0:
        sys.exit(f"{name}: trainer exited {run.returncode}\n" + run.text()[-3000:])
    metrics = os.path.join(out, "metrics.jsonl")
    steps = trainer_steps(run, metrics)  # [(seconds, target tokens, loss)]
    with open(metrics) as f:
        peak = max(record.get("memory_peak", 0) for record in map(json.loads, f))
    return tokens_per_second(steps, args.warmup), peak, steps[-1][2], sum(tokens for _, tokens, _ in steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2-100m")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--sides", nargs="+", default=list(SIDES))
    parser.add_argument("--device", default="cuda", help="cuda; cpu to try the script (varlen then runs per-example)")
    args = parser.parse_args()
    model = model_dir(args.model)
    data = ensure_data("causal", args.records)
    results = {side: [] for side in args.sides}
    for repeat in range(args.repeats):
        order = args.sides if repeat % 2 == 0 else list(reversed(args.sides))
        for side in order:
            out = os.path.join(ROOT, "build", "bench", "gpu-packing", side)
            results[side].append(run_side(side, model, data, out, args))
            print(f"{side}: {results[side][-1][0]:,.0f} tokens/s", file=sys.stderr, flush=True)
    base = statistics.median(r[0] for r in results[args.sides[0]])
    rows = []
    for side in args.sides:
        rate = statistics.median(r[0] for r in results[side])
        peak = max(r[1] for r in results[side])
        rows.append([side, f"{rate:,.0f}", f"{rate / base:.2f}x", f"{peak / 2**30:.2f} GiB",
                     f"{results[side][0][2]:.4f}", f"{results[side][0][3]:,}"])
    print(f"{args.model}, {args.precision}, batch {args.batch} examples, max_length {args.max_length}, "
          f"{args.steps} steps ({args.warmup} warm-up), median of {args.repeats}")
    print(table(["side", "target tokens/s", f"vs {args.sides[0]}", "peak memory", "last loss", "target tokens"],
                rows))


if __name__ == "__main__":
    main()
