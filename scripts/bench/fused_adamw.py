#!/usr/bin/env python3
"""AdamW through ATen's fused kernel (_fused_adamw_, what trainer runs when parameters and moments are fp32)
against the chunked update (fixed fp32 scratch buffers, the path bf16 weights and moments keep): whole training
steps and the update alone, fp32 full fine-tuning of the same model on the same batch, the two sides alternating
step by step in one process (the order swapped every round), medians after the warm-up rounds. Prints a Markdown
table. Both sides give the same weights (tests/unit/train/optimizer_test.cpp).

    .venv/bin/python scripts/bench/fused_adamw.py [--tool build/trainer_parity] [--rounds 8] [--quick]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, machine_notes, median, table  # noqa: E402

T5_60M = dict(model_type="t5", vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6,
              num_heads=8, relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
              feed_forward_proj="relu", tie_word_embeddings=True, decoder_start_token_id=0, pad_token_id=0,
              eos_token_id=1, layer_norm_epsilon=1e-6)
QWEN2_100M = dict(model_type="qwen2", vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=12, num_key_value_heads=4, rms_norm_eps=1e-6, hidden_act="silu",
                  rope_theta=10000.0, tie_word_embeddings=False)


def cases(quick):
    tiny_t5 = json.load(open(os.path.join(ROOT, "configs", "models", "tiny-t5", "config.json")))
    out = [("tiny-t5", tiny_t5, 16, 64, 32)]
    if not quick:
        out += [("t5-60m", T5_60M, 8, 128, 64), ("qwen2-100m", QWEN2_100M, 8, 128, 0)]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool", default=os.path.join(ROOT, "build", "trainer_parity"))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the tiny model only")
    args = parser.parse_args()
    rows = []
    for name, config, b, t, l in cases(args.quick):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config, f)
            out = subprocess.run([args.tool, "adamw-cost", tmp, str(b), str(t), str(l), str(args.rounds)],
                                 check=True, capture_output=True, text=True).stdout
        times = {key: median(values[args.warmup:]) for key, values in json.loads(out).items()}
        shape = f"{b} x {t}" + (f" -> {l}" if l else "")
        rows.append([name, shape,
                     f"{1000 * times['chunked_update']:.1f}", f"{1000 * times['fused_update']:.1f}",
                     f"{times['fused_update'] / times['chunked_update']:.2f}x",
                     f"{1000 * times['chunked_step']:.0f}", f"{1000 * times['fused_step']:.0f}",
                     f"{times['fused_step'] / times['chunked_step']:.3f}x"])
        print(f"{name}: {times}", file=sys.stderr, flush=True)
    print(machine_notes())
    print(f"{args.rounds} rounds per model, medians of the last {args.rounds - args.warmup} of each side\n")
    print(table(["model", "batch x tokens", "chunked update ms", "fused update ms", "fused / chunked",
                 "chunked step ms", "fused step ms", "fused / chunked"], rows))


if __name__ == "__main__":
    main()
