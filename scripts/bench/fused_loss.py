#!/usr/bin/env python3
"""The fused chunked loss against the plain loss (and, with --baseline, against another trainer binary's chunked
loss, e.g. the build before the fused loss) on a Qwen2-shaped model with Qwen2's 152,064-token vocabulary and
tiny layers (hidden 64, 2 layers), so the LM head and the loss are most of the memory and of the time. CPU, fp32.
Prints a Markdown table.

    scripts/bench/fused_loss.py                                     # plain vs fused, chunks of 1024 and 256
    scripts/bench/fused_loss.py --baseline /work/main/build/trainer # + the baseline binary's chunked loss

Each run trains --steps steps of --batch examples of --length tokens (micro-batch = batch, no accumulation) on
the same JSONL with the same seed. Per step, trainer's metrics give the peak of tensor memory (the CPU budget
allocator's counter, reset every step) and the memory allocated after the step; "above steady" is their
difference: what forward and backward hold beyond weights, gradients and optimizer state. Time per step from
tokens/s. Variants run alternately, --repeats times; medians are reported. The losses of all variants must agree.
"""
import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (BENCH_DIR, ROOT, TINY_MODELS, TRAINER, ensure_data, fresh_dir, log, machine_notes,  # noqa: E402
                    median, ratio, run_measured, table)

MIB = 2**20


def model_dir(vocab, hidden):
    path = os.path.join(BENCH_DIR, "models", f"qwen2-vocab{vocab}-hidden{hidden}")
    tiny = os.path.join(ROOT, TINY_MODELS["causal"])
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(tiny, "config.json")) as f:
        config = json.load(f)
    config.update(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, tie_word_embeddings=False)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny, name), path)
    return path


def run_variant(binary, work, model, data, args, chunked, chunk):
    out = fresh_dir(work)
    command = [binary, "--config", "configs/tiny-qwen2.json",
               "--set", f"model.path={model}", "--set", "model.init=random",
               "--set", f"data.train_files=[\"{data}\"]", "--set", "data.validation_files=[]",
               "--set", "data.shuffle=false",
               "--set", f"data.max_length={args.length}", "--set", "data.on_overlength=truncate",
               "--set", f"training.batch_size={args.batch}", "--set", f"training.micro_batch_size={args.batch}",
               "--set", f"training.max_steps={args.steps}", "--set", "training.seed=1",
               "--set", f"training.chunked_loss={'true' if chunked else 'false'}",
               "--set", f"training.loss_chunk_size={chunk}",
               "--set", "precision.mode=fp32", "--set", "evaluation.every_steps=0",
               "--set", "evaluation.sample_prompts=[]", "--set", "checkpoint.every_steps=0",
               "--set", f"checkpoint.output_dir={out}", "--set", "logging.progress=off", "--set", "memory.limit=8GiB"]
    run = run_measured(command)
    if run.returncode != 0:
        raise SystemExit(f"{binary} failed ({run.returncode}):\n{run.text()[-3000:]}")
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"memory_peak"' in line]
    measured = metrics[args.warmup:]
    return {"peak": median([m["memory_peak"] for m in measured]),
            "above": median([m["memory_peak"] - m["memory_allocated"] for m in measured]),
            "tokens_per_s": median([m["tokens_per_s"] for m in measured]),
            "losses": [round(m["loss"], 4) for m in metrics]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="another trainer binary whose chunked loss to measure as well")
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    model = model_dir(args.vocab, args.hidden)
    data = ensure_data("causal", 200)
    # Copies of the binaries, so a rebuild during the run changes nothing measured.
    bin_dir = fresh_dir(os.path.join(BENCH_DIR, "fused-loss-bin"))
    ours = shutil.copy(TRAINER, os.path.join(bin_dir, "trainer"))
    variants = [("plain loss", ours, False, 1024), ("fused chunked loss, 1024", ours, True, 1024),
                ("fused chunked loss, 256", ours, True, 256)]
    if args.baseline:
        base = shutil.copy(args.baseline, os.path.join(bin_dir, "baseline"))
        variants += [("baseline chunked loss, 1024", base, True, 1024), ("baseline chunked loss, 256", base, True, 256)]
    samples = {name: [] for name, *_ in variants}
    for r in range(args.repeats):
        order = variants if r % 2 == 0 else list(reversed(variants))
        for name, binary, chunked, chunk in order:
            log(f"repeat {r + 1}: {name}")
            samples[name].append(run_variant(binary, os.path.join(BENCH_DIR, "fused-loss-run"), model, data, args,
                                             chunked, chunk))
    reference = samples["plain loss"][0]["losses"]
    for name, runs in samples.items():
        for run in runs:
            if any(abs(a - b) > 2e-3 * max(1.0, abs(b)) for a, b in zip(run["losses"], reference)):
                raise SystemExit(f"{name}: losses {run['losses']} differ from the plain loss's {reference}")
    plain = {k: median([s[k] for s in samples["plain loss"]]) for k in ("peak", "above", "tokens_per_s")}
    rows = []
    for name, *_ in variants:
        m = {k: median([s[k] for s in samples[name]]) for k in ("peak", "above", "tokens_per_s")}
        rows.append([name, f"{m['peak'] / MIB:,.0f}", f"{m['above'] / MIB:,.0f}", ratio(m["above"], plain["above"]),
                     f"{m['tokens_per_s']:,.0f}", ratio(m["tokens_per_s"], plain["tokens_per_s"])])
    print(f"Qwen2-shaped, vocabulary {args.vocab:,}, hidden {args.hidden}, 2 layers, untied head, fp32 on CPU; "
          f"{args.batch} x {args.length} tokens a step, {args.steps} steps ({args.warmup} warm-up), "
          f"medians of {args.repeats} alternating runs.\n{machine_notes()}\n")
    print(table(["loss", "peak MiB", "above steady MiB", "vs plain", "target tokens/s", "vs plain"], rows))


if __name__ == "__main__":
    main()
