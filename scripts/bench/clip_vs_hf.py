#!/usr/bin/env python3
"""CLIP contrastive training with the full batch's negatives: trainer (gradient caching, micro_batch_size=auto
under memory.limit) against a plain transformers/PyTorch loop that holds the whole batch in one autograd graph
(scripts/bench/hf_clip_loop.py), under the same memory cap, on this machine's CPU. Prints Markdown tables.

    .venv/bin/python scripts/bench/clip_vs_hf.py [--trainer build/trainer]     # defaults: about 7 minutes (2 cores)
    .venv/bin/python scripts/bench/clip_vs_hf.py --quick                       # a smoke run, under a minute

Same work on both sides: one small random CLIP saved once with transformers' save_pretrained (default: vision and
text 4 layers of width 256, 4 heads, MLP 1024; 64 px images in 8 px patches; captions up to 32 tokens; projection
256; dropout 0), so both start from the same weights; image-caption JSONL from scripts/make_demo_images.py (64 to
96 px images, captions like "a photo of a large red circle on the left"), in file order (trainer
data.shuffle=false); CLIPImageProcessor's resize, crop and normalisation (trainer: the directory's
preprocessor_config.json), the directory's CLIP tokenizer; the symmetric InfoNCE loss of the whole effective batch
(trainer: contrastive.negatives=batch); AdamW lr 1e-4, no weight decay, constant lr, clipping at 1.0; the same
OMP thread count; no evaluation, no augmentation.

1. The largest effective batch under the cap (powers of 2 from 2, up to --max-batch): trainer's batch B counts
   when `trainer --config` with training.batch_size=B, micro_batch_size=auto and memory.limit=cap completes
   --memory-steps steps (the micro-batch shrinks as needed; exit 4 is out of memory at the floor). Its peak is
   metrics.jsonl's memory_peak: the CPU budget allocator's highest live tensor bytes over the steps (weights,
   gradients, AdamW moments, the loader's batches, activations). The plain loop's batch B counts when its
   measured peak of live tensor bytes over two steps (the same things, measured with torch.profiler's allocation
   events: hf_clip_loop.py) is at most the cap; it runs without a cap, so it is measured, not stopped.
   The table also gives trainer's images/s in the last of those steps (one run each, not alternated: rough).
2. images/s at the largest batch both can run: trainer under the cap (its micro-batch as auto chose it) and the
   plain loop; --rounds rounds, the sides alternating and the order flipping each round; per side the median of
   its per-step images/s after --warmup steps (trainer: metrics.jsonl's tokens_per_s, which counts pairs; the
   loop: the batch over each step's wall time, images decoded and preprocessed inside the step as trainer's loader
   does); medians over the rounds and their ratio.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BENCH_DIR, PY, ROOT, fresh_dir, load_average, log, machine_notes, median, table, write_json  # noqa: E402

MIB = 2**20
HF_LOOP = os.path.join(ROOT, "scripts", "bench", "hf_clip_loop.py")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
LR, SEED, MAX_LENGTH = 1e-4, 1, 32


def parse_size(text):
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"--cap {text!r}: expected a size such as 256MiB")
    units = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    return int(float(match.group(1)) * units[match.group(2)])


def model_dir(width, layers, image_size):
    """A random CLIPModel saved by transformers (seeded), with tiny-clip's CLIP tokenizer and a
    CLIPImageProcessor config at image_size."""
    path = os.path.join(BENCH_DIR, "models", f"clip-w{width}-l{layers}-{image_size}px")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    import torch
    from transformers import CLIPConfig, CLIPModel
    tiny = os.path.join(ROOT, "configs", "models", "tiny-clip")
    with open(os.path.join(tiny, "config.json")) as f:
        text = json.load(f)["text_config"]
    tower = dict(hidden_size=width, intermediate_size=4 * width, num_attention_heads=max(1, width // 64),
                 num_hidden_layers=layers, hidden_act="quick_gelu", attention_dropout=0.0)
    config = CLIPConfig(
        text_config=dict(tower, vocab_size=text["vocab_size"], max_position_embeddings=MAX_LENGTH,
                         bos_token_id=text["bos_token_id"], eos_token_id=text["eos_token_id"],
                         pad_token_id=text["pad_token_id"]),
        vision_config=dict(tower, image_size=image_size, patch_size=8, num_channels=3),
        projection_dim=width)
    torch.manual_seed(SEED)
    part = path + ".part"
    shutil.rmtree(part, ignore_errors=True)
    CLIPModel(config).save_pretrained(part)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(tiny, name), part)
    with open(os.path.join(tiny, "preprocessor_config.json")) as f:
        processor = json.load(f)
    processor["size"] = {"shortest_edge": image_size}
    processor["crop_size"] = {"height": image_size, "width": image_size}
    write_json(os.path.join(part, "preprocessor_config.json"), processor)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(part, path)
    return path


def caption_file(pairs):
    folder = os.path.join(BENCH_DIR, "images", f"clip-{pairs}")
    if not os.path.exists(os.path.join(folder, "train-captions.jsonl")):
        per_class = -(-pairs // 5)
        shutil.rmtree(folder + ".part", ignore_errors=True)
        subprocess.run([PY, os.path.join(ROOT, "scripts", "make_demo_images.py"), "--out", folder + ".part",
                        "--classes", "5", "--per-class", str(per_class), "--validation-per-class", "0",
                        "--min-size", "64", "--max-size", "96"], check=True, capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(folder + ".part", folder)
    return os.path.join(folder, "train-captions.jsonl")


def env(threads):
    return dict(os.environ, OMP_NUM_THREADS=str(threads))


class Ours:
    def __init__(self, trainer, work, model, train, cap, threads):
        self.trainer, self.work, self.model, self.train, self.cap, self.threads = \
            trainer, work, model, train, cap, threads

    def run(self, batch, steps):
        """(exit code, metrics.jsonl records, output tail) of one run at effective batch `batch` under the cap."""
        out_dir = fresh_dir(os.path.join(self.work, "ours"))
        config = os.path.join(self.work, "ours.json")
        write_json(config, {
            "model": {"path": self.model},
            "data": {"train_files": [self.train], "validation_files": [], "shuffle": False, "augment": False,
                     "num_workers": 1, "max_length": MAX_LENGTH},
            "training": {"objective": "contrastive", "batch_size": batch, "micro_batch_size": "auto",
                         "max_steps": steps, "seed": SEED, "max_grad_norm": 1.0},
            "contrastive": {"negatives": "batch"},
            "optimizer": {"lr": LR, "weight_decay": 0.0},
            "scheduler": {"name": "constant", "warmup_steps": 0},
            "evaluation": {"every_steps": 0},
            "memory": {"limit": str(self.cap)},
            "device": {"type": "cpu"},
            "checkpoint": {"output_dir": out_dir, "save_final": False},
            "logging": {"every_steps": 1, "tensorboard": False, "progress": "plain"},
        })
        result = subprocess.run([self.trainer, "--config", config], cwd=ROOT, env=env(self.threads),
                                capture_output=True, text=True)
        metrics = os.path.join(out_dir, "metrics.jsonl")
        records = []
        if os.path.exists(metrics):
            with open(metrics) as f:
                records = [json.loads(line) for line in f if line.strip()]
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-15:])
        return result.returncode, [r for r in records if "tokens_per_s" in r], tail


def run_loop(mode, spec, work, threads):
    path = os.path.join(work, f"hf-{mode}.json")
    write_json(path, spec)
    result = subprocess.run([PY, HF_LOOP, mode, path], cwd=ROOT, env=env(threads), capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"the plain loop ({mode}) failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def powers_of_two(limit):
    batch = 2
    while batch <= limit:
        yield batch
        batch *= 2


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", default=os.path.join(ROOT, "build", "trainer"))
    parser.add_argument("--cap", type=parse_size, default=parse_size("192MiB"),
                        help="the memory cap: trainer's memory.limit, and the plain loop's allowed peak")
    parser.add_argument("--max-batch", type=int, default=2048, help="largest effective batch tried (a power of 2)")
    parser.add_argument("--memory-steps", type=int, default=2, help="steps a trainer run must complete")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per speed run (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS on both sides")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: width 128, 2 layers, cap 32MiB, batches up to 32, 1 round of 2 steps")
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()
    if args.quick:
        args.width, args.layers, args.cap, args.max_batch = 128, 2, parse_size("32MiB"), 32
        args.rounds, args.steps, args.memory_steps = 1, 2, 2
    trainer = os.path.abspath(args.trainer)
    if not os.access(trainer, os.X_OK):
        sys.exit(f"--trainer {args.trainer}: not an executable (build it: cmake --build build)")
    model = model_dir(args.width, args.layers, args.image_size)
    train = caption_file(max(args.memory_steps * args.max_batch, 64))  # speed runs wrap around if need be
    work = fresh_dir(os.path.join(BENCH_DIR, "runs", "clip_vs_hf"))
    ours = Ours(trainer, work, model, train, args.cap, args.threads)
    notes_before = machine_notes()
    log(notes_before)

    # 1. The largest effective batch under the cap.
    hf_rows = {r["batch"]: r for r in run_loop("memory", dict(model_dir=model, train_file=train, lr=LR, seed=SEED,
                                                              max_length=MAX_LENGTH, cap_bytes=args.cap,
                                                              batches=list(powers_of_two(args.max_batch))),
                                               work, args.threads)}
    for batch, r in hf_rows.items():
        log(f"plain loop batch {batch}: peak {r['peak_bytes'] / MIB:.1f} MiB")
    ours_rows = {}
    for batch in powers_of_two(args.max_batch):
        code, records, tail = ours.run(batch, args.memory_steps)
        if code not in (0, 4):
            sys.exit(f"trainer at batch {batch} failed (exit {code}):\n{tail}")
        ours_rows[batch] = dict(code=code, records=records)
        peak = max((r["memory_peak"] for r in records), default=0)
        log(f"trainer batch {batch}: exit {code}, micro-batch {[r['micro_batch'] for r in records]}, "
            f"peak {peak / MIB:.1f} MiB")
        if code != 0:
            break
    hf_fit = [b for b, r in hf_rows.items() if r["peak_bytes"] <= args.cap]
    ours_fit = [b for b, r in ours_rows.items() if r["code"] == 0]
    hf_max, ours_max = max(hf_fit, default=0), max(ours_fit, default=0)

    rows = []
    for batch in sorted(set(hf_rows) | set(ours_rows)):
        h, o = hf_rows.get(batch), ours_rows.get(batch)
        if o is None:
            ours_cells = ["not run", "", "", "", ""]
        else:
            micro = sorted({r["micro_batch"] for r in o["records"]})
            peak = max((r["memory_peak"] for r in o["records"]), default=0)
            adaptations = o["records"][-1]["adaptations"] if o["records"] else "-"
            ours_cells = ["yes" if o["code"] == 0 else "no (exit 4: out of memory at the floor)",
                          "/".join(map(str, micro)) if micro else "-", adaptations,
                          f"{peak / MIB:.1f}" if peak else "-",
                          f"{o['records'][-1]['tokens_per_s']:.1f}" if o["records"] else "-"]
        hf_cells = ["not run", ""] if h is None else \
            [f"{h['peak_bytes'] / MIB:.1f}", "yes" if h["peak_bytes"] <= args.cap else "no (over the cap)"]
        rows.append([batch, *ours_cells, *hf_cells])
    memory_table = table(["effective batch", "trainer completes", "trainer micro-batch", "adaptations",
                          "trainer peak MiB", "trainer images/s (last step)",
                          "plain loop peak MiB", "plain loop fits"], rows)
    ours_note = f"{ours_max}" + (" (the largest tried)" if ours_max == args.max_batch else "")
    ratio_text = (f"{'>= ' if ours_max == args.max_batch else ''}{ours_max / hf_max:.0f}x" if hf_max else "n/a")

    # 2. images/s at the largest batch both can run.
    both = min(hf_max, ours_max)
    speed_rows, samples = [], {"ours": [], "hf": [], "ours_micro": [], "load": []}
    if both >= 2:
        for r in range(args.rounds):
            for side in (("ours", "hf") if r % 2 == 0 else ("hf", "ours")):
                samples["load"].append(load_average())
                if side == "ours":
                    code, records, tail = ours.run(both, args.steps + args.warmup)
                    if code != 0:
                        sys.exit(f"trainer at batch {both} failed (exit {code}):\n{tail}")
                    rate = median([x["tokens_per_s"] for x in records[args.warmup:]])
                    samples["ours_micro"] += [x["micro_batch"] for x in records]
                else:
                    steps = run_loop("speed", dict(model_dir=model, train_file=train, lr=LR, seed=SEED,
                                                   max_length=MAX_LENGTH, batch=both,
                                                   steps=args.steps + args.warmup), work, args.threads)
                    rate = median([both / x["seconds"] for x in steps[args.warmup:]])
                samples[side].append(rate)
                log(f"round {r + 1}/{args.rounds} {side}: {rate:.2f} images/s")
        o, h = median(samples["ours"]), median(samples["hf"])
        micro = "/".join(map(str, sorted(set(samples["ours_micro"]))))
        speed_rows.append([both, micro, f"{o:.2f}", f"{h:.2f}", f"{o / h:.2f}x", f"{median(samples['load']):.1f}"])

    print(f"CLIP, vision and text {args.layers} layers of width {args.width}, {args.image_size} px images in 8 px "
          f"patches, captions up to {MAX_LENGTH} tokens; memory cap {args.cap / MIB:.0f} MiB; {args.threads} "
          f"thread(s) per side\n{notes_before}\n")
    print(memory_table)
    print(f"\nLargest effective batch under {args.cap / MIB:.0f} MiB: trainer {ours_note}, plain loop {hf_max}: "
          f"{ratio_text}\n")
    if speed_rows:
        print(table(["effective batch", "trainer micro-batch", "trainer images/s", "plain loop images/s", "ratio",
                     "load avg"], speed_rows))
        print(f"\nmedians of {args.rounds} alternating round(s) of {args.steps} steps after {args.warmup} warm-up")
    print(f"\nafter: {machine_notes()}")
    if args.json:
        write_json(args.json, dict(cap=args.cap, hf=hf_rows, ours=ours_rows, speed=samples))


if __name__ == "__main__":
    main()
