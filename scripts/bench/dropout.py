#!/usr/bin/env python3
"""The cost of keyed dropout (masks from counter-based bits keyed by seed, step, example and site: split-invariant)
against LibTorch's generator dropout (at::dropout and scaled_dot_product_attention's dropout_p, what trainer did
before): whole training steps of the same model on the same batch, the two sides alternating step by step in one
process (the order swapped every round), medians after the warm-up rounds. Prints a Markdown table.

    .venv/bin/python scripts/bench/dropout.py [--tool build/trainer_parity] [--rounds 12] [--quick]
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
              num_heads=8, relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
              feed_forward_proj="relu", tie_word_embeddings=True, decoder_start_token_id=0, pad_token_id=0,
              eos_token_id=1, layer_norm_epsilon=1e-6)
QWEN2_30M = dict(model_type="qwen2", vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                 num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-6, hidden_act="silu",
                 rope_theta=10000.0, tie_word_embeddings=True, attention_dropout=0.1)


def cases(quick):
    tiny_t5 = json.load(open(os.path.join(ROOT, "configs", "models", "tiny-t5", "config.json")))
    tiny_qwen2 = {**json.load(open(os.path.join(ROOT, "configs", "models", "tiny-qwen2", "config.json"))),
                  "attention_dropout": 0.1}
    out = [("tiny-t5 (dropout_rate 0.1)", tiny_t5, 16, 64, 32, 0.0),
           ("tiny-qwen2 + attention_dropout 0.1 + LoRA dropout 0.05", tiny_qwen2, 16, 64, 0, 0.05)]
    if not quick:
        out += [("t5-60m (dropout_rate 0.1)", T5_60M, 8, 128, 64, 0.0),
                ("qwen2-30m + attention_dropout 0.1, full", QWEN2_30M, 8, 128, 0, 0.0),
                ("qwen2-30m + attention_dropout 0.1 + LoRA dropout 0.05", QWEN2_30M, 8, 128, 0, 0.05)]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool", default=os.path.join(ROOT, "build", "trainer_parity"))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the tiny models only")
    args = parser.parse_args()
    rows = []
    for name, config, b, t, l, lora_dropout in cases(args.quick):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config, f)
            out = subprocess.run([args.tool, "dropout-cost", tmp, str(b), str(t), str(l), str(args.rounds),
                                  str(lora_dropout)], check=True, capture_output=True, text=True).stdout
        times = json.loads(out)
        keyed = median(times["keyed"][args.warmup:])
        generator = median(times["generator"][args.warmup:])
        shape = f"{b} x {t}" + (f" -> {l}" if l else "")
        rows.append([name, shape, f"{1000 * generator:.1f}", f"{1000 * keyed:.1f}", f"{keyed / generator:.3f}x"])
        print(f"{name}: generator {generator:.4f} s, keyed {keyed:.4f} s", file=sys.stderr, flush=True)
    print(machine_notes())
    print(f"{args.rounds} rounds per model, medians of the last {args.rounds - args.warmup} steps of each side\n")
    print(table(["model", "batch x tokens", "generator ms/step", "keyed ms/step", "keyed / generator"], rows))


if __name__ == "__main__":
    main()
