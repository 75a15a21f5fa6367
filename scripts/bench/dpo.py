#!/usr/bin/env python3
"""DPO: trainer against TRL's DPOTrainer on the same pairs and settings, on this machine's CPU. Prints a Markdown table.

    scripts/bench/dpo.py                    # qwen2-100m (issue 46's model), LoRA r 16 on every linear layer
    scripts/bench/dpo.py --quick            # the tiny Qwen2, a few steps (a check that the script works)
    scripts/bench/dpo.py --full             # a full fine-tune instead of LoRA (TRL: a reference copy; trainer too)

Both sides start from the same saved weights (written once by transformers with a fixed seed) and read the same
standard preference records ({"prompt", "chosen", "rejected"} strings made from the demo recipes: the chosen
completion is the recipe's steps, the rejected one half of them shuffled), in file order, 8 pairs a step without
gradient accumulation, sequences cut at 512 tokens, fp32, AdamW lr 1e-5 constant, beta 0.1, the sigmoid loss, no
gradient checkpointing, no evaluation. TRL runs as users run it (DPOConfig with bf16=False, the reference computed
each step), and with its memory option precompute_ref_log_probs=True (the reference's log-probabilities computed in
one pass before training; padding_free is unavailable in trl 1.16). Reported: preference pairs per second after
the warm-up steps (TRL's precomputing pass excluded), the peak RSS of the process (GNU time) and the loss of the
first step on each side (the same pairs: they must agree). Sides run alternately (the order flips each repetition);
medians. No timed assertions: a table to read.
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (BENCH_DIR, ROOT, ensure_data, fresh_dir, log, machine_notes, median, ratio,  # noqa: E402
                    run_measured, table, write_json)
from vs_hf import MIB, STEP_LINE, check  # noqa: E402
from qlora import TARGETS, weights_dir  # noqa: E402

TRAINER = os.path.join(ROOT, "build", "trainer")
SEED = 1
LR = 1e-5
BATCH = 8
MAX_LENGTH = 512


def pairs_file(records):
    """Standard preference records from the demo recipes (causal form: prompt and completion)."""
    source = ensure_data("causal", records)
    path = os.path.join(BENCH_DIR, f"dpo-pairs-{records}.jsonl")
    if os.path.exists(path):
        return path
    rng = random.Random(SEED)
    with open(source) as f, open(path, "w") as out:
        for line in f:
            r = json.loads(line)
            steps = r["completion"].strip().split(". ")
            rng.shuffle(steps)
            rejected = " " + ". ".join(steps[:max(1, len(steps) // 2)])
            out.write(json.dumps({"prompt": r["prompt"], "chosen": r["completion"], "rejected": rejected}) + "\n")
    return path


def ours(model, data, out, steps, lora):
    config = {
        "model": {"path": model, "init": "pretrained"},
        "data": {"train_files": [data], "shuffle": False, "max_length": MAX_LENGTH},
        "training": {"objective": "dpo", "batch_size": BATCH, "micro_batch_size": BATCH, "max_steps": steps,
                     "seed": SEED},
        "dpo": {"beta": 0.1},
        "lora": {"enabled": lora, "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": TARGETS},
        "optimizer": {"lr": LR, "weight_decay": 0.0},
        "scheduler": {"name": "constant", "warmup_steps": 0},
        "evaluation": {"every_steps": 0},
        "device": {"type": "cpu"},
        "checkpoint": {"output_dir": out, "save_final": False, "every_steps": 0},
        "logging": {"every_steps": 1, "tensorboard": False, "progress": "plain"},
    }
    path = out + ".json"
    write_json(path, config)
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    run = run_measured([TRAINER, "--config", path])
    check(run, "trainer " + out)
    times = [t for t, line in run.lines if STEP_LINE.search(line)]
    with open(metrics) as f:
        losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    return run, times, losses[0] if losses else None


def theirs(model, data, out, steps, lora, precompute):
    spec = dict(model=model, data=data, out=out, steps=steps, lora=lora, precompute=precompute)
    run = run_measured([sys.executable, os.path.abspath(__file__), "--trl-side", json.dumps(spec)])
    check(run, "TRL " + out)
    # tqdm's progress bar shares the lines (carriage returns, no newline): the marks are found anywhere in a line.
    times = [t for t, line in run.lines if "BENCH step" in line]
    losses = [float(m.group(1)) for t, line in run.lines if (m := re.search(r"BENCH loss (\S+)", line))]
    return run, times, losses[0] if losses else None


def trl_side(spec):
    """TRL's DPOTrainer as a user runs it, printing a line per optimizer step (the time the main side reads)."""
    import datasets
    import peft
    import torch
    import transformers
    import trl

    class Steps(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            print(f"BENCH step {state.global_step}", flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                print(f"BENCH loss {logs['loss']}", flush=True)

    rows = [json.loads(line) for line in open(spec["data"])][:BATCH * spec["steps"]]
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["model"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    args = trl.DPOConfig(output_dir=spec["out"], per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                         max_steps=spec["steps"], learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                         weight_decay=0.0, logging_steps=1, bf16=False, report_to=[], save_strategy="no",
                         use_cpu=True, seed=SEED, max_length=MAX_LENGTH, beta=0.1, dataloader_drop_last=False,
                         precompute_ref_log_probs=spec["precompute"])
    peft_config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS,
                                  task_type="CAUSAL_LM") if spec["lora"] else None
    dpo = trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tokenizer, peft_config=peft_config, callbacks=[Steps()])
    # In file order, as trainer reads it (data.shuffle=false): the same pairs in each step on both sides.
    dpo._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(dpo.train_dataset)
    dpo.train()


def pairs_per_second(times, warmup):
    """Pairs a second over the steps after `warmup`, from the step lines' arrival times."""
    if len(times) <= warmup + 1:
        return None
    return (len(times) - 1 - warmup) * BATCH / (times[-1] - times[warmup])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny Qwen2, a few steps")
    parser.add_argument("--full", action="store_true", help="a full fine-tune instead of LoRA")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--trl-side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_side:
        trl_side(json.loads(args.trl_side))
        return
    name = "tiny-qwen2" if args.quick else "qwen2-100m"
    steps = args.steps or (6 if args.quick else 8)
    warmup = 2
    lora = not args.full
    model = weights_dir(name)
    data = pairs_file(max(200, BATCH * steps))
    log(machine_notes())
    out_root = fresh_dir(os.path.join(BENCH_DIR, "dpo"))
    sides = {"trainer": lambda o: ours(model, data, o, steps, lora),
             "TRL": lambda o: theirs(model, data, o, steps, lora, False),
             "TRL precompute_ref_log_probs": lambda o: theirs(model, data, o, steps, lora, True)}
    results = {side: [] for side in sides}
    for repeat in range(args.repeats):
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        for side in order:
            started = time.perf_counter()
            run, times, first_loss = sides[side](os.path.join(out_root, f"{side.split()[0]}-{repeat}"))
            results[side].append((pairs_per_second(times, warmup), run.peak_rss, first_loss))
            log(f"  {side} repeat {repeat}: {results[side][-1][0]} pairs/s, peak RSS {run.peak_rss / MIB:.0f} MiB, "
                f"first loss {first_loss} ({time.perf_counter() - started:.0f} s)")
    rows = []
    ours_rate = median([r[0] for r in results["trainer"]])
    ours_rss = median([r[1] for r in results["trainer"]])
    for side in sides:
        rate = median([r[0] for r in results[side]])
        rss = median([r[1] for r in results[side]])
        against = side != "trainer"
        rows.append([side, f"{rate:.2f}" if rate else "n/a", f"{rss / MIB:.0f}", results[side][0][2],
                     ratio(ours_rate, rate) if against else "", ratio(ours_rss, rss) if against else ""])
    print(f"\nDPO, {name}, {'LoRA r 16' if lora else 'full fine-tune'}, {BATCH} pairs a step, max_length "
          f"{MAX_LENGTH}, fp32, {steps} steps ({warmup} warm-up), medians of {args.repeats}; {machine_notes()}\n")
    print(table(["side", "pairs/s", "peak RSS MiB", "first loss", "trainer's pairs/s", "trainer's peak RSS"], rows))


if __name__ == "__main__":
    main()
