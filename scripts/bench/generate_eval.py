#!/usr/bin/env python3
"""Evaluation by generation: examples per second of trainer's batched generation (models/generation.h, in batches
of --batch prompts, longest first, as evaluation.generate runs them) against transformers' Seq2SeqTrainer.predict
with predict_with_generate, on the same random model (saved once with save_pretrained), the same prompts (token
ids of random lengths) and the same decoding settings (greedy and beam search, max_new_tokens). Both run on the
CPU in fp32 with the same thread count; EOS is a token the models never produce here, so every answer has
max_new_tokens tokens on both sides and the work is equal. The answers are compared too (greedy must agree).
Prints a Markdown table; no timed assertions.

    .venv/bin/python scripts/bench/generate_eval.py [--tool build/trainer_parity] [--examples 64] [--quick]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, machine_notes, table  # noqa: E402

T5_60M = dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
              feed_forward_proj="relu", tie_word_embeddings=True, decoder_start_token_id=0, pad_token_id=0,
              eos_token_id=1)
QWEN2_100M = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=12, num_key_value_heads=4, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  max_position_embeddings=1024, bos_token_id=2, eos_token_id=1, pad_token_id=0)
TINY_T5 = dict(vocab_size=1000, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
TINY_QWEN2 = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512, eos_token_id=1,
                  pad_token_id=0)
# The EOS given to both sides: an id the random models (which never see it trained) do not produce.
NEVER = -1


def save_model(kind, config, path):
    import torch
    import transformers
    torch.manual_seed(0)
    if kind == "t5":
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(**config))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))
    model.save_pretrained(path)


def prompts_for(count, vocab, seed):
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 96))] for _ in range(count)]


def ours(tool, model_dir, prompts, settings, batch):
    with tempfile.TemporaryDirectory() as tmp:
        request = dict(prompts=prompts, batch_size=batch, eos_token_id=NEVER, pad_token_id=0, **settings)
        with open(os.path.join(tmp, "request.json"), "w") as f:
            json.dump(request, f)
        subprocess.run([tool, "generate", model_dir, os.path.join(tmp, "request.json"), os.path.join(tmp, "out.json")],
                       check=True, capture_output=True, text=True)
        with open(os.path.join(tmp, "out.json")) as f:
            out = json.load(f)
    return out["outputs"], out["seconds"]


def theirs(model_dir, kind, prompts, settings, batch):
    """Seq2SeqTrainer.predict with predict_with_generate; causal prompts padded on the left."""
    import torch
    import transformers
    from torch.utils.data import Dataset

    cls = transformers.AutoModelForSeq2SeqLM if kind == "t5" else transformers.AutoModelForCausalLM
    model = cls.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # NEVER: no answer stops early
    model.generation_config.pad_token_id = 0

    class Prompts(Dataset):
        def __len__(self):
            return len(prompts)

        def __getitem__(self, i):
            return {"input_ids": prompts[i]}

    def collate(rows):
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            if kind == "t5":
                ids[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), 1
            else:
                ids[i, width - n:], mask[i, width - n:] = torch.tensor(r["input_ids"]), 1
        return {"input_ids": ids, "attention_mask": mask}

    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.Seq2SeqTrainingArguments(
            output_dir=tmp, per_device_eval_batch_size=batch, predict_with_generate=True, report_to=[],
            use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
            generation_max_length=None, generation_num_beams=settings.get("num_beams", 1))
        trainer = transformers.Seq2SeqTrainer(model=model, args=args, data_collator=collate)
        start = time.perf_counter()
        out = trainer.predict(Prompts(), max_new_tokens=settings["max_new_tokens"],
                              num_beams=settings.get("num_beams", 1), do_sample=False)
        seconds = time.perf_counter() - start
    # Rows hold the decoder start (T5) or the batch's padded prompt (causal; batches in order) before the answer.
    answers = []
    for i, row in enumerate(out.predictions.tolist()):
        part = prompts[i - i % batch:i - i % batch + batch]
        start_at = 1 if kind == "t5" else max(map(len, part))
        answers.append(row[start_at:start_at + settings["max_new_tokens"]])
    return answers, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool", default=os.path.join(ROOT, "build", "trainer_parity"))
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="tiny models, 16 examples")
    args = parser.parse_args()
    if args.quick:
        args.examples = 16
        models = [("tiny t5", "t5", TINY_T5), ("tiny qwen2", "qwen2", TINY_QWEN2)]
    else:
        models = [("t5-60m", "t5", T5_60M), ("qwen2-100m", "qwen2", QWEN2_100M)]
    rows = []
    for name, kind, config in models:
        with tempfile.TemporaryDirectory() as tmp:
            save_model(kind, config, tmp)
            prompts = prompts_for(args.examples, config["vocab_size"], seed=1)
            for label, settings in [("greedy", dict(num_beams=1)), ("beams 4", dict(num_beams=4))]:
                settings = dict(settings, max_new_tokens=args.max_new_tokens)
                our_answers, our_seconds = ours(args.tool, tmp, prompts, settings, args.batch)
                their_answers, their_seconds = theirs(tmp, kind, prompts, settings, args.batch)
                same = sum(a == b[:len(a)] for a, b in zip(our_answers, their_answers))
                rows.append([name, label, args.examples, args.batch, args.max_new_tokens,
                             f"{args.examples / their_seconds:.2f}", f"{args.examples / our_seconds:.2f}",
                             f"{their_seconds / our_seconds:.2f}x", f"{same}/{args.examples}"])
                print(f"{name} {label}: transformers {their_seconds:.2f} s, trainer {our_seconds:.2f} s",
                      file=sys.stderr, flush=True)
    print(machine_notes())
    print()
    print(table(["model", "decoding", "examples", "batch", "new tokens", "Seq2SeqTrainer ex/s", "trainer ex/s",
                 "speed-up", "same answers"], rows))


if __name__ == "__main__":
    main()
