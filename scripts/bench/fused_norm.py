#!/usr/bin/env python3
"""The fused RMSNorm (models/fused_ops.h: one pass forward, one backward) against the ATen composition it
replaces (transformers' LlamaRMSNorm / T5LayerNorm formulas), on the same model and batch in one process, the two
sides alternating round by round (the order swapped every round): the norm alone (forward + backward over the
batch's rows at the model's width, 10 calls) and whole training steps. Times are the CPU time of the calling
thread with one intra-op thread, so other jobs on a shared machine disturb them less than wall time (they still
share caches and memory bandwidth: treat ratios within a few percent of 1 as noise). Prints a Markdown table of
medians after the warm-up rounds and the ratio fused / unfused. Both sides give the same results
(tests/unit/models/fused_ops_test.cpp; the model parity tests run through the fused kernel).

    .venv/bin/python scripts/bench/fused_norm.py [--tool build/trainer_parity] [--rounds 8] [--quick]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, machine_notes, median, table  # noqa: E402

# FLAN-T5-like (gated-GELU) at t5-small width, and the qwen2-100m of the other benchmarks.
T5_60M = dict(model_type="t5", vocab_size=32128, d_model=512, d_kv=64, d_ff=1024, num_layers=6, num_decoder_layers=6,
              num_heads=8, relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
              feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0,
              eos_token_id=1, layer_norm_epsilon=1e-6)
QWEN2_100M = dict(model_type="qwen2", vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=12, num_key_value_heads=4, rms_norm_eps=1e-6, hidden_act="silu",
                  rope_theta=10000.0, tie_word_embeddings=False)


def cases(quick):
    tiny = lambda name: json.load(open(os.path.join(ROOT, "configs", "models", name, "config.json")))  # noqa: E731
    out = [("tiny-qwen2", tiny("tiny-qwen2"), 16, 64, 0), ("tiny-t5", tiny("tiny-t5"), 16, 64, 32)]
    if not quick:
        out += [("t5-60m (gated)", T5_60M, 4, 128, 64), ("qwen2-100m", QWEN2_100M, 4, 128, 0)]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool", default=os.path.join(ROOT, "build", "trainer_parity"))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precisions", default="fp32,bf16-mixed")
    parser.add_argument("--quick", action="store_true", help="the tiny models only")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    rows = []
    for name, config, b, t, l in cases(args.quick):
        for precision in args.precisions.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                with open(os.path.join(tmp, "config.json"), "w") as f:
                    json.dump(config, f)
                out = subprocess.run([args.tool, "norm-cost", tmp, str(b), str(t), str(l), str(args.rounds), precision],
                                     check=True, capture_output=True, text=True, env=env).stdout
            times = {key: median(values[args.warmup:]) for key, values in json.loads(out).items()}
            shape = f"{b} x {t}" + (f" -> {l}" if l else "")
            rows.append([name, precision, shape,
                         f"{1000 * times['unfused_norm']:.2f}", f"{1000 * times['fused_norm']:.2f}",
                         f"{times['fused_norm'] / times['unfused_norm']:.2f}x",
                         f"{1000 * times['unfused_step']:.0f}", f"{1000 * times['fused_step']:.0f}",
                         f"{times['fused_step'] / times['unfused_step']:.3f}x"])
            print(f"{name} {precision}: {times}", file=sys.stderr, flush=True)
    print(machine_notes())
    print(f"{args.rounds} rounds per row, medians of the last {args.rounds - args.warmup} of each side, thread CPU time, "
          "1 intra-op thread\n")
    print(table(["model", "precision", "batch x tokens", "composition norm ms", "fused norm ms", "fused / composition",
                 "composition step ms", "fused step ms", "fused / composition"], rows))


if __name__ == "__main__":
    main()
