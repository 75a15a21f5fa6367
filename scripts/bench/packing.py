#!/usr/bin/env python3
"""Packing (data.packing) against padded rows: the same training steps on the demo recipe data, tokens/s of each,
run alternately in one go. For a Qwen2-shaped and a T5-shaped model (the tiny configs' shapes scaled up with
--hidden and --layers, random weights), fp32 on the CPU. Prints a Markdown table; speed is a ratio of the two
sides, never an absolute goal.

    scripts/bench/packing.py                       # both families, 3 alternating repeats
    scripts/bench/packing.py --families causal --batch 32 --steps 6
    scripts/bench/packing.py --baseline /path/to/older/trainer   # also: the same runs with another build

With --baseline, every repeat runs four sides in turn (the order alternating between repeats): padded and packed
with the baseline binary and with this build, so a change to packed training is measured against the build
before it on the same machine in one go.

Both sides train the same effective batches (training.batch_size examples) with the whole batch in one
micro-batch (padded: batch rows; packed: as many rows as packing needs), so they do the same learning: the
per-step losses must agree (they are checked), and target tokens per second compare directly. "padding" is the
share of the forward's positions that are padding (trainer data's figures for the same data).
"""
import argparse
import json
import os
import re
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (BENCH_DIR, CONFIGS, ROOT, TINY_MODELS, TRAINER, ensure_data, fresh_dir, log,  # noqa: E402
                    machine_notes, median, ratio, run_measured, table)


def model_dir(family, hidden, layers):
    path = os.path.join(BENCH_DIR, "models", f"packing-{family}-h{hidden}-l{layers}")
    tiny = os.path.join(ROOT, TINY_MODELS[family])
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(tiny, "config.json")) as f:
        config = json.load(f)
    if family == "causal":
        config.update(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 32), num_key_value_heads=max(1, hidden // 64),
                      layer_types=["full_attention"] * layers)
    else:
        config.update(d_model=hidden, d_ff=4 * hidden, d_kv=32, num_heads=max(1, hidden // 32), num_layers=layers,
                      num_decoder_layers=layers)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    for name in os.listdir(tiny):
        if name != "config.json" and not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny, name), path)
    return path


def common_args(family, model, data, args, out, packing):
    lengths = (["--set", f"data.max_length={args.length}"] if family == "causal" else
               ["--set", f"data.max_input_length={args.length}", "--set", f"data.max_target_length={args.length}"])
    return ["--config", CONFIGS[family], "--set", f"model.path={model}", "--set", "model.init=random",
            "--set", f"data.train_files=[\"{data}\"]", "--set", "data.validation_files=[]",
            *lengths, "--set", f"data.packing={'true' if packing else 'false'}",
            "--set", f"training.batch_size={args.batch}", "--set", f"training.micro_batch_size={args.batch}",
            "--set", f"training.max_steps={args.steps}", "--set", "training.seed=1",
            "--set", "precision.mode=fp32", "--set", "evaluation.every_steps=0",
            "--set", "evaluation.sample_prompts=[]", "--set", "checkpoint.every_steps=0",
            "--set", f"checkpoint.output_dir={out}", "--set", "logging.progress=off", "--set", "memory.limit=16GiB"]


def run_variant(binary, family, model, data, args, packing):
    out = fresh_dir(os.path.join(BENCH_DIR, "packing-run"))
    run = run_measured([binary, *common_args(family, model, data, args, out, packing)])
    if run.returncode != 0:
        raise SystemExit(f"{binary} failed ({run.returncode}):\n{run.text()[-3000:]}")
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"tokens_per_s"' in line]
    measured = metrics[args.warmup:]
    return {"tokens_per_s": median([m["tokens_per_s"] for m in measured]),
            "losses": [round(m["loss"], 4) for m in metrics]}


def padding_figures(binary, family, model, data, args):
    """trainer data's padding after collation, padded and packed, for the same data and batch size."""
    run = run_measured([binary, "data", *common_args(family, model, data, args, os.path.join(BENCH_DIR, "x"), False)])
    text = run.text()
    padded = re.search(r"tokens .*?; ([0-9.]+)% padding after collation", text)
    packed = re.search(r"packing .*?: ([0-9.]+)% of the row capacity is real tokens; ([0-9.]+)% padding", text)
    return (padded.group(1) if padded else "?"), (packed.group(2) if packed else "?")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default="causal,seq2seq")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=256, help="row capacity (data.max_length / max_*_length)")
    parser.add_argument("--records", type=int, default=400)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", help="another trainer binary to run the same sides with (before a change)")
    args = parser.parse_args()

    bin_dir = fresh_dir(os.path.join(BENCH_DIR, "packing-bin"))
    binary = shutil.copy(TRAINER, os.path.join(bin_dir, "trainer"))  # a rebuild during the run changes nothing
    binaries = {"this": binary}
    if args.baseline:
        binaries["baseline"] = shutil.copy(args.baseline, os.path.join(bin_dir, "trainer-baseline"))
    sides = [(name, packing) for name in binaries for packing in (False, True)]
    rows = []
    for family in args.families.split(","):
        model = model_dir(family, args.hidden, args.layers)
        data = ensure_data(family, args.records)
        padded_share, packed_share = padding_figures(binary, family, model, data, args)
        samples = {side: [] for side in sides}
        for r in range(args.repeats):
            for side in (sides if r % 2 == 0 else list(reversed(sides))):
                log(f"{family}, repeat {r + 1}: {side[0]} build, {'packed' if side[1] else 'padded'}")
                samples[side].append(run_variant(binaries[side[0]], family, model, data, args, side[1]))
        reference = samples[("this", False)][0]["losses"]
        for run in [run for side in sides for run in samples[side]]:
            if any(abs(a - b) > 2e-3 * max(1.0, abs(b)) for a, b in zip(run["losses"], reference)):
                raise SystemExit(f"{family}: losses {run['losses']} differ from the padded run's {reference}")
        rate = {side: median([s["tokens_per_s"] for s in samples[side]]) for side in sides}
        row = [family, f"{padded_share}%", f"{packed_share}%"]
        if args.baseline:
            row += [ratio(rate[("baseline", True)], rate[("baseline", False)])]
        row += [ratio(rate[("this", True)], rate[("this", False)])]
        if args.baseline:
            row += [ratio(rate[("this", True)], rate[("baseline", True)]),
                    ratio(rate[("this", False)], rate[("baseline", False)])]
        row += [" / ".join(f"{rate[side]:.0f}" for side in sides)]
        rows.append(row)
    print(f"Hidden {args.hidden}, {args.layers} layers, random weights, fp32 on CPU; demo recipes, batch {args.batch} "
          f"in one micro-batch, rows of {args.length}; {args.steps} steps ({args.warmup} warm-up), medians of "
          f"{args.repeats} alternating runs; the per-step losses of all sides agree.\n{machine_notes()}\n")
    header = ["model", "padding (padded rows)", "padding (packed rows)"]
    if args.baseline:
        header += ["packed vs padded, baseline"]
    header += ["packed vs padded" + (", this build" if args.baseline else " (target tokens/s)")]
    if args.baseline:
        header += ["packed, this build vs baseline", "padded, this build vs baseline"]
    header += ["target tokens/s (" + ", ".join(f"{n} {'packed' if p else 'padded'}" for n, p in sides) + ")"]
    print(table(header, rows))


if __name__ == "__main__":
    main()
