#!/usr/bin/env python3
"""Learning parity: does each shipped config's precision and optimizer setting learn like fp32?

Each row trains the tiny model of the config's family (configs/models/tiny-t5 for the T5 configs, tiny-qwen2 for
the causal ones) on the demo recipes with the setting of the config (precision.mode, optimizer.*, LoRA) at the
config's learning rate, constant schedule, the same steps, and compares the final validation loss with (a) the
same run in fp32 (fp32 weights and optimizer state, same optimizer) and, with --hf, (b) transformers' Seq2SeqTrainer
with the same optimizer and learning rate (its bf16=True is mixed precision with fp32 master weights; it starts
from our initial weights, but draws its own data order, so it agrees in trend, not to the digit).

    .venv/bin/python scripts/bench/learning_parity.py [--steps 200] [--hf] [--only t5xl]

Prints a Markdown table (the "Learning parity" section of docs/benchmarks.md).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, TRAINER, log  # noqa: E402

T5 = "configs/tiny-t5.json"
QWEN = "configs/tiny-qwen2.json"

# (shipped config, what the row shows, tiny config, settings). The first row of each config is its own setting.
ROWS = [
    ("tiny-t5.json", "fp32, AdamW", T5, ["optimizer.lr=3e-3"]),
    ("tiny-qwen2.json", "fp32, AdamW", QWEN, ["optimizer.lr=3e-3"]),
    ("t5xl.json", "bf16, Adafactor, Kahan compensation (the config)", T5,
     ["optimizer.lr=1e-4", "precision.mode=bf16", "optimizer.name=adafactor", "optimizer.bf16_update=kahan"]),
    ("t5xl.json (before)", "bf16, AdamW bf16 moments, rounded to nearest", T5,
     ["optimizer.lr=1e-4", "precision.mode=bf16", "optimizer.state_dtype=bf16", "optimizer.bf16_update=nearest"]),
    ("", "bf16, AdamW bf16 moments, stochastic rounding", T5,
     ["optimizer.lr=1e-4", "precision.mode=bf16", "optimizer.state_dtype=bf16"]),
    ("", "bf16, AdamW, stochastic rounding (default)", T5, ["optimizer.lr=1e-4", "precision.mode=bf16"]),
    ("", "bf16, AdamW, Kahan compensation", T5,
     ["optimizer.lr=1e-4", "precision.mode=bf16", "optimizer.bf16_update=kahan"]),
    ("", "bf16, Adafactor, stochastic rounding", T5,
     ["optimizer.lr=1e-4", "precision.mode=bf16", "optimizer.name=adafactor"]),
    ("", "bf16-mixed, Adafactor", T5, ["optimizer.lr=1e-4", "precision.mode=bf16-mixed", "optimizer.name=adafactor"]),
    ("", "fp32 weights, AdamW bf16 moments rounded to nearest", T5,
     ["optimizer.lr=1e-4", "optimizer.state_dtype=bf16", "optimizer.bf16_update=nearest"]),
    ("", "fp32 weights, AdamW bf16 moments, stochastic rounding", T5,
     ["optimizer.lr=1e-4", "optimizer.state_dtype=bf16"]),
    ("qwen2.5-7b-lora.json", "bf16-mixed, LoRA r=16 on all projections, bf16 base", QWEN,
     ["optimizer.lr=2e-4", "precision.mode=bf16-mixed", "lora.enabled=true", "lora.r=16", "lora.alpha=32",
      "lora.dropout=0", "lora.base_in_bf16=true",
      'lora.target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]']),
]


def fp32_of(settings):
    """The same run in fp32: fp32 weights and optimizer state, rounding settings irrelevant."""
    drop = ("precision.mode=", "optimizer.state_dtype=", "optimizer.bf16_update=", "lora.base_in_bf16=")
    return [s for s in settings if not s.startswith(drop)]


def ours(config, settings, steps, out_dir):
    args = [TRAINER, "--config", config, "--set", "scheduler.name=constant", "--set", "scheduler.warmup_steps=0",
            "--set", f"training.max_steps={steps}", "--set", "evaluation.every_steps=0", "--set",
            "evaluation.sample_prompts=[]", "--set", "checkpoint.every_steps=0", "--set", "checkpoint.save_final=false",
            "--set", "logging.progress=off", "--set", f"checkpoint.output_dir={out_dir}"]
    for s in settings:
        args += ["--set", s]
    subprocess.run(args, cwd=ROOT, check=True, capture_output=True, text=True)
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        losses = [json.loads(line)["eval_loss"] for line in f if "eval_loss" in line]
    return losses[-1]


def initial_weights(config, out_dir):
    """Our random initialisation of the tiny model, as a Hugging Face directory: one step at lr 1e-12 (moves no
    weight by more than ~1e-12), saved as the final model."""
    subprocess.run([TRAINER, "--config", config, "--set", "training.max_steps=1", "--set", "optimizer.lr=1e-12",
                    "--set", "evaluation.every_steps=0", "--set", "evaluation.sample_prompts=[]", "--set",
                    "logging.progress=off", "--set", "checkpoint.save_final=true", "--set",
                    f"checkpoint.output_dir={out_dir}"], cwd=ROOT, check=True, capture_output=True, text=True)
    return os.path.join(out_dir, "final")


def transformers_trainer(settings, steps, out_dir, init_dir):
    """Seq2SeqTrainer on the tiny T5 from our initial weights with the row's optimizer, learning rate and bf16
    (mixed) flag."""
    import torch
    from datasets import Dataset
    from transformers import (AutoTokenizer, DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments,
                              T5ForConditionalGeneration)
    values = dict(s.split("=", 1) for s in settings)
    model_dir = os.path.join(ROOT, "configs/models/tiny-t5")
    torch.manual_seed(1)
    model = T5ForConditionalGeneration.from_pretrained(init_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def load(path):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        inputs = tokenizer([r["input"] for r in records], max_length=96, truncation=True)
        labels = tokenizer([r["target"] for r in records], max_length=96, truncation=True)
        return Dataset.from_dict({"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"],
                                  "labels": labels["input_ids"]})

    args = Seq2SeqTrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=16, per_device_eval_batch_size=8, max_steps=steps,
        learning_rate=float(values["optimizer.lr"]), lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.01, max_grad_norm=1.0, optim="adafactor" if values.get("optimizer.name") == "adafactor"
        else "adamw_torch", bf16=values.get("precision.mode", "fp32") != "fp32", use_cpu=True, seed=1,
        report_to=[], disable_tqdm=True, save_strategy="no", logging_strategy="no", eval_strategy="no", dataloader_num_workers=0)
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=load("data/demo/recipes-seq2seq.jsonl"),
                             eval_dataset=load("data/demo/recipes-seq2seq-val.jsonl"),
                             data_collator=DataCollatorForSeq2Seq(tokenizer, model=model))
    trainer.train()
    return trainer.evaluate()["eval_loss"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hf", action="store_true",
                        help="also run transformers' Seq2SeqTrainer (the rows of the T5 configs)")
    parser.add_argument("--only", help="rows whose config name or setting contains this")
    options = parser.parse_args()

    table = ["| config | setting (tiny model, lr, steps) | validation loss | fp32 | vs fp32 |"
             + (" transformers Trainer | vs Trainer |" if options.hf else ""),
             "|---|---|---:|---:|---:|" + ("---:|---:|" if options.hf else "")]
    fp32_cache = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, what, config, settings) in enumerate(ROWS):
            if options.only and options.only not in name + what:
                continue
            log(f"{name or '  '}: {what}")
            loss = ours(config, settings, options.steps, os.path.join(tmp, f"ours-{i}"))
            reference = (config,) + tuple(fp32_of(settings))
            if reference not in fp32_cache:
                fp32_cache[reference] = ours(config, list(reference[1:]), options.steps, os.path.join(tmp, f"fp32-{i}"))
            fp32 = fp32_cache[reference]
            lr = next(s for s in settings if s.startswith("optimizer.lr=")).split("=")[1]
            row = (f"| {name} | {what} ({os.path.basename(config).replace('.json', '')}, lr {lr}) | {loss:.3f} | "
                   f"{fp32:.3f} | {100 * (loss - fp32) / fp32:+.1f}% |")
            if options.hf:
                if config == T5 and name:  # each T5 config's own row (and the old t5xl setting)
                    if "init" not in fp32_cache:
                        fp32_cache["init"] = initial_weights(config, os.path.join(tmp, "init"))
                    theirs = transformers_trainer(settings, options.steps, os.path.join(tmp, f"hf-{i}"),
                                                  fp32_cache["init"])
                    row += f" {theirs:.3f} | {100 * (loss - theirs) / theirs:+.1f}% |"
                else:
                    row += " | |"
            log(row)
            table.append(row)
    print(f"\nLearning parity, {options.steps} steps, batch 16, constant learning rate:\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
