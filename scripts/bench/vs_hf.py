#!/usr/bin/env python3
"""trainer against the Python stack users run today (transformers' Trainer / Seq2SeqTrainer on the same torch),
on this machine's CPU. Prints Markdown tables.

    scripts/bench/vs_hf.py --quick          # tiny T5 only, short runs: a minute or two (for development)
    scripts/bench/vs_hf.py                  # throughput (tiny T5, ~60M T5, ~100M Qwen2), largest micro-batch
                                            # under a memory cap, OOM recovery
    scripts/bench/vs_hf.py --all            # the above + the loader benchmark + one table against the goals
    scripts/bench/vs_hf.py --parts cap oom  # some parts only
    scripts/bench/vs_hf.py --parts throughput --models qwen3-100m gemma3-100m   # the decoder families (issue 53)
    scripts/bench/vs_hf.py --parts throughput --models qwen3moe-100m            # a mixture of experts (issue 57)

Same work on both sides, and checked: the same config.json (written here; random init on each side), the same
JSONL (scripts/make_demo_data.py), the same tokenizer files, fp32, the same effective batch with no gradient
accumulation, the same maximum lengths, the same dropout (the config's), AdamW lr 1e-3 with linear decay and
clipping at 1.0, data in file order (trainer data.shuffle=false, HF train_sampling_strategy="sequential").
Target tokens (labels that are not -100) are counted per step on each side and must agree step by step.

Throughput: target tokens/s over the steps after --warmup, from the moments each side reports a finished step
(trainer: its per-step log line; HF: a TrainerCallback line), timestamped by this script as they arrive. Time
to first step: from launching the process to the first finished step (imports, model init, data loading, and
for trainer the index pass). Peak RSS: the process's high-water mark (GNU time). Pairs run alternately, the
order flipping each repetition; medians are reported.

HF's best options (--hf-variant best, issue 19's side (b)): HF with train_sampling_strategy="group_by_length",
for causal models DataCollatorWithFlattening (padding-free, position ids per example; transformers derives the
block-diagonal mask from them), and torch_compile=True if a 3-step probe compiles and trains within
--compile-timeout (else left off and said so under the table); trainer with data.group_by_length and
data.packing=true. Each side then draws its own length-grouped order, so the target tokens per step
differ: tokens/s counts each side's own tokens, and the useful FLOPs use the file's average per target token.
--hf-variant best-file-order: the same options without group_by_length on either side (equal rows every step,
checked as for the other rows). --hf-variant users-packed: HF as users run it against trainer with data.packing=true
alone: the same examples in every step, packed into fewer rows, which trains the same weights as padded rows
(tests/integration/packing_test.cpp), so the target tokens of every step are equal and checked.

Precision (--precision fp32 bf16-mixed): fp32 on both sides, or bf16 autocast with fp32 master weights (trainer
precision.mode=bf16-mixed; HF bf16=True, use_cpu=True).

Utilisation: useful model FLOP/s over the measured steps divided by the GEMM peak of the same dtype (fp32 for fp32,
bf16 for bf16-mixed) measured in this run, at the start and at the end (the better of the two): torch.matmul of
2048 x 2048 matrices on 2 threads. Useful FLOPs of a step: 6 x (parameters a token passes through) x (its real,
unpadded tokens), the LM head (6 x d_model x vocabulary) only at trained positions, plus attention (12 x heads x
head_dim per query-key pair: causal pairs only, cross-attention every pair). Embedding lookups and T5's relative
position bias count nothing; T5's cross-attention keys and values count per encoder token. Padding, the LM head at
untrained positions and recomputation are work but not useful work.
"""
import argparse
import json
import os
import re
import resource
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (BENCH_DIR, HF_STACK, PY, ROOT, TINY_MODELS, TRAINER, ensure_data, fresh_dir,  # noqa: E402
                    load_average, log, machine_notes, median, ratio, run_measured, table, write_json)

MIB, GIB = 2**20, 2**30

# name: data form, effective batch, measured steps, warm-up steps, max lengths (none of the data is cut)
MODELS = {
    "tiny-t5": dict(form="seq2seq", batch=16, steps=20, warmup=3),
    "t5-60m": dict(form="seq2seq", batch=8, steps=8, warmup=2),
    "qwen2-100m": dict(form="causal", batch=8, steps=6, warmup=2),
    # The decoder families' shapes at the same size (issue 53): not in the default list; --models qwen3-100m ...
    "qwen3-100m": dict(form="causal", batch=8, steps=6, warmup=2),
    "gemma3-100m": dict(form="causal", batch=8, steps=6, warmup=2),
    # A mixture of experts (issue 57): --models qwen3moe-100m
    "qwen3moe-100m": dict(form="causal", batch=8, steps=6, warmup=2),
}
LENGTHS = {"seq2seq": {"max_input_length": 256, "max_target_length": 256}, "causal": {"max_length": 512}}
LR, SEED = 1e-3, 1


# ---------------------------------------------------------------- models and data

def model_dir(name, dropout=None):
    """A model directory under build/bench/models: config.json written by transformers, the tiny model's
    tokenizer files. t5-60m has t5-small's dimensions and vocabulary size; qwen2-100m is Qwen2-shaped (GQA,
    biases, tied embeddings) with a 32k vocabulary. The tokenizers are the tiny models' (they use only the
    first 256 / 512 ids), so the same text gives the same ids on both sides."""
    from transformers import AutoConfig, Gemma3TextConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig, T5Config
    suffix = "" if dropout is None else f"-dropout{dropout:g}"
    path = os.path.join(BENCH_DIR, "models", name + suffix)
    form = MODELS.get(name, {}).get("form", "causal" if "qwen" in name or "gemma" in name else "seq2seq")
    tiny = os.path.join(ROOT, TINY_MODELS[form])
    tiny_config = AutoConfig.from_pretrained(tiny)
    if name.startswith("tiny"):
        config = tiny_config
    elif name == "t5-60m":
        config = T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6,
                          num_heads=8, relative_attention_num_buckets=32, relative_attention_max_distance=128,
                          dropout_rate=0.1, feed_forward_proj="relu", tie_word_embeddings=True,
                          decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    elif name == "qwen2-100m":
        config = Qwen2Config(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                             num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=2048,
                             rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                             bos_token_id=tiny_config.eos_token_id, eos_token_id=tiny_config.eos_token_id)
    elif name == "qwen3-100m":
        # Qwen3-shaped: q/k norms per head, head_dim 64, GQA, untied (as Qwen3-8B), no biases.
        config = Qwen3Config(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                             num_attention_heads=12, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
                             tie_word_embeddings=False, bos_token_id=tiny_config.eos_token_id,
                             eos_token_id=tiny_config.eos_token_id)
    elif name == "gemma3-100m":
        # Gemma 3-shaped: five sliding layers (window 256) to one full, each kind with its RoPE base, q/k norms,
        # four (1 + w) norms a block, gelu-tanh MLP, scaled tied embeddings.
        config = Gemma3TextConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                  num_attention_heads=12, num_key_value_heads=2, head_dim=64,
                                  query_pre_attn_scalar=64, sliding_window=256, max_position_embeddings=2048,
                                  pad_token_id=None, bos_token_id=tiny_config.eos_token_id,
                                  eos_token_id=tiny_config.eos_token_id)
    elif name == "qwen3moe-100m":
        # Qwen3-MoE-shaped, ~110M parameters of which ~45M active per token: 8 sparse layers of 16 experts (384
        # wide), 2 per token, q/k norms, GQA, untied 32k embeddings.
        config = Qwen3MoeConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, moe_intermediate_size=384,
                                num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                num_experts=16, num_experts_per_tok=2, norm_topk_prob=True,
                                max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                bos_token_id=tiny_config.eos_token_id, eos_token_id=tiny_config.eos_token_id)
    else:
        raise ValueError(name)
    if dropout is not None:
        setattr(config, "dropout_rate" if form == "seq2seq" else "attention_dropout", dropout)
    fresh_dir(path)
    config.save_pretrained(path)
    for file in os.listdir(tiny):
        if file != "config.json":
            shutil.copy(os.path.join(tiny, file), path)
    return path


def parameter_count(path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM
    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    with torch.device("meta"):
        return sum(p.numel() for p in auto.from_config(config).parameters())


def flop_model(path):
    """What one token costs, from the model's parameters by name (meta device): per encoder / decoder (causal: per)
    real token, per encoder token (T5 cross-attention keys and values), per trained position (the LM head), and
    the attention FLOPs per query-key pair per layer and attention kind."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM
    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    m = {"encoder": 0, "decoder": 0, "cross_kv": 0}
    for name, p in model.named_parameters():  # tied weights appear once
        if "embed" in name or name.startswith("shared") or "relative_attention_bias" in name or name == "lm_head.weight":
            continue  # lookups (and the head, counted per trained position below)
        if config.is_encoder_decoder and name.startswith("encoder."):
            m["encoder"] += p.numel()
        elif config.is_encoder_decoder and "EncDecAttention" in name and (".k." in name or ".v." in name):
            m["cross_kv"] += p.numel()
        else:
            m["decoder"] += p.numel()
    if config.is_encoder_decoder:
        d, vocab, q_dim = config.d_model, config.vocab_size, config.num_heads * config.d_kv
        m["layers"], m["decoder_layers"] = config.num_layers, config.num_decoder_layers
    else:
        d, vocab = config.hidden_size, config.vocab_size
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        q_dim = config.num_attention_heads * head_dim
        m["layers"] = m["decoder_layers"] = config.num_hidden_layers
    m.update(head=d * vocab, pair=12 * q_dim, seq2seq=config.is_encoder_decoder)
    return m


def row_flops(m, input_ids, labels):
    """Useful training FLOPs of one example (forward + backward = 3 x forward, 2 per multiply-add)."""
    if m["seq2seq"]:
        n_in, n_out = len(input_ids), len(labels)
        flops = 6 * (m["encoder"] * n_in + m["cross_kv"] * n_in + m["decoder"] * n_out) + 6 * m["head"] * n_out
        return flops + m["pair"] * (m["layers"] * n_in * n_in + m["decoder_layers"] * (
            n_out * (n_out + 1) // 2 + n_out * n_in))
    n = len(input_ids)
    trained = sum(1 for x in labels[1:] if x != -100)  # the next-token targets
    return 6 * m["decoder"] * n + 6 * m["head"] * trained + m["pair"] * m["layers"] * n * (n + 1) // 2


def per_token_flops(path, form, data, lengths):
    """Useful FLOPs per target token over the whole file (for rows whose order a length-grouping sampler picks)."""
    rows, tokens = row_flops_and_tokens(path, form, data, lengths)
    return sum(rows) / sum(tokens)


def step_flops(path, form, data, lengths, batch, steps):
    """Useful FLOPs of each step: data in file order, step s trains rows (s-1)*batch .. s*batch-1 (wrapping)."""
    rows, _ = row_flops_and_tokens(path, form, data, lengths)
    return [sum(rows[(s * batch + i) % len(rows)] for i in range(batch)) for s in range(steps)]


def row_flops_and_tokens(path, form, data, lengths):
    import datasets
    from transformers import AutoTokenizer
    from hf_stack import tokenize_function
    datasets.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(path)
    ds = datasets.load_dataset("json", data_files=data, split="train")
    ds = ds.map(tokenize_function(tok, form, lengths.get("max_input_length"), lengths.get("max_target_length"),
                                  lengths.get("max_length")), batched=True, remove_columns=ds.column_names)
    m = flop_model(path)
    rows = [row_flops(m, ids, labels) for ids, labels in zip(ds["input_ids"], ds["labels"])]
    return rows, [sum(1 for x in labels if x != -100) for labels in ds["labels"]]


def gemm_peak(dtype_name, n=2048, threads=2, repeats=12):
    """FLOP/s of the best of `repeats` torch.matmul calls of n x n matrices (the machine's GEMM peak here)."""
    import time
    import torch
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    for _ in range(2):
        torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(saved)
    return 2 * n ** 3 / best


def measure_peaks(results):
    for dtype in ("fp32", "bf16"):
        peak = gemm_peak(dtype)
        results.setdefault("peak", {})[dtype] = max(peak, results.get("peak", {}).get(dtype, 0))
        results.setdefault("peak_samples", {}).setdefault(dtype, []).append(peak)
        log(f"GEMM peak {dtype}: {peak / 1e12:.3f} TFLOP/s (2048^3, 2 threads; load {load_average():.1f})")


def long_data(form, records, parts=4):
    """Records made of `parts` demo records joined: longer than any maximum length the benchmarks use."""
    path = os.path.join(BENCH_DIR, "data", f"long-{form}-{records}x{parts}.jsonl")
    if not os.path.exists(path):
        write_records(path, joined_records(form, records, parts))
    return path


def joined_records(form, records, parts):
    with open(ensure_data(form, records * parts, seed=2)) as f:
        source = [json.loads(line) for line in f]
    out = []
    for i in range(records):
        group = source[i * parts:(i + 1) * parts]
        out.append({key: " ".join(r[key] for r in group) for key in group[0]})
    return out


def write_records(path, records):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".part", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    os.replace(path + ".part", path)


# ---------------------------------------------------------------- one run of each side

def env_for(threads):
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def ours_config(path, model_path, form, data, out_dir, batch, micro, steps, lengths, data_options=None, **sections):
    """A trainer config as JSON; `sections` are merged into it (e.g. memory={...}), `data_options` into "data"."""
    config = {
        "model": {"path": model_path, "init": "random"},
        "data": {"train_files": [data], "shuffle": False, **lengths, **(data_options or {})},
        "training": {"batch_size": batch, "micro_batch_size": micro, "max_steps": steps, "seed": SEED},
        "optimizer": {"lr": LR},
        "scheduler": {"name": "linear"},
        "device": {"type": "cpu"},
        "checkpoint": {"output_dir": out_dir, "save_final": False},
        "logging": {"every_steps": 1, "tensorboard": False, "progress": "plain"},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    write_json(path, config)
    return path


STEP_LINE = re.compile(r"\] step (\d+)/\d+ loss ([\d.naif-]+)")
HF_STEP = re.compile(r"^BENCH step (\d+) loss (\S+) tokens (\d+) micro_batch (\d+)")


def run_ours(config_path, threads=None, timeout=3600):
    """Runs trainer cold (the data index removed first); returns the run and its steps [(t, tokens, loss)]."""
    with open(config_path) as f:
        config = json.load(f)
    for data in config["data"]["train_files"]:
        if os.path.exists(data + ".idx"):
            os.remove(data + ".idx")
    out_dir = config["checkpoint"]["output_dir"]
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    run = run_measured([TRAINER, "--config", config_path], env=env_for(threads), timeout=timeout)
    return run, trainer_steps(run, metrics)


def trainer_steps(run, metrics):
    """[(t, target tokens, loss)] of a trainer run: each step's time from its progress line (the run's output, rank
    0's under data parallelism), its tokens and loss from metrics.jsonl (the tokens counter's difference)."""
    times = {int(m.group(1)): t for t, line in run.lines if (m := STEP_LINE.search(line))}
    steps, previous = [], 0
    if os.path.exists(metrics):
        with open(metrics) as f:
            for record in map(json.loads, f):
                if "loss" in record and record["step"] in times:
                    steps.append((times[record["step"]], record["tokens"] - previous, record["loss"]))
                    previous = record["tokens"]
    return steps


def run_hf(spec, threads=None, preexec_fn=None, timeout=3600):
    """Runs hf_stack.py train with a fresh datasets cache; returns the run and its steps [(t, tokens, loss)]."""
    spec_path = os.path.join(spec["output_dir"] + ".spec.json")
    write_json(spec_path, spec)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(env_for(threads), HF_DATASETS_CACHE=cache, HF_HOME=cache)
        run = run_measured([PY, HF_STACK, "train", spec_path], env=env, preexec_fn=preexec_fn, timeout=timeout)
    steps = [(t, int(m.group(3)), float(m.group(2))) for t, line in run.lines if (m := HF_STEP.match(line))]
    return run, steps


def hf_spec(model, form, data, out_dir, batch, steps, lengths, **extra):
    return dict(model_dir=model, form=form, data=data, output_dir=out_dir, batch_size=batch, max_steps=steps,
                lr=LR, seed=SEED, **lengths, **extra)


def check(run, what):
    if run.returncode != 0:
        tail = "\n".join(line for _, line in run.lines[-15:])
        sys.exit(f"{what} failed (exit {run.returncode}):\n{tail}")


def flops_per_second(steps, warmup, flops):
    """Useful FLOP/s over the steps after the first `warmup` (flops[i]: step i + 1's; or {"per_token": f}: f
    per target token, when the steps' rows are not known in advance)."""
    if len(steps) <= warmup or warmup < 1:
        return None
    if isinstance(flops, dict):
        return flops["per_token"] * tokens_per_second(steps, warmup)
    return sum(flops[warmup:len(steps)]) / (steps[-1][0] - steps[warmup - 1][0])


def tokens_per_second(steps, warmup):
    """Target tokens per second over the steps after the first `warmup`."""
    if len(steps) <= warmup or warmup < 1:
        return None
    tokens = sum(tokens for _, tokens, _ in steps[warmup:])
    return tokens / (steps[-1][0] - steps[warmup - 1][0])


# ---------------------------------------------------------------- 1. throughput, peak RSS, time to first step

def best_options(form, compile_ok, grouped=True):
    """The "best options" row: each side's fastest data path on this stack. HF: group_by_length, and for causal
    models DataCollatorWithFlattening (padding-free rows with position ids; nothing like it exists for
    seq2seq), torch_compile=True when the probe compiled and ran. trainer: data.group_by_length and
    data.packing=true (T5 too, now that attention is computed per example in packed rows: docs/packing.md); the
    chunked loss is the default on both rows. grouped=False ("best-file-order"): the same without group_by_length on either side, so
    that both train the same rows at every step (a short run's length-grouped batches differ per sampler)."""
    causal = form == "causal"
    ours = {"group_by_length": grouped, "packing": True}
    hf = {"group_by_length": grouped, "flatten": causal, "torch_compile": bool(compile_ok)}
    return ours, hf


def compile_probe(path, form, data, batch, threads, timeout):
    """Whether HF's torch_compile=True trains on this CPU: 3 steps of the best-options side under `timeout`
    seconds. Returns (ok, note)."""
    work = fresh_dir(os.path.join(BENCH_DIR, "runs", "throughput", "compile-probe"))
    spec = hf_spec(path, form, data, os.path.join(work, "hf"), batch, 3, LENGTHS[form],
                   group_by_length=True, flatten=form == "causal", torch_compile=True)
    run, steps = run_hf(spec, threads, timeout=timeout)
    if run.returncode == 0 and len(steps) == 3:
        return True, f"torch_compile=True trained 3 steps in {run.seconds:.0f} s"
    if run.returncode in (-9, 137) and run.seconds >= timeout - 1:
        return False, f"torch_compile=True did not finish 3 steps within {timeout} s (compiling); left off"
    error = next((line for _, line in reversed(run.lines) if "Error" in line), f"exit {run.returncode}")
    return False, f"torch_compile=True failed ({error[:160]}); left off"


def throughput(models, repeats, threads, scale_steps=1.0, precisions=("fp32",), variant="users",
               compile_timeout=300):
    rows = []
    for name, precision in [(n, p) for n in models for p in precisions]:
        m = MODELS[name]
        steps = max(m["warmup"] + 2, round(m["steps"] * scale_steps)) + m["warmup"]
        path = model_dir(name)
        data = ensure_data(m["form"], max(4096, steps * m["batch"]))
        work = fresh_dir(os.path.join(BENCH_DIR, "runs", "throughput", f"{name}-{precision}-{variant}"))
        ours_data, hf_options, compile_note = {}, {}, None
        if variant.startswith("best"):
            compile_ok, compile_note = compile_probe(path, m["form"], data, m["batch"], threads, compile_timeout) \
                if compile_timeout > 0 else (False, "torch_compile not tried (--compile-timeout 0)")
            log(f"{name} {precision}: {compile_note}")
            ours_data, hf_options = best_options(m["form"], compile_ok, grouped=variant == "best")
        elif variant == "users-packed":  # the same examples in every step as padded rows: the same weights
            ours_data = {"packing": True}
        config = ours_config(os.path.join(work, "ours.json"), path, m["form"], data, os.path.join(work, "ours"),
                             m["batch"], m["batch"], steps, LENGTHS[m["form"]], precision={"mode": precision},
                             data_options=ours_data)
        spec = hf_spec(path, m["form"], data, os.path.join(work, "hf"), m["batch"], steps, LENGTHS[m["form"]],
                       bf16=precision == "bf16-mixed", **hf_options)
        flops = step_flops(path, m["form"], data, LENGTHS[m["form"]], m["batch"], steps)
        if variant == "best":  # the order is the sampler's: FLOPs per target token of the whole file instead
            flops = {"per_token": per_token_flops(path, m["form"], data, LENGTHS[m["form"]])}
        result = {"model": name, "precision": precision, "params": parameter_count(path), "batch": m["batch"],
                  "steps": steps, "warmup": m["warmup"], "ours": [], "hf": [], "load": [], "variant": variant,
                  "ours_options": ours_data, "hf_options": hf_options, "compile_note": compile_note,
                  "flops": flops}
        for r in range(repeats):
            order = ["ours", "hf"] if r % 2 == 0 else ["hf", "ours"]
            for side in order:
                result["load"].append(load_average())
                run, per_step = run_ours(config, threads) if side == "ours" else run_hf(spec, threads)
                check(run, f"{side} on {name}")
                first = per_step[0][0] if per_step else None
                sample = {"tokens_per_s": tokens_per_second(per_step, m["warmup"]),
                          "flops_per_s": flops_per_second(per_step, m["warmup"], result["flops"]),
                          "peak_rss": run.peak_rss,
                          "first_step_s": first, "wall_s": run.seconds, "tokens": [s[1] for s in per_step],
                          "losses": [s[2] for s in per_step]}
                result[side].append(sample)
                log(f"{name} {precision} rep {r + 1}/{repeats} {side}: {sample['tokens_per_s']:.0f} tokens/s, "
                    f"{sample['flops_per_s'] / 1e9:.1f} useful GFLOP/s, "
                    f"peak RSS {run.peak_rss / MIB:.0f} MiB, first step {first:.1f} s, "
                    f"loss {sample['losses'][0]:.3f} -> {sample['losses'][-1]:.3f}")
        rows.append(result)
    return rows


def summarize_throughput(result):
    s = {}
    for side in ("ours", "hf"):
        samples = result[side]
        s[side] = {key: median([x[key] for x in samples])
                   for key in ("tokens_per_s", "flops_per_s", "peak_rss", "first_step_s")}
        s[side]["loss_first"] = median([x["losses"][0] for x in samples])
        s[side]["loss_last"] = median([x["losses"][-1] for x in samples])
        s[side]["tokens"] = samples[0]["tokens"]
    s["same_tokens"] = all(x["tokens"] == s["ours"]["tokens"] for side in ("ours", "hf") for x in result[side])
    s["total_tokens"] = {side: median([sum(x["tokens"]) for x in result[side]]) for side in ("ours", "hf")}
    return s


def variant_label(result):
    """What each side ran with, for the table's first column."""
    if result.get("variant", "users") == "users":
        return "ours defaults vs HF as users run it (padded)"
    if result["variant"] == "users-packed":
        return "ours data.packing vs HF as users run it (padded)"
    ours = ", ".join(k for k, v in result["ours_options"].items() if v) or "defaults"
    hf = ", ".join(k for k, v in result["hf_options"].items() if v)
    return f"{result['variant']}: ours {ours} vs HF {hf}"


def peak_of(result, peaks):
    """The GEMM peak a row's utilisation is measured against: bf16 for bf16-mixed, else fp32."""
    return peaks["bf16" if result["precision"].startswith("bf16") else "fp32"]


def throughput_table(results, peaks):
    rows = []
    for result in results:
        s = summarize_throughput(result)
        o, h = s["ours"], s["hf"]
        peak = peak_of(result, peaks)
        same = "yes" if s["same_tokens"] else "NO"
        if result.get("variant", "users") == "best":  # each side's own length-grouped order
            t = s["total_tokens"]
            same = f"own order ({t['ours']:,.0f} / {t['hf']:,.0f} tokens)"
        rows.append([
            f"{result['model']} ({result['params'] / 1e6:.1f}M)", variant_label(result), result["precision"],
            f"{result['batch']} x {result['steps']} ({result['warmup']} warm-up)",
            f"{o['tokens_per_s']:,.0f}", f"{h['tokens_per_s']:,.0f}", ratio(o["tokens_per_s"], h["tokens_per_s"]),
            f"{o['flops_per_s'] / 1e9:,.1f} ({100 * o['flops_per_s'] / peak:.0f}%)",
            f"{h['flops_per_s'] / 1e9:,.1f} ({100 * h['flops_per_s'] / peak:.0f}%)",
            f"{o['peak_rss'] / MIB:,.0f}", f"{h['peak_rss'] / MIB:,.0f}", ratio(o["peak_rss"], h["peak_rss"]),
            f"{o['first_step_s']:.1f}", f"{h['first_step_s']:.1f}",
            f"{o['loss_first']:.2f} / {h['loss_first']:.2f}", f"{o['loss_last']:.2f} / {h['loss_last']:.2f}",
            same])
    return table(["model", "sides", "precision", "batch x steps", "ours tok/s", "HF tok/s", "ratio",
                  "ours useful GFLOP/s (of peak)", "HF useful GFLOP/s (of peak)", "ours RSS MiB", "HF RSS MiB",
                  "ratio", "ours 1st step s", "HF 1st step s", "loss step 1 ours / HF", "loss last ours / HF",
                  "same tokens every step"], rows)


def compile_notes(results):
    notes = [f"{r['model']} {r['precision']}: {r['compile_note']}" for r in results if r.get("compile_note")]
    return ("HF torch_compile probe (3 steps, best-options side): " + "; ".join(notes) + ".") if notes else ""


# ---------------------------------------------------------------- the address-space cap for the Python side

def python_address_space(spec, threads):
    """The virtual size of the HF process when training is about to start, less its weights: imports, the
    tokenizer and data, thread stacks and malloc arenas. RLIMIT_AS counts all of it, and trainer's
    memory.limit none of it (but the weights), so the cap for the Python side sits on top of it."""
    calibration = dict(spec, output_dir=spec["output_dir"] + "-calibration", stop_at_train_begin=True)
    run, _ = run_hf(calibration, threads)
    check(run, "the HF calibration run")
    line = run.first(lambda text: text.startswith("BENCH address_space"))[1]
    return int(line.split()[2])


def address_space_limit(limit_bytes):
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    return apply


# ---------------------------------------------------------------- 2. the largest micro-batch under a cap

def largest_micro_batch(args):
    name, form = args.cap_model, MODELS[args.cap_model]["form"]
    path = model_dir(name)
    cap = int(args.cap_gib * GIB)
    length = args.cap_length
    lengths = ({"max_input_length": length, "max_target_length": length} if form == "seq2seq"
               else {"max_length": length})
    data = long_data(form, 4 * args.cap_batch)
    work = fresh_dir(os.path.join(BENCH_DIR, "runs", "cap", name))

    # trainer: micro_batch_size=auto under memory.limit, no safety margin (HF keeps none either).
    config = ours_config(os.path.join(work, "ours.json"), path, form, data, os.path.join(work, "ours"),
                         args.cap_batch, "auto", 2, lengths, memory={"limit": cap, "auto_safety_margin": 0.0})
    run, steps = run_ours(config, args.threads)
    check(run, "trainer micro_batch_size=auto")
    ours = int(re.search(r"examples; micro-batch (\d+)", run.text()).group(1))
    truncated = re.search(r"records (\d+) read, bad records skipped \d+, truncated (\d+)", run.text())
    all_cut = truncated and truncated.group(1) == truncated.group(2)
    adaptations = re.search(r"micro-batch adaptations: (\d+)", run.text()).group(1)
    log(f"cap: trainer probed micro-batch {ours} under {args.cap_gib} GiB; adaptations in training {adaptations}")
    # ... and one more does not fit: a fixed micro-batch of ours + 1, failing instead of adapting.
    above = ours_config(os.path.join(work, "above.json"), path, form, data, os.path.join(work, "above"),
                        ours + 1, ours + 1, 1, lengths, memory={"limit": cap, "on_oom": "fail"})
    above_run, _ = run_ours(above, args.threads)
    log(f"cap: trainer with micro-batch {ours + 1} exits {above_run.returncode} (4 = out of memory)")

    # HF: auto_find_batch_size from the same starting size, under RLIMIT_AS = its baseline + cap.
    spec = hf_spec(path, form, data, os.path.join(work, "hf"), args.cap_batch, 2, lengths, auto_find_batch_size=True)
    baseline = python_address_space(spec, args.threads)
    limit = baseline + cap
    hf_run, hf_steps = run_hf(spec, args.threads, preexec_fn=address_space_limit(limit))
    tried = [int(m.group(1)) for _, line in hf_run.lines if (m := re.match(r"BENCH begin micro_batch (\d+)", line))]
    hf_ok = hf_run.returncode == 0 and any(line == "BENCH done" for _, line in hf_run.lines)
    log(f"cap: HF auto_find_batch_size tried {tried}; finished: {hf_ok} (exit {hf_run.returncode})")
    if not hf_ok:
        log("\n".join(line for _, line in hf_run.lines[-10:]))
    # auto_find_batch_size retries in a process that has already failed (fragmented heap, x0.9 steps): the
    # largest fixed per-device batch a fresh process can train, by bisection, says what HF could really do.
    fresh = hf_fresh_largest(dict(spec, auto_find_batch_size=False), limit, tried[-1] if hf_ok else 0,
                             args.cap_batch + 1, args.threads)
    log(f"cap: HF largest fixed batch in a fresh process: {fresh}")
    return {"model": name, "params": parameter_count(path), "cap": cap, "length": length, "start": args.cap_batch,
            "ours": ours, "ours_all_cut": bool(all_cut), "ours_adaptations": int(adaptations),
            "above_rc": above_run.returncode, "hf": tried[-1] if hf_ok and tried else 0, "hf_tried": tried,
            "hf_fresh": fresh, "ours_rss": run.peak_rss, "hf_rss": hf_run.peak_rss,
            "hf_ok": hf_ok, "baseline_vm": baseline, "rlimit_as": limit}


def hf_fresh_largest(spec, limit, good, bad, threads):
    """Bisects the per-device batch between `good` (fits, or 0) and `bad` (does not), one fresh process each."""
    while bad - good > 1:
        mid = (good + bad) // 2
        run, _ = run_hf(dict(spec, batch_size=mid), threads, preexec_fn=address_space_limit(limit))
        ok = run.returncode == 0 and any(line == "BENCH done" for _, line in run.lines)
        log(f"cap: HF fixed batch {mid} in a fresh process: {'fits' if ok else 'out of memory'}")
        good, bad = (mid, bad) if ok else (good, mid)
    return good


def cap_table(c):
    form_lengths = f"every example cut to {c['length']} tokens" + (" (input and target)" if "t5" in c["model"] else "")
    rows = [[f"{c['model']} ({c['params'] / 1e6:.1f}M), {form_lengths}", f"{c['cap'] / GIB:g} GiB",
             f"{c['ours']}" + (f" ({c['ours'] + 1} exits {c['above_rc']}"
                               + (": out of memory)" if c['above_rc'] == 4 else ": did NOT fail)")),
             f"{c['hf']} (tried {', '.join(map(str, c['hf_tried']))})" if c["hf_ok"] else
             f"none (tried {', '.join(map(str, c['hf_tried']))}; did not finish)",
             ratio(c["ours"], c["hf"]), f"{c['hf_fresh']}", ratio(c["ours"], c["hf_fresh"]),
             f"{c['ours_rss'] / MIB:,.0f} / {c['hf_rss'] / MIB:,.0f}"]]
    return table(["model, data", "cap", "ours: micro_batch_size=auto", "HF: auto_find_batch_size", "ratio",
                  "HF: largest fixed batch, fresh process", "ratio", "peak RSS MiB ours / HF auto"], rows)


# ---------------------------------------------------------------- 3. out-of-memory recovery mid-run

def oom_recovery(args):
    """Short records, then one batch of long ones at step --oom-step, then short ones again. The cap sits
    half way between the peak before that batch and its peak (measured on an unconstrained trainer run), so
    the initial micro-batch fails there. trainer adapts; HF crashes and is restarted as a user would: from its
    last checkpoint, with half the per-device batch and 2 accumulation steps (the same effective batch)."""
    batch, steps, at, every = 16, args.oom_steps, args.oom_step, args.oom_save_every
    form = "seq2seq"
    path = model_dir("tiny-t5", dropout=0.0)  # without dropout a different split must give the same weights
    short = [json.loads(line) for line in open(ensure_data(form, steps * batch, seed=3))]
    records = short[:(at - 1) * batch] + joined_records(form, batch, 4) + short[(at - 1) * batch:(steps - 1) * batch]
    data = os.path.join(BENCH_DIR, "data", f"oom-{form}-{steps}x{batch}-long-at-{at}.jsonl")
    write_records(data, records)
    lengths = {"max_input_length": 512, "max_target_length": 512}
    work = fresh_dir(os.path.join(BENCH_DIR, "runs", "oom"))

    def ours(tag, **memory):
        config = ours_config(os.path.join(work, f"ours-{tag}.json"), path, form, data, os.path.join(work, f"ours-{tag}"),
                             batch, batch, steps, lengths, memory=memory,
                             checkpoint={"every_steps": every, "save_final": True})
        run, per_step = run_ours(config, args.threads)
        check(run, f"trainer ({tag})")
        return run, per_step

    free_run, free_steps = ours("free")
    peaks = [json.loads(line) for line in open(os.path.join(work, "ours-free", "metrics.jsonl"))]
    before, during = peaks[at - 2]["memory_peak"], peaks[at - 1]["memory_peak"]
    cap = (before + during) // 2
    log(f"oom: tensor peak {before / MIB:.1f} MiB before step {at}, {during / MIB:.1f} MiB at it; cap {cap / MIB:.1f} MiB")
    capped_run, capped_steps = ours("capped", limit=cap)
    adaptations = re.findall(r"step (\d+): (\d+) -> (\d+) \(([^)]*)\)", capped_run.text())
    ours_result = {
        "free_s": free_run.seconds, "capped_s": capped_run.seconds, "adaptations": adaptations,
        "steps": len(capped_steps), "samples_lost": sum(t for _, t, _ in free_steps) - sum(t for _, t, _ in capped_steps),
        "same_tokens": [t for _, t, _ in free_steps] == [t for _, t, _ in capped_steps],
        "weights_diff": max_weight_diff(os.path.join(work, "ours-free", "final"), os.path.join(work, "ours-capped", "final")),
        "loss": (free_steps[-1][2], capped_steps[-1][2])}
    log(f"oom: trainer {ours_result}")

    def hf_spec_for(tag, **extra):
        return hf_spec(path, form, data, os.path.join(work, f"hf-{tag}"), extra.pop("batch", batch), steps, lengths,
                       save_steps=every, save_final=True, **extra)

    def hf(tag, preexec_fn=None, **extra):
        return run_hf(hf_spec_for(tag, **extra), args.threads, preexec_fn=preexec_fn)

    baseline = python_address_space(hf_spec_for("free"), args.threads)
    limit = baseline + cap

    free_hf, free_hf_steps = hf("free")
    check(free_hf, "HF (no cap)")
    # The first attempt under the cap, then restarts from the newest checkpoint with the per-device batch
    # halved and the accumulation doubled, until one finishes.
    attempts, micro, accumulation, total_s, redone = [], batch, 1, 0.0, 0
    for attempt in range(4):
        run, per_step = hf("capped", address_space_limit(limit), batch=micro, gradient_accumulation_steps=accumulation,
                           resume=attempt > 0)
        total_s += run.seconds
        done = any(line == "BENCH done" for _, line in run.lines)
        saved = [int(line.split()[-1]) for _, line in run.lines if line.startswith("BENCH saved")]
        last_step = max(hf_step_numbers(run), default=None)
        attempts.append({"micro": micro, "accumulation": accumulation, "seconds": run.seconds, "finished": done,
                         "last_step": last_step, "saved": saved, "rc": run.returncode,
                         "error": next((line for _, line in reversed(run.lines) if "Error" in line), "")})
        log(f"oom: HF attempt {attempt + 1}: {attempts[-1]}")
        if done:
            break
        resumed_from = latest_checkpoint(os.path.join(work, "hf-capped"))
        if last_step is not None:
            redone += (last_step - resumed_from) * batch
        micro, accumulation = micro // 2, accumulation * 2
    hf_result = {"free_s": free_hf.seconds, "capped_s": total_s, "attempts": attempts, "samples_redone": redone,
                 "finished": attempts[-1]["finished"]}
    if hf_result["finished"]:
        hf_result["weights_diff"] = max_weight_diff(os.path.join(work, "hf-free", "final"),
                                                    os.path.join(work, "hf-capped", "final"))
    # And with auto_find_batch_size=True from the start, under the same cap.
    auto_run, _ = hf("auto", address_space_limit(limit), auto_find_batch_size=True)
    begins = [int(m.group(1)) for _, line in auto_run.lines if (m := re.match(r"BENCH begin micro_batch (\d+)", line))]
    hf_result["auto"] = {"seconds": auto_run.seconds, "micro_batches": begins,
                         "samples_repeated": hf_restart_samples(auto_run), "rc": auto_run.returncode}
    log(f"oom: HF {hf_result}")
    return {"cap": cap, "at": at, "steps": steps, "batch": batch, "every": every, "ours": ours_result, "hf": hf_result,
            "baseline_vm": baseline}


def hf_step_numbers(run):
    return [int(m.group(1)) for _, line in run.lines if (m := HF_STEP.match(line))]


def hf_restart_samples(run):
    """Samples HF had trained before each auto_find_batch_size restart (they are trained again)."""
    samples, micro, steps = 0, 0, 0
    for _, line in run.lines:
        if m := re.match(r"BENCH begin micro_batch (\d+)", line):
            samples += micro * steps
            micro, steps = int(m.group(1)), 0
        elif m := HF_STEP.match(line):
            steps = int(m.group(1))
    return samples


def latest_checkpoint(directory):
    steps = [int(n.split("-")[1]) for n in os.listdir(directory) if re.fullmatch(r"checkpoint-\d+", n)] \
        if os.path.isdir(directory) else []
    return max(steps, default=0)


def max_weight_diff(a, b):
    from safetensors.numpy import load_file
    wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    return max(float(abs(wa[k] - wb[k]).max()) for k in wa if k in wb)


def oom_table(o):
    ours, hf = o["ours"], o["hf"]
    adapt = "; ".join(f"step {s}: {a} -> {b}" for s, a, b, _ in ours["adaptations"]) or "none"
    rows = [["ours", adapt, f"{ours['capped_s']:.1f} s vs {ours['free_s']:.1f} s uncapped "
             f"(+{ours['capped_s'] - ours['free_s']:.1f} s)",
             f"{ours['samples_lost']} tokens" + (", every step's tokens as uncapped" if ours["same_tokens"] else ""),
             f"{ours['weights_diff']:.1e}", f"{ours['steps']} of {o['steps']}"]]
    attempts = "; ".join(f"{a['micro']} x {a['accumulation']}: "
                         + ("finished" if a["finished"] else f"died after step {a['last_step'] or 0} (exit {a['rc']})")
                         for a in hf["attempts"])
    rows.append(["HF, restarted from its last checkpoint", attempts,
                 f"{hf['capped_s']:.1f} s vs {hf['free_s']:.1f} s uncapped (+{hf['capped_s'] - hf['free_s']:.1f} s)",
                 f"{hf['samples_redone']} samples trained again", f"{hf.get('weights_diff', float('nan')):.1e}",
                 "finished" if hf["finished"] else "did not finish"])
    auto = hf["auto"]
    rows.append(["HF, auto_find_batch_size=True", "micro-batch " + " -> ".join(map(str, auto["micro_batches"])),
                 f"{auto['seconds']:.1f} s", f"{auto['samples_repeated']} samples trained again (restart from step 0; "
                 f"effective batch {auto['micro_batches'][-1] if auto['micro_batches'] else '?'})", "", f"exit {auto['rc']}"])
    return table(["side", "adaptation", "wall time", "lost / redone", "max |w - w uncapped|", "steps"], rows)


# ---------------------------------------------------------------- main

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny T5 only, fewer steps, one repetition")
    parser.add_argument("--all", action="store_true", help="also the loader benchmark and the goals table")
    parser.add_argument("--parts", nargs="+", default=["throughput", "cap", "oom"],
                        choices=["throughput", "cap", "oom", "loader"])
    parser.add_argument("--models", nargs="+", default=["tiny-t5", "t5-60m", "qwen2-100m"], choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per side and model")
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply the measured steps per model")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for both sides (default: torch's choice)")
    parser.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16-mixed"],
                        help="throughput rows in each precision (bf16-mixed: HF bf16=True)")
    parser.add_argument("--hf-variant", nargs="+", default=["users"],
                        choices=["users", "users-packed", "best", "best-file-order"],
                        help="throughput rows against HF as users run it (padded, file order) and/or with its best "
                             "options (group_by_length; causal: DataCollatorWithFlattening; torch_compile if it "
                             "runs), trainer then with data.group_by_length and data.packing; best-file-order: the "
                             "same without group_by_length (equal rows every step); users-packed: HF as users run it "
                             "against trainer with data.packing alone (the same weights as padded rows)")
    parser.add_argument("--compile-timeout", type=int, default=300,
                        help="seconds HF's torch_compile probe may take per best-options row (0: do not try)")
    parser.add_argument("--cap-model", default="t5-60m", choices=list(MODELS))
    parser.add_argument("--cap-gib", type=float, default=3.0)
    parser.add_argument("--cap-length", type=int, default=128)
    parser.add_argument("--cap-batch", type=int, default=64, help="effective batch / HF's starting batch size")
    parser.add_argument("--oom-steps", type=int, default=12)
    parser.add_argument("--oom-step", type=int, default=7, help="the step whose batch is long")
    parser.add_argument("--oom-save-every", type=int, default=4)
    parser.add_argument("--loader-records", type=int, nargs="+", default=[100000, 1000000])
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()
    if args.quick:
        args.models, args.repeats, args.steps_scale = ["tiny-t5"], 1, 0.5
        args.cap_model, args.cap_gib, args.cap_length, args.cap_batch = "tiny-t5", 0.5, 256, 64
        args.loader_records = [10000, 100000]
    if args.all:
        args.parts = ["throughput", "cap", "oom", "loader"]
    if not os.access(TRAINER, os.X_OK):
        sys.exit(f"{TRAINER} is missing: build it first (see README)")

    results = {"machine": machine_notes(), "command": " ".join(["scripts/bench/vs_hf.py", *sys.argv[1:]])}
    log(results["machine"])
    if "throughput" in args.parts:
        measure_peaks(results)
        results["throughput"] = [row for variant in args.hf_variant for row in throughput(
            args.models, args.repeats, args.threads, args.steps_scale, args.precision, variant, args.compile_timeout)]
        measure_peaks(results)
    if "cap" in args.parts:
        results["cap"] = largest_micro_batch(args)
    if "oom" in args.parts:
        results["oom"] = oom_recovery(args)
    if "loader" in args.parts:
        import loader
        results["loader"] = loader.benchmark(args.loader_records, ["seq2seq", "causal"], workers=2)
    results["load_after"] = load_average()
    if args.json:
        write_json(args.json, results)
    print(report(results, args))


def report(results, args):
    out = [f"Machine: {results['machine']}; load average at the end {results['load_after']:.2f}.",
           f"Command: `{results['command']}`", ""]
    if "throughput" in results:
        loads = [x for r in results["throughput"] for x in r["load"]]
        peaks = results["peak"]
        samples = "; ".join(f"{d} " + ", ".join(f"{x / 1e12:.3f}" for x in v) for d, v in results["peak_samples"].items())
        out += ["### Training throughput, utilisation, peak RSS, time to first step (CPU)", "",
                throughput_table(results["throughput"], peaks), "",
                f"Medians of {args.repeats} alternating runs per side; 1-minute load average at the start of "
                f"the runs {min(loads):.1f} to {max(loads):.1f}. tok/s = target tokens per second after the "
                "warm-up steps; the losses are from random initialisations of the same config.json on each side. "
                f"Useful GFLOP/s as in the script's docstring, of the GEMM peak measured in this run (2048^3, "
                f"2 threads, best of start and end): fp32 {peaks['fp32'] / 1e12:.3f} TFLOP/s, bf16 "
                f"{peaks['bf16'] / 1e12:.3f} TFLOP/s (samples in TFLOP/s: {samples}).", compile_notes(results["throughput"]),
                ""]
    if "cap" in results:
        c = results["cap"]
        out += ["### Largest micro-batch under a memory cap", "", cap_table(c), "",
                f"ours: memory.limit={c['cap'] / GIB:g}GiB (a hard cap on tensor bytes), micro_batch_size=auto, "
                f"batch_size {c['start']}, memory.auto_safety_margin=0. HF: RLIMIT_AS = {c['baseline_vm'] / GIB:.2f} GiB "
                f"+ the cap = {c['rlimit_as'] / GIB:.2f} GiB, set by a preexec_fn; the baseline is the virtual size "
                "of the same HF process at on_train_begin (imports, tokenizer, data, threads, malloc arenas) "
                "less its weights (which memory.limit counts), from a calibration run. RLIMIT_AS, not a cgroup: a cgroup's memory limit ends in the kernel's OOM "
                "killer (SIGKILL), which auto_find_batch_size cannot catch; under RLIMIT_AS malloc fails and "
                "torch raises `DefaultCPUAllocator: can't allocate memory`, which accelerate's "
                "find_executable_batch_size catches (x0.9 each time). Caveat: RLIMIT_AS counts virtual memory "
                "(mapped libraries, thread stacks, malloc arenas), so the calibration is approximate. HF's "
                "auto_find_batch_size changes the effective batch (no accumulation added); ours keeps it.", ""]
    if "oom" in results:
        o = results["oom"]
        out += ["### Out-of-memory recovery mid-run", "", oom_table(o), "",
                f"tiny T5 without dropout, batch {o['batch']}, {o['steps']} steps, step {o['at']} is a batch of "
                f"long examples (4 recipes each); checkpoints every {o['every']} steps on both sides. Cap "
                f"{o['cap'] / MIB:.0f} MiB of tensors (ours: memory.limit; HF: RLIMIT_AS = its "
                f"baseline {o['baseline_vm'] / GIB:.2f} GiB + the cap), half way between trainer's peak before that step and "
                "at it. Lost = target tokens of the uncapped run that the capped run did not train.", ""]
    if "loader" in results:
        import loader
        out += ["### Loader: JSONL -> padded batches", "", loader.table(results["loader"]), ""]
    if args.all:
        out += ["### Against the goals", "", goals_table(results), ""]
    return "\n".join(out)


def goals_table(results):
    rows = []
    for r in results.get("throughput", []):
        s = summarize_throughput(r)
        x = s["ours"]["tokens_per_s"] / s["hf"]["tokens_per_s"]
        goal, against = (1.5, "as users run it") if r.get("variant", "users").startswith("users") \
            else (1.2, "with its best options")
        rows.append([f"tokens/s, {r['model']}, {r['precision']}", f">= {goal}x HF {against}", f"{x:.2f}x",
                     verdict(x >= goal, f"{x / goal:.2f} of goal")])
    for r in results.get("throughput", []):
        s = summarize_throughput(r)
        u, goal = s["ours"]["flops_per_s"] / peak_of(r, results["peak"]), 0.5 if r["precision"] != "fp32" else 0.8
        rows.append([f"utilisation, {r['model']}, {r['precision']}, {r.get('variant', 'users')}", f">= {goal:.0%} of the GEMM peak", f"{u:.0%}",
                     verdict(u >= goal, f"{u / goal:.2f} of goal")])
    for r in results.get("throughput", []):
        s = summarize_throughput(r)
        x = s["ours"]["peak_rss"] / s["hf"]["peak_rss"]
        rows.append([f"peak RSS, {r['model']}", "<= 0.7x HF", f"{x:.2f}x", verdict(x <= 0.7, f"{x / 0.7:.2f}x the goal")])
    if "cap" in results:
        c = results["cap"]
        x = c["ours"] / c["hf"] if c["hf"] else float("inf")
        rows.append([f"largest micro-batch, {c['model']} under {c['cap'] / GIB:g} GiB", ">= 1.5x HF",
                     f"{c['ours']} vs {c['hf']} = {x:.2f}x", verdict(x >= 1.5, f"{x / 1.5:.2f} of goal")])
    if "oom" in results:
        o = results["oom"]
        lost = o["ours"]["samples_lost"]
        rows.append(["samples lost on OOM", "0", f"ours {lost}; HF {o['hf']['samples_redone']} redone",
                     verdict(lost == 0 and o["ours"]["steps"] == o["steps"], "")])
    for r in results.get("loader", []):
        if r["side"] != "trainer":
            continue
        hf = next(x for x in results["loader"] if x["side"] != "trainer" and x["form"] == r["form"]
                  and x["records"] == r["records"])
        x = hf["seconds"] / r["seconds"]
        rate = r["examples"] / r["seconds"]
        rows.append([f"loader, {r['form']}, {r['records']:,} records", ">= 3x HF and >= 100k rec/s",
                     f"{x:.1f}x, {rate / 1000:.0f}k rec/s",
                     verdict(x >= 3 and rate >= 100000, f"{min(x / 3, rate / 100000):.2f} of goal")])
    return table(["what", "goal", "now", "met?"], rows)


def verdict(ok, how_far):
    return "yes" if ok else f"no ({how_far})"


if __name__ == "__main__":
    main()
