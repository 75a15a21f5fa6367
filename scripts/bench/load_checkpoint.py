#!/usr/bin/env python3
"""Benchmark: loading a ~1 GB checkpoint. Peak RSS and wall time of `trainer generate` (load + one token) on a
random Llama-shaped fp32 checkpoint, against the same command on a tiny model (the process's own baseline:
LibTorch and friends), and transformers' from_pretrained for reference. Prints a table.

    scripts/bench/load_checkpoint.py [--gib 1.0] [--keep DIR]

Goal (models issue): peak RSS above baseline at most 1.2x the weight bytes.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(ROOT, "build", "trainer")


def make_checkpoint(path, gib):
    # hidden 1024, 2816 intermediate, 32k vocab: about 67 MB per layer pair of embeddings + 51 MB per layer (fp32).
    layers = max(1, round((gib * 2**30 - 2 * 32000 * 1024 * 4) / (12.85e6 * 4)))
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in LlamaForCausalLM(config).state_dict().items()}
    torch.manual_seed(0)
    tensors = {name: torch.randn(shape) * 0.02 for name, shape in shapes.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def measure(command):
    """(peak RSS bytes, seconds) of one command, through GNU time: a child forked from this (large) Python
    process would inherit its RSS high-water mark, so the measurement must come from a small parent."""
    with tempfile.NamedTemporaryFile("r") as report:
        start = time.perf_counter()
        result = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", report.name, *command],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        seconds = time.perf_counter() - start
        if result.returncode != 0:
            sys.exit(f"{' '.join(command)} failed: {result.stderr}")
        return int(report.read().split()[-1]) * 1024, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size")
    parser.add_argument("--keep", help="write the checkpoint here and keep it")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    model_dir = args.keep or tmp.name
    os.makedirs(model_dir, exist_ok=True)
    weight_bytes = make_checkpoint(model_dir, args.gib)

    tiny = os.path.join(ROOT, "configs", "models", "tiny-qwen2")
    base_rss, base_s = measure([TRAINER, "generate", "--model", tiny, "--random-init", "--ids", "1", "--max-new-tokens", "1"])
    rss, seconds = measure([TRAINER, "generate", "--model", model_dir, "--ids", "1,2,3", "--max-new-tokens", "1"])
    hf_base, _ = measure([sys.executable, "-c", "import transformers, torch"])
    hf_rss, hf_s = measure([sys.executable, "-c",
                            f"import transformers; transformers.AutoModelForCausalLM.from_pretrained({model_dir!r})"])

    gib = 2**30
    print(f"checkpoint: {weight_bytes / gib:.2f} GiB fp32 safetensors (random Llama-shaped)\n")
    print("| loader | peak RSS | above process baseline | / weight bytes | wall time (load + 1 token) |")
    print("|---|---|---|---|---|")
    print(f"| trainer | {rss / gib:.2f} GiB | {(rss - base_rss) / gib:.2f} GiB | {(rss - base_rss) / weight_bytes:.2f}x "
          f"| {seconds:.2f} s ({seconds - base_s:.2f} s above a tiny model) |")
    print(f"| transformers from_pretrained | {hf_rss / gib:.2f} GiB | {(hf_rss - hf_base) / gib:.2f} GiB "
          f"| {(hf_rss - hf_base) / weight_bytes:.2f}x | {hf_s:.2f} s (load only, incl. imports) |")


if __name__ == "__main__":
    main()
