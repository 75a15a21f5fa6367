#!/usr/bin/env python3
"""Chat records per second: trainer's render + tokenize (+ assistant mask) against transformers'
apply_chat_template(tokenize=True) on the same records, one core each.

The records are the demo's conversations (scripts/make_demo_data.py --form chat: two assistant turns, a third with a
tool call), rendered by Qwen2.5's chat template with the tiny Qwen2 tokenizer (configs/models/tiny-qwen2).

- trainer dump: `trainer data --dump N` (one thread: record mapping only, JSON lines out), minus the time of
  `--dump 0` (start-up: the tokenizer and template loaded);
- trainer loader: `trainer data` with data.num_workers=1 (the loader's own examples/s: read, map, batch, collate);
- transformers: apply_chat_template(messages, tools=..., tokenize=True, return_dict=True) in a loop.
Each with data.train_on=all (render + tokenize) and assistant (+ the spans, rendered prefix by prefix).

    .venv/bin/python scripts/bench/chat_render.py --records 3000
    .venv/bin/python scripts/bench/chat_render.py --records 20000 --before OLD/trainer   # two builds, alternately
"""
import argparse
import json
import os
import pathlib
import re
import resource
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def trainer_seconds(binary, config, args):
    """Wall-clock and CPU seconds (user + system) of one `trainer data` run, and its output."""
    start, cpu = time.perf_counter(), children_cpu()
    result = subprocess.run([str(binary), "data", "--config", str(config), *args], cwd=ROOT, capture_output=True,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if result.returncode != 0:
        sys.exit(f"trainer data failed: {result.stderr}")
    return time.perf_counter() - start, children_cpu() - cpu, result.stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--binary", default=os.environ.get("TRAINER_BINARY", ROOT / "build" / "trainer"))
    parser.add_argument("--before", help="another trainer binary (an older build), measured alternately with --binary")
    args = parser.parse_args()
    import transformers

    model = ROOT / "configs" / "models" / "tiny-qwen2"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        data = tmp / "chat.jsonl"
        subprocess.run([sys.executable, ROOT / "scripts" / "make_demo_data.py", "--form", "chat", "--records",
                        str(args.records), "--seed", "11", "--out", str(data)], check=True)
        records = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
        rows = []
        for train_on in ("all", "assistant"):
            config = tmp / f"config-{train_on}.json"
            config.write_text(json.dumps({
                "model": {"path": str(model), "init": "random"},
                "data": {"train_files": [str(data)], "train_on": train_on, "max_length": 4096, "num_workers": 1},
                "training": {"batch_size": 16}, "device": {"type": "cpu"}}))
            binaries = [("before: ", args.before), ("", args.binary)] if args.before else [("", args.binary)]
            for label, binary in binaries:
                base, base_cpu, _ = trainer_seconds(binary, config, ["--dump", "0", str(data)])
                whole, whole_cpu, _ = trainer_seconds(binary, config, ["--dump", str(len(records)), str(data)])
                rows.append((f"{label}trainer --dump (train_on={train_on})", len(records) / max(whole - base, 1e-9),
                             len(records) / max(whole_cpu - base_cpu, 1e-9)))
            for label, binary in binaries:
                _, _, out = trainer_seconds(binary, config, [])
                rate = float(re.search(r"([0-9.]+) examples/s", out).group(1))
                rows.append((f"{label}trainer loader, 1 worker (train_on={train_on})", rate, None))

        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        start, cpu = time.perf_counter(), time.process_time()
        for record in records:
            tokenizer.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=True,
                                          return_dict=True)
        hf = len(records) / (time.perf_counter() - start)
        hf_cpu = len(records) / (time.process_time() - cpu)
        rows.append(("transformers apply_chat_template(tokenize=True)", hf, hf_cpu))

    print(f"{len(records)} chat records, Qwen2.5 template, tiny Qwen2 tokenizer, one core each "
          f"(transformers {transformers.__version__}); records per wall-clock second, and per CPU second (user +\n"
          f"system: steadier on a shared machine; the loader reports only its own wall-clock rate)\n")
    print("| what | records/s | vs transformers | records/CPU-s | vs transformers (CPU) |")
    print("|---|---:|---:|---:|---:|")
    for name, rate, rate_cpu in rows:
        cpu_cells = f"{rate_cpu:,.0f} | {rate_cpu / hf_cpu:.1f}x" if rate_cpu is not None else "- | -"
        print(f"| {name} | {rate:,.0f} | {rate / hf:.1f}x | {cpu_cells} |")


if __name__ == "__main__":
    main()
