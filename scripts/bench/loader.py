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
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CONFIGS, HF_STACK, PY, ROOT, TINY_MODELS, TRAINER, ensure_data, log, table as markdown_table  # noqa: E402


def run_trainer(form, path, workers):
    if os.path.exists(path + ".idx"):
        os.remove(path + ".idx")  # cold start: the index pass is part of the time
    cmd = [TRAINER, "data", "--config", CONFIGS[form],
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
        out = subprocess.run([PY, HF_STACK, "loader", form, path, os.path.join(ROOT, TINY_MODELS[form]), "16"],
                             cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def benchmark(records_list, forms, workers=2, skip_hf=False):
    """Both loaders on each form and size; a list of dicts (form, records, side, seconds, examples, tokens,
    peak_rss_mib)."""
    rows = []
    for form in forms:
        for records in records_list:
            path = ensure_data(form, records)
            sides = [("trainer", lambda: run_trainer(form, path, workers))]
            if not skip_hf:
                sides.append(("HF datasets", lambda: run_hf(form, path)))
            for side, run in sides:
                r = dict(run(), form=form, records=records, side=side)
                rows.append(r)
                log(f"loader {form} {records} {side}: {r}")
    return rows


def table(rows):
    baseline = {(r["form"], r["records"]): r["seconds"] for r in rows if r["side"] != "trainer"}
    smallest = {}
    for r in rows:
        smallest.setdefault((r["form"], r["side"]), r)
    out = []
    for r in rows:
        speedup = baseline.get((r["form"], r["records"]))
        first = smallest[(r["form"], r["side"])]
        growth = "" if first is r else f"{r['peak_rss_mib'] / first['peak_rss_mib']:.2f}x ({r['records'] // first['records']}x records)"
        out.append([r["form"], f"{r['records']:,}", r["side"], f"{r['seconds']:.1f}", f"{r['examples'] / r['seconds']:,.0f}",
                    f"{r['tokens'] / r['seconds']:,.0f}", f"{r['peak_rss_mib']:.0f}", growth,
                    f"{speedup / r['seconds']:.1f}x" if speedup and r["side"] == "trainer" else ""])
    return markdown_table(["data", "records", "loader", "wall s", "examples/s", "tokens/s", "peak RSS MiB",
                           "RSS vs smallest file", "speed-up"], out)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, nargs="+", default=[100000, 1000000])
    parser.add_argument("--forms", nargs="+", default=["seq2seq", "causal"], choices=["seq2seq", "causal"])
    parser.add_argument("--workers", type=int, default=2, help="trainer's data.num_workers")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    rows = benchmark(args.records, args.forms, args.workers, args.skip_hf)
    print(f"\n{os.cpu_count()} CPU cores; trainer with data.num_workers={args.workers}; batch 16, shuffled, padded\n")
    print(table(rows))


if __name__ == "__main__":
    main()
