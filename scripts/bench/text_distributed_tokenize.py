#!/usr/bin/env python3
"""Text data parallelism: what tokenizing only each rank's share of the records saves. Two trainer binaries, BEFORE
(every rank tokenizes every record: pass a build of an older commit with --before) and AFTER (this build: each rank
tokenizes its share and the ranks exchange the outcomes per chunk of 64 records), each as 2 ranks x 1 thread
(`trainer launch --nproc-per-node 2`, Gloo on 127.0.0.1, one tokenizing worker per rank) on configs/tiny-qwen2.json
with the same batch, micro-batch and steps, run alternately. The records are long documents (--chars characters of
recipe text each) truncated to data.max_length: tokenizing a record costs its whole text, training only 192 tokens,
the case where tokenizing is visible next to a tiny model's step. Prints a table: target tokens/s of each side (steps
after the warm-up), their ratio, rank 0's share of the run in collectives, and the records each rank tokenized.

    .venv/bin/python scripts/bench/text_distributed_tokenize.py --before /path/to/old/trainer [--chars 20000]
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BENCH_DIR, ROOT, TRAINER, load_average, log, machine_notes, median  # noqa: E402
from distributed_scaling import short_run  # noqa: E402

TOKENIZED_LINE = re.compile(r"^    rank (\d+): .*, (\d+) records tokenized$", re.M)


def long_documents(chars, records=1200):
    """`records` causal records: a demo recipe's prompt, and as completion the demo recipes' texts joined up to
    `chars` characters; returns the path."""
    path = os.path.join(BENCH_DIR, "data", f"long-documents-{chars}-{records}.jsonl")
    if os.path.exists(path):
        return path
    with open(os.path.join(ROOT, "data", "demo", "recipes-causal.jsonl")) as f:
        recipes = [json.loads(line) for line in f]
    texts = [r["prompt"] + r["completion"] for r in recipes]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".part", "w") as out:
        for i in range(records):
            parts, size, k = [], 0, i
            while size < chars:
                parts.append(texts[k % len(texts)])
                size += len(parts[-1]) + 1
                k += 7
            prompt = recipes[i % len(recipes)]["prompt"]
            out.write(json.dumps({"prompt": prompt, "completion": " " + " ".join(parts)[:chars]}) + "\n")
    os.replace(path + ".part", path)
    return path


def one_run(binary, out_dir, steps, batch, micro, train_file):
    """Trains tiny-qwen2 on 2 ranks of 1 thread and 1 tokenizing worker each; returns the run, the step times, the
    target tokens seen by step, rank 0's seconds in collectives and the records each rank tokenized (AFTER only)."""
    run, times, tokens, comm = short_run(binary, "configs/tiny-qwen2.json", out_dir, 2, 1, steps, batch, micro,
                                         ["evaluation.sample_prompts=[]", f"data.train_files=[{json.dumps(train_file)}]"])
    tokenized = {int(m.group(1)): int(m.group(2)) for m in TOKENIZED_LINE.finditer(run.text())}
    return run, times, tokens, comm, tokenized

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True, help="a trainer binary whose ranks tokenize every record")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chars", type=int, default=20000, help="characters of text per record")
    args = parser.parse_args()
    train_file = long_documents(args.chars)
    work = os.path.join(BENCH_DIR, "runs", "text_distributed_tokenize")
    binaries = {"before": args.before, "after": TRAINER}
    sides = {name: [] for name in binaries}
    tokenized = {}
    for r in range(args.repeats):
        for name in (["before", "after"] if r % 2 == 0 else ["after", "before"]):
            load = load_average()
            run, times, tokens, comm, counts = one_run(binaries[name], os.path.join(work, name), args.steps,
                                                       args.batch, args.micro, train_file)
            last = max(times)
            rate = (tokens[last] - tokens[args.warmup]) / (times[last] - times[args.warmup])
            sides[name].append({"rate": rate, "comm": comm / run.seconds})
            if counts:
                tokenized = counts
            log(f"rep {r + 1}/{args.repeats} {name}: {rate:.0f} target tokens/s, load {load}")
    # Each repetition's two sides ran back to back: their ratio is steadier than the sides' medians when other jobs
    # come and go on the machine.
    paired = [a["rate"] / b["rate"] for a, b in zip(sides["after"], sides["before"])]
    rate = {k: median([s["rate"] for s in v]) for k, v in sides.items()}
    comm = {k: median([s["comm"] for s in v]) for k, v in sides.items()}
    print(f"{machine_notes()}\n")
    print("| model | characters per record | batch | micro-batch | every rank tokenizes all: tokens/s "
          "| each rank its share: tokens/s | after / before (median of each repetition's ratio; range) | rank 0 time in collectives (before, after) "
          "| records tokenized per rank (after) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    counts = ", ".join(f"rank {r}: {n}" for r, n in sorted(tokenized.items()))
    print(f"| tiny-qwen2 | {args.chars} | {args.batch} | {args.micro} | {rate['before']:.0f} | {rate['after']:.0f} "
          f"| {median(paired):.2f}x ({min(paired):.2f}x to {max(paired):.2f}x) | {comm['before']:.0%}, {comm['after']:.0%} of the run "
          f"| {counts} |")
    print(f"\n2 ranks x 1 thread each side; {args.repeats} runs of each side, alternately; medians; {args.steps} "
          f"steps, measured after {args.warmup} warm-up steps.")


if __name__ == "__main__":
    main()
