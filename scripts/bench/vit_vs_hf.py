#!/usr/bin/env python3
"""ViT image classification: trainer against transformers' Trainer (scripts/bench/hf_image_stack.py) on the same
demo images, the same preprocessing and the same model shape, on this machine's CPU. Prints a Markdown table.

    scripts/bench/vit_vs_hf.py                       # fp32 and bf16-mixed, 3 repetitions (several minutes)
    scripts/bench/vit_vs_hf.py --precisions fp32 --repeats 1 --steps 4
    scripts/bench/vit_vs_hf.py --caps 256MiB 512MiB --cap-batch 64 --repeats 0   # largest micro-batch under caps only
    scripts/bench/vit_vs_hf.py --caps 256MiB --cap-batch 128 --cap-checkpointing --repeats 0

Same work on both sides: a ViT from one config.json (random init on each side; default a small ViT: 224 px,
16 px patches, hidden 192, 6 layers, 3 heads), 5 classes of scripts/make_demo_images.py images (200-500 px,
JPEG/PNG), ViTImageProcessor's resize to 224 x 224 + rescale + normalise (no augmentation), the images in
folder order (trainer data.shuffle=false, HF train_sampling_strategy="sequential"), effective batch = micro-batch
(no accumulation), AdamW lr 1e-3 with linear decay, clipping at 1.0, dropout 0, 2 data workers on each side
(trainer: decoding threads; HF: DataLoader worker processes), the same OMP thread count.

Throughput: images/s over the steps after --warmup, from the moments each side reports a finished step (trainer:
its per-step log line; HF: a TrainerCallback line), timestamped here as they arrive. Peak RSS: the process's
high-water mark as GNU time reports it (for HF the main process; its DataLoader workers are separate processes).
The sides alternate, the order flipping each repetition; medians and their ratio are reported.

The largest micro-batch under a memory cap (--caps), fp32, --cap-steps steps must complete (the second holds
AdamW's moments), both sides measured as peak live tensor bytes (the approach of clip_vs_hf.py): trainer under
memory.limit = cap, (1) micro_batch_size=auto (auto_safety_margin 0) at an effective batch of --cap-batch: the
probe's pick; (2) a fixed micro-batch = effective batch with memory.on_oom=fail, from the pick upwards until a run
exits 4: the largest that completes (peak: metrics.jsonl's memory_peak). HF: the Trainer at
per_device_train_batch_size=B, one process per B (dataloader_num_workers=0), its peak from hf_image_stack.py's
measure_memory callback (parameters, buffers, optimizer state and the batch at the step's start + the highest
running sum of torch.profiler's allocations and frees during the step); B doubles from 1 until over the cap (or
past --cap-batch), then bisection. --cap-checkpointing recomputes each block in backward on both sides.
"""
import argparse
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (BENCH_DIR, PY, ROOT, TRAINER, fresh_dir, load_average, log, machine_notes, median,  # noqa: E402
                    run_measured, table, write_json)

MIB = 2**20
HF_IMAGE_STACK = os.path.join(ROOT, "scripts", "bench", "hf_image_stack.py")
STEP_LINE = re.compile(r"\] step (\d+)/\d+ loss ([\d.naif-]+)")
HF_STEP = re.compile(r"^BENCH step (\d+) loss (\S+)")
LR, SEED, WORKERS = 1e-3, 1, 2


def images_folder(per_class):
    folder = os.path.join(BENCH_DIR, "images", f"vit-{per_class}")
    if not os.path.exists(os.path.join(folder, "train")):
        import subprocess
        subprocess.run([PY, os.path.join(ROOT, "scripts", "make_demo_images.py"), "--out", folder + ".part",
                        "--classes", "5", "--per-class", str(per_class), "--validation-per-class", "0",
                        "--min-size", "200", "--max-size", "500"], check=True, capture_output=True)
        os.replace(folder + ".part", folder)
    return os.path.join(folder, "train")


def model_dir(hidden, layers, heads):
    path = os.path.join(BENCH_DIR, "models", f"vit-224-h{hidden}-l{layers}")
    os.makedirs(path, exist_ok=True)
    write_json(os.path.join(path, "config.json"),
               {"model_type": "vit", "architectures": ["ViTForImageClassification"], "hidden_size": hidden,
                "num_hidden_layers": layers, "num_attention_heads": heads, "intermediate_size": 4 * hidden,
                "image_size": 224, "patch_size": 16, "num_channels": 3, "hidden_act": "gelu",
                "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "layer_norm_eps": 1e-12,
                "initializer_range": 0.02, "qkv_bias": True})
    write_json(os.path.join(path, "preprocessor_config.json"),
               {"image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": 224, "width": 224},
                "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]})
    return path


def env(threads):
    return dict(os.environ, OMP_NUM_THREADS=str(threads))


def run_ours(work, model, train, batch, steps, precision, threads, micro=None, memory=None, checkpointing=False):
    out_dir = fresh_dir(os.path.join(work, "ours"))
    config = os.path.join(work, "ours.json")
    write_json(config, {
        "model": {"path": model, "init": "random"},
        "data": {"train_files": [train], "validation_files": [], "shuffle": False, "augment": False,
                 "num_workers": WORKERS},
        "training": {"batch_size": batch, "micro_batch_size": micro or batch, "max_steps": steps, "seed": SEED,
                     "activation_checkpointing": checkpointing},
        "memory": memory or {},
        "optimizer": {"lr": LR, "weight_decay": 0.0},
        "scheduler": {"name": "linear", "warmup_steps": 0},
        "evaluation": {"every_steps": 0},
        "precision": {"mode": precision},
        "device": {"type": "cpu"},
        "checkpoint": {"output_dir": out_dir, "save_final": False},
        "logging": {"every_steps": 1, "tensorboard": False, "progress": "plain"},
    })
    run = run_measured([TRAINER, "--config", config], env=env(threads))
    return run, [t for t, line in run.lines if STEP_LINE.search(line)]


def run_hf(work, model, train, batch, steps, precision, threads, workers=WORKERS, **extra):
    spec = os.path.join(work, "hf.json")
    write_json(spec, dict(model_dir=model, train_folder=train, batch_size=batch, max_steps=steps, lr=LR, seed=SEED,
                          workers=workers, precision=precision, output_dir=os.path.join(work, "hf"), **extra))
    with tempfile.TemporaryDirectory() as cache:
        run = run_measured([PY, HF_IMAGE_STACK, "train", spec], env=dict(env(threads), HF_HOME=cache))
    return run, [t for t, line in run.lines if HF_STEP.match(line)]


def images_per_second(times, batch, warmup):
    if len(times) <= warmup:
        return None
    return batch * (len(times) - warmup) / (times[-1] - times[warmup - 1])


def parse_size(text):
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"--caps {text!r}: expected a size such as 512MiB")
    return int(float(match.group(1)) * {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[match.group(2)])


def ours_largest(work, model, train, cap, args):
    """trainer under memory.limit=cap: (1) micro_batch_size=auto (no safety margin: the HF side keeps none) at an
    effective batch of --cap-batch, --cap-steps steps: the micro-batch the probe picks; (2) a fixed micro-batch
    equal to the effective batch (one micro-batch per step, as HF's per-device batch without accumulation) with
    memory.on_oom=fail, from the probe's pick upwards until a run exits 4 (out of memory): the largest that
    completes. Returns (auto's pick, its run's peak, largest fixed, its peak, the first fixed over the cap)."""
    memory = {"limit": str(cap), "auto_safety_margin": 0.0}
    run, times = run_ours(work, model, train, args.cap_batch, args.cap_steps, "fp32", args.threads, micro="auto",
                          memory=memory, checkpointing=args.cap_checkpointing)
    if run.returncode != 0 or len(times) != args.cap_steps:
        tail = "\n".join(line for _, line in run.lines[-20:])
        sys.exit(f"trainer micro_batch_size=auto under {cap / MIB:.0f} MiB failed (exit {run.returncode}):\n{tail}")
    records = metrics(os.path.join(work, "ours", "metrics.jsonl"))
    auto = min(r["micro_batch"] for r in records)
    auto_peak = max(r["memory_peak"] for r in records)
    log(f"cap {cap / MIB:.0f} MiB: trainer micro_batch_size=auto picks {auto} (peak {auto_peak / MIB:.1f} MiB)")
    fixed, fixed_peak, batch = 0, 0, auto
    while batch <= args.cap_batch:
        run, times = run_ours(work, model, train, batch, args.cap_steps, "fp32", args.threads, micro=batch,
                              memory={"limit": str(cap), "on_oom": "fail"}, checkpointing=args.cap_checkpointing)
        if run.returncode == 4:
            log(f"  trainer fixed micro-batch {batch}: exit 4 (out of memory)")
            break
        if run.returncode != 0 or len(times) != args.cap_steps:
            tail = "\n".join(line for _, line in run.lines[-20:])
            sys.exit(f"trainer at micro-batch {batch} under {cap / MIB:.0f} MiB failed (exit {run.returncode}):\n{tail}")
        fixed, fixed_peak = batch, max(r["memory_peak"] for r in metrics(os.path.join(work, "ours", "metrics.jsonl")))
        log(f"  trainer fixed micro-batch {batch}: completes, peak {fixed_peak / MIB:.1f} MiB")
        batch += 1
    return auto, auto_peak, fixed, fixed_peak, batch


def metrics(path):
    import json
    with open(path) as f:
        return [r for r in map(json.loads, f) if "micro_batch" in r]


def hf_peak(work, model, train, batch, args):
    """The HF Trainer's peak live tensor bytes over --cap-steps steps at per_device_train_batch_size=batch (a
    process of its own, data loaded in it: dataloader_num_workers=0)."""
    run, _ = run_hf(work, model, train, batch, args.cap_steps, "fp32", args.threads, measure_memory=True,
                    workers=0, gradient_checkpointing=args.cap_checkpointing)
    peaks = [int(m.group(1)) for _, line in run.lines if (m := re.search(r"^BENCH memory step \d+ peak_bytes (\d+)",
                                                                           line))]
    if run.returncode != 0 or len(peaks) != args.cap_steps:
        tail = "\n".join(line for _, line in run.lines[-20:])
        sys.exit(f"HF at batch {batch} failed (exit {run.returncode}):\n{tail}")
    return max(peaks)


def hf_largest(work, model, train, cap, args):
    """The largest batch whose measured peak is at most the cap: doubling from 1, then bisection. Returns (batch,
    its peak bytes, {batch: peak} of every batch tried)."""
    tried = {}

    def fits(batch):
        tried[batch] = hf_peak(work, model, train, batch, args)
        log(f"  HF batch {batch}: peak {tried[batch] / MIB:.1f} MiB ({'fits' if tried[batch] <= cap else 'over'})")
        return tried[batch] <= cap

    if not fits(1):
        return 0, tried[1], tried
    low, high = 1, 2
    while high <= args.cap_batch and fits(high):
        low, high = high, high * 2
    if high > args.cap_batch:
        return low, tried[low], tried
    while high - low > 1:  # low fits, high does not
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low, tried[low], tried


def largest_micro_batch(args, model, train):
    rows, results = [], []
    for cap in args.caps:
        work = fresh_dir(os.path.join(BENCH_DIR, "runs", "vit_vs_hf", f"cap-{cap // MIB}MiB"))
        load = load_average()
        auto, auto_peak, fixed, fixed_peak, over = ours_largest(work, model, train, cap, args)
        hf, hf_peak_bytes, tried = hf_largest(work, model, train, cap, args)
        load = f"{load:.1f}-{load_average():.1f}"
        top = " (the largest tried)"
        rows.append([f"{cap / MIB:.0f}", f"{auto} ({auto_peak / MIB:.1f})",
                     f"{fixed}{top if over > args.cap_batch else ''} ({fixed_peak / MIB:.1f})",
                     f"{over}: exit 4" if over <= args.cap_batch else "-",
                     f"{hf}{top if hf == args.cap_batch else ''} ({hf_peak_bytes / MIB:.1f})",
                     f"{hf + 1}: {tried[hf + 1] / MIB:.1f}" if hf + 1 in tried else "-",
                     f"{auto / hf:.2f}x" if hf else "n/a", f"{fixed / hf:.2f}x" if hf else "n/a", load])
        results.append(dict(cap=cap, auto=auto, auto_peak=auto_peak, fixed=fixed, fixed_peak=fixed_peak,
                            over=over, hf=hf, hf_tried=tried))
    header = ["cap MiB", "trainer auto micro-batch (peak MiB)", "trainer largest fixed micro-batch (peak MiB)",
              "trainer first over the cap", "HF Trainer largest batch (peak MiB)", "HF first over the cap: peak MiB",
              "ratio auto / HF", "ratio fixed / HF", "load avg"]
    return table(header, rows), results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="measured steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--caps", nargs="*", type=parse_size, default=[],
                        help="also (or with --precisions and no speed runs: --repeats 0) the largest micro-batch "
                             "under each of these memory caps, e.g. 256MiB 512MiB")
    parser.add_argument("--cap-batch", type=int, default=128,
                        help="trainer's effective batch under a cap and the largest HF batch tried")
    parser.add_argument("--cap-steps", type=int, default=2, help="steps each run under a cap must complete")
    parser.add_argument("--cap-checkpointing", action="store_true",
                        help="under a cap, recompute each block in backward on both sides (trainer "
                             "training.activation_checkpointing=true, HF gradient_checkpointing=True)")
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()
    steps = args.steps + args.warmup
    train = images_folder(max(40, (steps * args.batch + 4) // 5, -(-args.cap_steps * args.cap_batch // 5)
                              if args.caps else 0))
    model = model_dir(args.hidden, args.layers, args.heads)
    if args.caps:
        notes = machine_notes()
        cap_table, cap_results = largest_micro_batch(args, model, train)
        print(f"Largest micro-batch under a memory cap: ViT 224 px, patch 16, hidden {args.hidden}, {args.layers} "
              f"layers, {args.heads} heads; fp32; {args.cap_steps} steps must complete; {args.threads} threads"
              f"{'; activation checkpointing on both sides' if args.cap_checkpointing else ''}\n"
              f"before: {notes}\nafter: {machine_notes()}\n")
        print(cap_table + "\n")
    if args.repeats == 0:
        return
    rows, results = [], {}
    for precision in args.precisions:
        work = fresh_dir(os.path.join(BENCH_DIR, "runs", "vit_vs_hf", precision))
        samples = {"ours": [], "hf": [], "ours_rss": [], "hf_rss": [], "load": []}
        for r in range(args.repeats):
            for side in (("ours", "hf") if r % 2 == 0 else ("hf", "ours")):
                samples["load"].append(load_average())
                runner = run_ours if side == "ours" else run_hf
                run, times = runner(work, model, train, args.batch, steps, precision, args.threads)
                if run.returncode != 0 or len(times) != steps:
                    tail = "\n".join(line for _, line in run.lines[-20:])
                    sys.exit(f"{side} ({precision}) failed (exit {run.returncode}, {len(times)} steps):\n{tail}")
                rate = images_per_second(times, args.batch, args.warmup)
                samples[side].append(rate)
                samples[side + "_rss"].append(run.peak_rss)
                log(f"{precision} rep {r + 1}/{args.repeats} {side}: {rate:.2f} images/s, "
                    f"peak RSS {run.peak_rss / MIB:.0f} MiB, wall {run.seconds:.0f} s")
        results[precision] = samples
        ours, hf = median(samples["ours"]), median(samples["hf"])
        rows.append([precision, f"{ours:.2f}", f"{hf:.2f}", f"{ours / hf:.2f}x",
                     f"{median(samples['ours_rss']) / MIB:.0f}", f"{median(samples['hf_rss']) / MIB:.0f}",
                     f"{median(samples['load']):.1f}"])
    print(f"ViT 224 px, patch 16, hidden {args.hidden}, {args.layers} layers, {args.heads} heads; 5 classes; batch "
          f"{args.batch}; images/s over {args.steps} steps after {args.warmup} warm-up; {args.threads} threads; "
          f"median of {args.repeats} alternating repetitions\n{machine_notes()}\n")
    print(table(["precision", "trainer images/s", "HF Trainer images/s", "ratio", "trainer peak RSS MiB",
                 "HF peak RSS MiB", "load avg"], rows))
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
