#!/usr/bin/env python3
"""ViT image classification: trainer against transformers' Trainer (scripts/bench/hf_image_stack.py) on the same
demo images, the same preprocessing and the same model shape, on this machine's CPU. Prints a Markdown table.

    scripts/bench/vit_vs_hf.py                       # fp32 and bf16-mixed, 3 repetitions (several minutes)
    scripts/bench/vit_vs_hf.py --precisions fp32 --repeats 1 --steps 4

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


def run_ours(work, model, train, batch, steps, precision, threads):
    out_dir = fresh_dir(os.path.join(work, "ours"))
    config = os.path.join(work, "ours.json")
    write_json(config, {
        "model": {"path": model, "init": "random"},
        "data": {"train_files": [train], "validation_files": [], "shuffle": False, "augment": False,
                 "num_workers": WORKERS},
        "training": {"batch_size": batch, "micro_batch_size": batch, "max_steps": steps, "seed": SEED},
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


def run_hf(work, model, train, batch, steps, precision, threads):
    spec = os.path.join(work, "hf.json")
    write_json(spec, dict(model_dir=model, train_folder=train, batch_size=batch, max_steps=steps, lr=LR, seed=SEED,
                          workers=WORKERS, precision=precision, output_dir=os.path.join(work, "hf")))
    with tempfile.TemporaryDirectory() as cache:
        run = run_measured([PY, HF_IMAGE_STACK, "train", spec], env=dict(env(threads), HF_HOME=cache))
    return run, [t for t, line in run.lines if HF_STEP.match(line)]


def images_per_second(times, batch, warmup):
    if len(times) <= warmup:
        return None
    return batch * (len(times) - warmup) / (times[-1] - times[warmup - 1])


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
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()
    steps = args.steps + args.warmup
    train = images_folder(max(40, (steps * args.batch + 4) // 5))
    model = model_dir(args.hidden, args.layers, args.heads)
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
