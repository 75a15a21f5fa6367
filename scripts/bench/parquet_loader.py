#!/usr/bin/env python3
"""Parquet in the data loader (issue 54): trainer's loader (`trainer data`) on a Parquet file, against the same
loader on the same records as JSONL, and against Hugging Face `datasets` on the Parquet file.

    scripts/bench/parquet_loader.py                       # 200k causal records, 3 rounds (a few minutes)
    scripts/bench/parquet_loader.py --records 100000 --rounds 2 --forms seq2seq causal

The records are scripts/make_demo_data.py's recipes (as scripts/bench/loader.py), written once as JSONL and, by
pyarrow, as Parquet with row groups of --row-group rows (the Hub's converted files hold about 100k rows a group).
The three sides run alternately, round after round, so a change in the machine's load touches each alike; each
side's figure is the median of its rounds. trainer: `trainer data` (shuffled, batch 16, padded to the longest,
data.num_workers workers), the JSONL index cache removed first (so its index pass is in the time; a Parquet file
needs none: its footer lists the row groups). HF: scripts/bench/hf_stack.py's loader (load_dataset("parquet") into
a fresh cache, Dataset.map(batched=True) with the fast tokenizer, a torch DataLoader with
DataCollatorForSeq2Seq(padding="longest")). Wall time of the whole process; examples and tokens must agree.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_data, log, machine_notes, median, table  # noqa: E402
from loader import run_hf, run_trainer  # noqa: E402


def parquet_of(jsonl, row_group):
    path = jsonl[: -len(".jsonl")] + f"-rg{row_group}.parquet"
    if not os.path.exists(path):
        import pyarrow.json as pj
        import pyarrow.parquet as pq
        pq.write_table(pj.read_json(jsonl), path + ".part", row_group_size=row_group)
        os.replace(path + ".part", path)
    return path


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return " ".join(f for f in ["avx2", "fma", "avx512f", "avx512bw", "amx_tile"] if f in flags)
    return "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=200000)
    parser.add_argument("--forms", nargs="+", default=["causal"], choices=["seq2seq", "causal"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--row-group", type=int, default=100000)
    parser.add_argument("--workers", type=int, default=2, help="trainer's data.num_workers")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    rows = []
    for form in args.forms:
        jsonl = ensure_data(form, args.records)
        parquet = parquet_of(jsonl, args.row_group)
        sides = [("trainer, JSONL", lambda: run_trainer(form, jsonl, args.workers)),
                 ("trainer, Parquet", lambda: run_trainer(form, parquet, args.workers))]
        if not args.skip_hf:
            sides.append(("HF datasets, Parquet", lambda: run_hf(form, parquet)))
        results = {name: [] for name, _ in sides}
        for round_ in range(args.rounds):
            for name, run in sides:
                r = run()
                results[name].append(r)
                log(f"{form} round {round_ + 1} {name}: {r}")
        counts = {(r["examples"], r["tokens"]) for rs in results.values() for r in rs}
        assert len(counts) == 1, f"the sides disagree on examples/tokens: {counts}"
        jsonl_rate = median([r["examples"] / r["seconds"] for r in results["trainer, JSONL"]])
        hf_rate = (median([r["examples"] / r["seconds"] for r in results["HF datasets, Parquet"]])
                   if not args.skip_hf else None)
        for name, rs in results.items():
            rate = median([r["examples"] / r["seconds"] for r in rs])
            rows.append([form, f"{args.records:,}", name, f"{median([r['seconds'] for r in rs]):.2f}", f"{rate:,.0f}",
                         f"{median([r['peak_rss_mib'] for r in rs]):.0f}",
                         f"{rate / jsonl_rate:.2f}x", f"{rate / hf_rate:.1f}x" if hf_rate else ""])
    print(f"\n{machine_notes()}; CPU flags: {cpu_flags()}; data.num_workers={args.workers}; batch 16, shuffled, "
          f"padded; Parquet row groups of {args.row_group:,} rows; medians of {args.rounds} alternating rounds\n")
    print(table(["data", "records", "loader", "wall s", "examples/s", "peak RSS MiB", "vs trainer JSONL",
                 "vs HF datasets"], rows))


if __name__ == "__main__":
    main()
