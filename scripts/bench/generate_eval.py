#!/usr/bin/env python3
"""Evaluation by generation: examples per second of trainer's batched generation (models/generation.h, in batches
of --batch prompts, longest first, as evaluation.generate runs them) against transformers' Seq2SeqTrainer.predict
with predict_with_generate, on the same random model (saved once with save_pretrained), the same prompts (token
ids of random lengths) and the same decoding settings (greedy and beam search, max_new_tokens). Both run on the
CPU in fp32 with the same thread count; EOS is a token the models never produce here, so every answer has
max_new_tokens tokens on both sides and the work is equal. The answers are compared too (greedy must agree).
Each side reports wall time and CPU time (the process's, all threads): with --threads 1 on a shared machine the
CPU time is what other processes change least. --rounds N runs the sides N times, alternating, and keeps each
side's best. --before TOOL times an earlier build of trainer_parity in the same rounds (its CPU time, when it does
not report one, is the child's CPU time less that of loading the model and exiting). Prints a Markdown table; no
timed assertions.

    .venv/bin/python scripts/bench/generate_eval.py [--tool build/trainer_parity] [--examples 64] [--quick]
        [--threads 1] [--rounds 2] [--before OLD/trainer_parity] [--device cuda --dtype bf16] [--json OUT]

On a card (--device cuda, scripts/gpu_full.py part 6) both sides generate there, in --dtype; the rate that counts
is then the wall-clock one, and answers in bf16 may part where two logits round alike (counted, not asserted).
--json writes the rows for scripts.
"""
import argparse
import json
import os
import resource
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


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


DEVICE = "cpu"  # --device and --dtype: where and in what both sides generate
DTYPE = "fp32"


def run_tool(tool, model_dir, prompts, settings, batch):
    """The tool's output and the CPU seconds of the whole child process."""
    with tempfile.TemporaryDirectory() as tmp:
        request = dict(prompts=prompts, batch_size=batch, eos_token_id=NEVER, pad_token_id=0, device=DEVICE,
                       dtype=DTYPE, **settings)
        with open(os.path.join(tmp, "request.json"), "w") as f:
            json.dump(request, f)
        before = children_cpu()
        subprocess.run([tool, "generate", model_dir, os.path.join(tmp, "request.json"), os.path.join(tmp, "out.json")],
                       check=True, capture_output=True, text=True)
        child = children_cpu() - before
        with open(os.path.join(tmp, "out.json")) as f:
            return json.load(f), child


def ours(tool, model_dir, prompts, settings, batch):
    """(answers, wall seconds, CPU seconds) of the generation."""
    out, child = run_tool(tool, model_dir, prompts, settings, batch)
    cpu = out.get("cpu_seconds")
    if cpu is None:  # an older build: the child's CPU time less that of loading the model
        _, load = run_tool(tool, model_dir, [], settings, batch)
        cpu = child - load
    return out["outputs"], out["seconds"], cpu


def theirs(model_dir, kind, prompts, settings, batch):
    """Seq2SeqTrainer.predict with predict_with_generate; causal prompts padded on the left."""
    import torch
    import transformers
    from torch.utils.data import Dataset

    cls = transformers.AutoModelForSeq2SeqLM if kind == "t5" else transformers.AutoModelForCausalLM
    model = cls.from_pretrained(model_dir, dtype=torch.bfloat16 if DTYPE == "bf16" else torch.float32)
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
            use_cpu=DEVICE == "cpu", dataloader_num_workers=0, disable_tqdm=True,
            generation_max_length=None, generation_num_beams=settings.get("num_beams", 1))
        trainer = transformers.Seq2SeqTrainer(model=model, args=args, data_collator=collate)
        start, cpu_start = time.perf_counter(), time.process_time()
        out = trainer.predict(Prompts(), max_new_tokens=settings["max_new_tokens"],
                              num_beams=settings.get("num_beams", 1), do_sample=False)
        if DEVICE != "cpu":
            torch.cuda.synchronize()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    # Rows hold the decoder start (T5) or the batch's padded prompt (causal; batches in order) before the answer.
    answers = []
    for i, row in enumerate(out.predictions.tolist()):
        part = prompts[i - i % batch:i - i % batch + batch]
        start_at = 1 if kind == "t5" else max(map(len, part))
        answers.append(row[start_at:start_at + settings["max_new_tokens"]])
    return answers, seconds, cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool", default=os.path.join(ROOT, "build", "trainer_parity"))
    parser.add_argument("--before", help="an earlier build of trainer_parity, timed in the same rounds")
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, help="intra-op threads of both sides (default: their own default)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating runs of each side; the best counts")
    parser.add_argument("--only", help="models to run, comma-separated (t5-60m, qwen2-100m; tiny t5, tiny qwen2)")
    parser.add_argument("--quick", action="store_true", help="tiny models, 16 examples")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both sides generate")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="both sides' weights")
    parser.add_argument("--json", help="also write the rows here (model, decoding, examples/s of each side)")
    args = parser.parse_args()
    global DEVICE, DTYPE
    DEVICE, DTYPE = args.device, args.dtype
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the tools, started from here
    if args.quick:
        args.examples = 16
        models = [("tiny t5", "t5", TINY_T5), ("tiny qwen2", "qwen2", TINY_QWEN2)]
    else:
        models = [("t5-60m", "t5", T5_60M), ("qwen2-100m", "qwen2", QWEN2_100M)]
    if args.only:
        models = [m for m in models if m[0] in args.only.split(",")]
    sides = ["transformers", "trainer"] + (["before"] if args.before else [])
    rows, records = [], []
    for name, kind, config in models:
        with tempfile.TemporaryDirectory() as tmp:
            save_model(kind, config, tmp)
            prompts = prompts_for(args.examples, config["vocab_size"], seed=1)
            for label, settings in [("greedy", dict(num_beams=1)), ("beams 4", dict(num_beams=4))]:
                settings = dict(settings, max_new_tokens=args.max_new_tokens)
                best = {side: (float("inf"), float("inf")) for side in sides}
                answers = {}
                for r in range(args.rounds):
                    for side in (sides if r % 2 == 0 else sides[::-1]):
                        if side == "transformers":
                            answers[side], wall, cpu = theirs(tmp, kind, prompts, settings, args.batch)
                        else:
                            tool = args.tool if side == "trainer" else args.before
                            answers[side], wall, cpu = ours(tool, tmp, prompts, settings, args.batch)
                        best[side] = (min(best[side][0], wall), min(best[side][1], cpu))
                        print(f"{name} {label} round {r + 1}: {side} {wall:.2f} s wall, {cpu:.2f} s CPU",
                              file=sys.stderr, flush=True)
                same = sum(a == b[:len(a)] for a, b in zip(answers["trainer"], answers["transformers"]))
                rate = {side: (args.examples / best[side][0], args.examples / best[side][1]) for side in sides}
                row = [name, label]
                for k in (0, 1):  # wall, CPU
                    if args.before:
                        row.append(f"{rate['before'][k]:.2f}")
                    row += [f"{rate['transformers'][k]:.2f}", f"{rate['trainer'][k]:.2f}",
                            f"{rate['trainer'][k] / rate['transformers'][k]:.2f}x"]
                rows.append(row + [f"{same}/{args.examples}"])
                records.append(dict(model=name, decoding=label, examples=args.examples, same_answers=same,
                                    **{f"{side}_wall": rate[side][0] for side in sides},
                                    **{f"{side}_cpu": rate[side][1] for side in sides}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=DEVICE, dtype=DTYPE, batch=args.batch, max_new_tokens=args.max_new_tokens,
                           rounds=args.rounds, rows=records), f, indent=1)
    print(machine_notes())
    print(f"{args.examples} examples, batch {args.batch}, {args.max_new_tokens} new tokens, "
          f"threads {args.threads or 'default'}, best of {args.rounds} alternating rounds, {DEVICE} {DTYPE}")
    print()
    columns = ["model", "decoding"]
    for unit in ("wall", "CPU"):
        if args.before:
            columns.append(f"before ex/s ({unit})")
        columns += [f"Seq2SeqTrainer ex/s ({unit})", f"trainer ex/s ({unit})", f"speed-up ({unit})"]
    print(table(columns + ["same answers"], rows))


if __name__ == "__main__":
    main()
