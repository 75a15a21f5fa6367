#!/usr/bin/env python3
"""Measures what our forward pass keeps for backward over several shapes of each architecture and fits the
coefficients of the activation model in src/memory/planner.cpp (least squares), printing them beside the maximum
relative error of the fit. Run it after changing a model's forward and copy the new coefficients into planner.cpp.

    .venv/bin/python scripts/bench/calibrate_planner.py [--tool build/trainer_parity]
"""
import argparse
import json
import pathlib
import subprocess
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]

LLAMA_BASE = dict(model_type="qwen2", hidden_size=128, intermediate_size=352, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=1000, tie_word_embeddings=False,
                  rms_norm_eps=1e-6, hidden_act="silu", rope_theta=10000.0, attention_dropout=0.0)
LLAMA_VARIANTS = [{}, dict(intermediate_size=704), dict(hidden_size=256), dict(vocab_size=2000),
                  dict(num_hidden_layers=3), dict(num_key_value_heads=4),
                  dict(num_attention_heads=8, num_key_value_heads=4, head_dim=32)]
T5_BASE = dict(model_type="t5", d_model=128, d_ff=352, d_kv=32, num_heads=4, num_layers=2, num_decoder_layers=2,
               vocab_size=1000, feed_forward_proj="gated-gelu", dense_act_fn="gelu_new", is_gated_act=True,
               relative_attention_num_buckets=8, relative_attention_max_distance=32, layer_norm_epsilon=1e-6,
               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, tie_word_embeddings=True)
T5_VARIANTS = [{}, dict(d_ff=704), dict(num_heads=8), dict(num_layers=3), dict(num_decoder_layers=3),
               dict(vocab_size=2000), dict(d_model=256)]
SHAPES = [(2, 64, 32), (1, 128, 32), (1, 64, 64), (1, 32, 64), (1, 96, 48)]


def measure(tool, config, shapes):
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        (pathlib.Path(tmp) / "config.json").write_text(json.dumps(config))
        for b, t, l in shapes:
            out = subprocess.run([tool, "activations", tmp, str(b), str(t), str(l)], check=True, capture_output=True,
                                 text=True).stdout
            rows.append((b, t, l, json.loads(out)["saved"] / 4 / b))  # fp32 elements per example
    return rows


def llama_features(c, t):
    d, f, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    h, kv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim", d // h)
    return [n * t * d, n * t * f, n * t * h * hd, n * t * kv * hd, n * t * t, t * v, t * d, t, t * hd]


def t5_features(c, t, l):
    d, f, v, h = c["d_model"], c["d_ff"], c["vocab_size"], c["num_heads"]
    inner, ne, nd = h * c["d_kv"], c["num_layers"], c["num_decoder_layers"]
    return [ne * t * d, ne * t * f + nd * l * f, ne * t * inner, ne * h * t * t + nd * h * l * l, nd * l * d,
            nd * l * inner, nd * h * l * t, nd * t * inner, l * v, t * d, l * d, t + l]


def fit(name, labels, rows):
    x = np.array([r[0] for r in rows], float)
    y = np.array([r[1] for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    error = np.max(np.abs(x @ coef - y) / y)
    print(f"\n{name}: {len(rows)} measurements, max relative error of the fit {100 * error:.2f}%")
    for label, value in zip(labels, coef):
        print(f"  {label:34s} {value:8.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool", default=str(ROOT / "build" / "trainer_parity"))
    tool = parser.parse_args().tool

    rows = []
    for variant in LLAMA_VARIANTS:
        c = {**LLAMA_BASE, **variant}
        rows += [(llama_features(c, t), y) for b, t, l, y in measure(tool, c, [(b, t, 0) for b, t, _ in SHAPES])]
    # The last feature (rope tables) is per micro-batch, not per example: divide by the batch size.
    fit("Llama family (per example: layers x tokens x ...)",
        ["d_model", "intermediate", "heads x head_dim", "kv_heads x head_dim", "tokens (attention mask)",
         "vocabulary (outside the blocks)", "d_model (outside)", "per token", "head_dim (rope)"], rows)
    for dropout in (0.1, 0.0):
        rows = []
        for variant in T5_VARIANTS:
            c = {**T5_BASE, **variant, "dropout_rate": dropout}
            rows += [(t5_features(c, t, l), y) for b, t, l, y in measure(tool, c, SHAPES)]
        # With dropout, compare with kT5NoDropout + masks / 4 (fp32) + explicit attention (planner.cpp).
        fit(f"T5, dropout_rate {dropout} ({'with_dropout(kT5NoDropout, 0.25)' if dropout else 'kT5NoDropout'})",
            ["d (encoder)", "ff", "heads_kv (encoder)", "attention (per head and key)", "decoder_d",
             "decoder_heads_kv", "cross_attention", "cross_kv", "vocabulary", "encoder_out", "decoder_out",
             "per_token"], rows)


if __name__ == "__main__":
    main()
