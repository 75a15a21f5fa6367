#!/usr/bin/env python3
"""Data loader benchmark: trainer's loader (`trainer data`) against Hugging Face `datasets` + `tokenizers` + a
padding collator, on the same recipe JSONL and tokenizers (tiny-t5 spiece.model, tiny-qwen2 tokenizer.json).

    scripts/bench/loader.py                      # 100k and 1M records, seq2seq and causal (a few minutes)
    scripts/bench/loader.py --records 100000 --forms causal

Both sides do the whole job from a cold start: read the JSONL, tokenize (seq2seq: input + target with </s>;
causal: prompt + completion + EOS, prompt masked with -100), shuffle, batch 16 and pad to the longest.
trainer: the real binary, index cache removed first (so the index pass is included), data.num_workers workers.
HF: load_dataset("json") into a fresh cache, Dataset.map(batched=True) with the fast tokenizer, then a torch
DataLoader (shuffle) with DataCollatorForSeq2Seq(padding="longest"). Each side runs in its own process; its peak
RSS is that process's high-water mark. Prints a Markdown table.
"""
import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
CONFIGS = {"seq2seq": "configs/tiny-t5.json", "causal": "configs/tiny-qwen2.json"}
MODELS = {"seq2seq": "configs/models/tiny-t5", "causal": "configs/models/tiny-qwen2"}

HF_SCRIPT = r'''
import json, resource, sys, time
form, path, model, batch_size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
start = time.perf_counter()
import datasets, torch
from transformers import AutoTokenizer, DataCollatorForSeq2Seq
datasets.disable_progress_bar()
tok = AutoTokenizer.from_pretrained(model)
ds = datasets.load_dataset("json", data_files=path, split="train")
if form == "seq2seq":
    def tokenize(batch):
        enc = tok(batch["input"])
        enc["labels"] = tok(text_target=batch["target"])["input_ids"]
        return enc
else:
    def tokenize(batch):
        prompts = tok(batch["prompt"])["input_ids"]
        completions = tok(batch["completion"], add_special_tokens=False)["input_ids"]
        ids, labels = [], []
        for p, c in zip(prompts, completions):
            ids.append(p + c + [tok.eos_token_id])
            labels.append([-100] * len(p) + c + [tok.eos_token_id])
        return {"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids], "labels": labels}
ds = ds.map(tokenize, batched=True, remove_columns=ds.column_names)
collator = DataCollatorForSeq2Seq(tok, padding="longest")
loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, collate_fn=collator,
                                     generator=torch.Generator().manual_seed(1))
examples = tokens = 0
for batch in loader:
    examples += batch["input_ids"].shape[0]
    tokens += int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum() if form == "seq2seq" else batch["attention_mask"].sum())
seconds = time.perf_counter() - start
print(json.dumps({"examples": examples, "tokens": tokens, "seconds": seconds,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''


def ensure_data(form, records):
    path = os.path.join(ROOT, "build", "bench", f"recipes-{form}-{records}.jsonl")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        subprocess.run([PY, os.path.join(ROOT, "scripts", "make_demo_data.py"), "--form", form, "--records",
                        str(records), "--seed", "1", "--out", path], check=True)
    return path


def run_trainer(form, path, workers):
    if os.path.exists(path + ".idx"):
        os.remove(path + ".idx")  # cold start: the index pass is part of the time
    cmd = [os.path.join(ROOT, "build", "trainer"), "data", "--config", CONFIGS[form],
           "--set", f'data.train_files=["{path}"]', "--set", "data.validation_files=[]",
           "--set", f"data.num_workers={workers}", "--set", "data.max_input_length=4096",
           "--set", "data.max_target_length=4096", "--set", "data.max_length=4096"]
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    seconds = time.perf_counter() - start
    examples = int(re.search(r"examples +(\d+)", out).group(1))
    tokens = int(re.search(r"tokens +(\d+)", out).group(1))
    rss = float(re.search(r"peak RSS ([\d.]+) MiB", out).group(1))
    return {"examples": examples, "tokens": tokens, "seconds": seconds, "peak_rss_mib": rss}


def run_hf(form, path):
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, HF_DATASETS_CACHE=cache, HF_HOME=cache, TOKENIZERS_PARALLELISM="true")
        out = subprocess.run([PY, "-c", HF_SCRIPT, form, path, os.path.join(ROOT, MODELS[form]), "16"], cwd=ROOT,
                             env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, nargs="+", default=[100000, 1000000])
    parser.add_argument("--forms", nargs="+", default=["seq2seq", "causal"], choices=["seq2seq", "causal"])
    parser.add_argument("--workers", type=int, default=2, help="trainer's data.num_workers")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    rows = []
    for form in args.forms:
        for records in args.records:
            path = ensure_data(form, records)
            sides = [("trainer", run_trainer(form, path, args.workers))]
            if not args.skip_hf:
                sides.append(("HF datasets", run_hf(form, path)))
            for name, r in sides:
                rows.append((form, records, name, r))
                print(f"{form} {records} {name}: {r}", file=sys.stderr, flush=True)
    print(f"\n{os.cpu_count()} CPU cores; trainer with data.num_workers={args.workers}; batch 16, shuffled, padded\n")
    print("| data | records | loader | wall s | examples/s | tokens/s | peak RSS MiB | speed-up |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    baseline = {(f, n): r["seconds"] for f, n, name, r in rows if name == "HF datasets"}
    for form, records, name, r in rows:
        speedup = baseline.get((form, records))
        speedup = f"{speedup / r['seconds']:.1f}x" if speedup and name == "trainer" else ""
        print(f"| {form} | {records:,} | {name} | {r['seconds']:.1f} | {r['examples'] / r['seconds']:,.0f} | "
              f"{r['tokens'] / r['seconds']:,.0f} | {r['peak_rss_mib']:.0f} | {speedup} |")


if __name__ == "__main__":
    main()
