#!/usr/bin/env python3
"""The card-size half of scripts/gpu-check (`--full OUTDIR`, issue 36): after the build and the `gpu` tests, the
shipped jobs at their real shapes under their cards' memory, and trainer against transformers' Trainer on the same
card. Six parts, in order, each under its own time limit (a failure or a timeout in one does not stop the next):

  1  FLAN-T5-XL (configs/t5xl.json) under 32 GiB: the micro-batch the probe chose, adaptations, peak memory against
     `trainer plan`'s figure for that micro-batch, tokens/s, model FLOP utilisation, the time to write a checkpoint
  2  Qwen2.5-7B LoRA (configs/qwen2.5-7b-lora.json) under 24 GiB and QLoRA (configs/qwen2.5-7b-qlora.json) under
     16 GiB, 2048 tokens: the same figures (the 7B base is written once by trainer, random weights, and loaded by
     both, as users load a pretrained model; its write time is a figure too)
  3  out-of-memory at scale: the 7B LoRA job with one batch of 2048-token records in the middle, first without a
     cap, then under a cap half way between its peak before that batch and at it: the capped run must shrink the
     micro-batch at that step and end at the uncapped run's loss, having trained the same tokens
  4  trainer (data.packing) against transformers' Trainer (PEFT is not needed: full fine-tunes), bf16, on the same
     random Qwen2 of ~0.5B and T5 of ~250M and the same examples: HF as users run it (padded) and with its best
     options (causal: padding-free DataCollatorWithFlattening and SDPA; T5: group_by_length); target tokens/s,
     peak memory, both ratios (scripts/bench/vs_hf.py and hf_stack.py run both sides)
  5  vit-base-flowers-lora.json under 8 GiB and clip-cars.json under 16 GiB at their real shapes: images/s, peak
     memory against the plan
  6  evaluation by generation (issue 35) against Seq2SeqTrainer.predict with predict_with_generate on the same
     random t5-60m and qwen2-100m and the same prompts, bf16 on the card, greedy and 4 beams: examples/s of each
     side, the ratio and how many answers agree (scripts/bench/generate_eval.py; needs trainer_parity, which
     scripts/gpu-check builds when part 6 is asked for)

Every model is random (config.json written here, no weights file) and every data set is generated here
(scripts/make_demo_data.py records joined to realistic lengths; data/demo/images for part 5). Every figure is read
from trainer's own output (metrics.jsonl, its log lines, `trainer plan`) or, for HF, from hf_stack.py's lines.

--rehearse runs the same script with tiny shapes on the CPU (the CPU build given by --build-dir), so that it is
known to work before card time is spent (tests/parity/test_gpu_full.py). The time limits are in PARTS below; a
call's whole budget (--deadline, a Unix time) caps each part's limit so the table is always written in time.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import gpu_check_report  # noqa: E402  (the card's name and bf16 peak, the gpu tests, human_bytes)
import hf_kit  # noqa: E402
from common import ensure_data, run_measured  # noqa: E402

GIB = 2**30

# Each part's time limit on a card, in seconds, and why. The first run (2026-11-27, an H100, docs/benchmarks.md "On a
# card"): trainer alone built in 94 s, the 7B base in 27 s, part 4's Qwen2 rows in about 60 s; parts 1 and 2 ran out
# of their limits on dropout masks made by int64 tensor ops (a CUDA kernel since), so their limits are still estimates.
PART_LIMITS_S = {
    1: 150,  # 3B random init on the card (seconds), probe (~8 sizes, ~1-5 s each), 8 steps of 128 examples, an 11 GB checkpoint
    2: 200,  # the 7B base written once (27 s), LoRA and QLoRA 6 steps of 16 x <=2048 tokens each (~5-8 s a step) + probes
    3: 90,   # two 7B LoRA runs of 6 short steps, one of them long, loading the base from the page cache
    4: 180,  # per model a trainer run (~20 s with its checkpoint) and two HF runs (~10 s of imports, 12 steps each)
    5: 90,   # two image runs of 8 steps: JPEG decoding on the CPU sets the pace
    6: 120,  # two models x two decodings x two sides x 2 rounds, each a process (HF's with ~10 s of imports)
}
# The rehearsal's limits (tiny shapes on 2 CPU cores): upper bounds that catch a hang, not timings: unloaded, the parts
# take about a tenth of them, but a CI machine shared with other jobs must not fail the rehearsal for being slow.
REHEARSE_LIMITS_S = {1: 120, 2: 150, 3: 120, 4: 300, 5: 120, 6: 240}
RESERVE_S = 15  # what the table and the files need at the end of a call


# ---------------------------------------------------------------- shapes: the real ones and the rehearsal's

def t5_config(d_model, d_ff, heads, layers, vocab=32128, buckets=32, distance=128, tied=False):
    return {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": vocab,
            "d_model": d_model, "d_ff": d_ff, "d_kv": 64 if d_model >= 512 else 16, "num_heads": heads,
            "num_layers": layers, "num_decoder_layers": layers, "feed_forward_proj": "gated-gelu",
            "dense_act_fn": "gelu_new", "is_gated_act": True, "dropout_rate": 0.1, "layer_norm_epsilon": 1e-6,
            "relative_attention_num_buckets": buckets, "relative_attention_max_distance": distance,
            "tie_word_embeddings": tied, "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1,
            "is_encoder_decoder": True, "initializer_factor": 1.0}


def qwen2_config(hidden, intermediate, layers, heads, kv_heads, vocab, tied, rope_theta=1000000.0):
    tiny = json.loads((ROOT / "configs/models/tiny-qwen2/config.json").read_text())
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "rope_theta": rope_theta, "hidden_act": "silu", "tie_word_embeddings": tied,
            # the tokenizer is tiny-qwen2's (its ids are a prefix of any vocabulary), so are its special tokens
            "bos_token_id": tiny["eos_token_id"], "eos_token_id": tiny["eos_token_id"], "attention_dropout": 0.0,
            "use_sliding_window": False, "initializer_range": 0.02}


def vit_config(hidden, layers, heads, intermediate, image, patch):
    return {"architectures": ["ViTModel"], "model_type": "vit", "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "intermediate_size": intermediate, "hidden_act": "gelu",
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "layer_norm_eps": 1e-12,
            "image_size": image, "patch_size": patch, "num_channels": 3, "qkv_bias": True, "initializer_range": 0.02}


def clip_config(vision, text, projection, image, patch):
    tiny = json.loads((ROOT / "configs/models/tiny-clip/config.json").read_text())
    vh, vl, vheads = vision
    th, tl, theads, vocab = text
    return {"architectures": ["CLIPModel"], "model_type": "clip", "projection_dim": projection,
            "logit_scale_init_value": 2.6592, "initializer_factor": 1.0,
            "vision_config": {"hidden_size": vh, "intermediate_size": 4 * vh, "num_hidden_layers": vl,
                              "num_attention_heads": vheads, "image_size": image, "patch_size": patch,
                              "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5, "num_channels": 3,
                              "attention_dropout": 0.0, "initializer_factor": 1.0, "initializer_range": 0.02},
            "text_config": {"hidden_size": th, "intermediate_size": 4 * th, "num_hidden_layers": tl,
                            "num_attention_heads": theads, "vocab_size": vocab, "max_position_embeddings": 77,
                            "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5, "attention_dropout": 0.0,
                            "bos_token_id": tiny["text_config"]["bos_token_id"],
                            "eos_token_id": tiny["text_config"]["eos_token_id"],
                            "pad_token_id": tiny["text_config"]["pad_token_id"], "initializer_factor": 1.0,
                            "initializer_range": 0.02}}


# The card's shapes are the models the shipped configs name (tests/unit/memory/shipped_configs_test.cpp has the same);
# the rehearsal's keep each family and its LoRA targets at a size a 2-core CPU trains in seconds.
PROFILES = {
    "card": {
        "device": "cuda",
        "t5xl": dict(model=t5_config(2048, 5120, 32, 24), limit="32GiB", steps=8, warmup=2, parts=(1, 8),
                     lengths={"max_input_length": 256, "max_target_length": 512}),
        "qwen7b": dict(model=qwen2_config(3584, 18944, 28, 28, 4, 152064, tied=False), limit="24GiB",
                       qlora_limit="16GiB", steps=6, warmup=2, parts=(2, 20), lengths={"max_length": 2048}),
        "oom": dict(batch=8, steps=6, at=4, short_parts=(1, 2), long_parts=20, lengths={"max_length": 2048}),
        "hf": dict(causal=qwen2_config(896, 4864, 24, 14, 2, 151936, tied=True),
                   # none of part 4's examples is cut (<= 5 demo records), so both sides train the same tokens
                   seq2seq=t5_config(768, 2048, 12, 12), batch=16, steps=12, warmup=3, parts=(1, 5),
                   rows=[("causal", "users"), ("causal", "best"), ("seq2seq", "users"), ("seq2seq", "best")],
                   lengths={"causal": {"max_length": 1024},
                            "seq2seq": {"max_input_length": 512, "max_target_length": 512}}),
        "vit": dict(model=vit_config(768, 12, 12, 3072, 224, 16), limit="8GiB", steps=8, warmup=2),
        "clip": dict(model=clip_config((768, 12, 12), (512, 12, 8, 49408), 512, 224, 32), limit="16GiB", steps=8,
                     warmup=2),
    },
    "rehearse": {
        "device": "cpu",
        "t5xl": dict(model=t5_config(64, 128, 4, 2, vocab=256, buckets=8, distance=32), limit="512MiB", steps=3,
                     warmup=1, parts=(1, 3), lengths={"max_input_length": 32, "max_target_length": 48}, batch=4),
        "qwen7b": dict(model=qwen2_config(64, 128, 2, 4, 2, 512, tied=False, rope_theta=10000.0), limit="512MiB",
                       qlora_limit="512MiB", steps=3, warmup=1, parts=(1, 3), lengths={"max_length": 96},
                       batch=4),
        "oom": dict(batch=4, steps=4, at=3, short_parts=(1, 1), long_parts=4, lengths={"max_length": 384}),
        "hf": dict(causal=qwen2_config(64, 128, 2, 4, 2, 512, tied=True, rope_theta=10000.0),
                   seq2seq=t5_config(64, 128, 4, 2, vocab=256, buckets=8, distance=32, tied=True), batch=8,
                   steps=4, warmup=1, parts=(1, 1),
                   # two HF processes (imports take most of the time on 2 cores) cover both forms and both variants
                   rows=[("causal", "users"), ("seq2seq", "best")],
                   lengths={"causal": {"max_length": 192}, "seq2seq": {"max_input_length": 128,
                                                                        "max_target_length": 128}}),
        "vit": dict(model=vit_config(32, 2, 2, 64, 32, 8), limit="256MiB", steps=3, warmup=1, batch=16),
        "clip": dict(model=clip_config((32, 2, 2), (32, 2, 2, 757), 32, 32, 8), limit="256MiB", steps=3, warmup=1,
                     batch=8),
    },
}


# ---------------------------------------------------------------- the call's clock and the parts' rows

class PartTimeout(Exception):
    pass


class Part:
    """One part: its time limit (never past the call's deadline), its table rows and its figures for the JSON."""

    def __init__(self, number, title, limit_s, deadline, log):
        self.number, self.title, self.log = number, title, log
        self.started = time.time()
        self.ends = min(self.started + limit_s, deadline - RESERVE_S) if deadline else self.started + limit_s
        self.limit_s = self.ends - self.started
        self.rows: list[list[str]] = []
        self.figures: dict = {}
        self.status = "PASS"

    def left(self):
        left = self.ends - time.time()
        if left <= 1:
            raise PartTimeout(f"part {self.number} ran out of its {self.limit_s:.0f} s")
        return left

    def row(self, check, status, detail, **figures):
        self.rows.append([f"{self.number} {check}", status, detail])
        self.figures[check] = {"status": status, "detail": detail, **figures}
        if status != "PASS":
            self.status = "FAIL"

    def run(self, command, env=None):
        """Runs a command until the part's time is up; its output goes to the call's log."""
        timeout = self.left()
        self.log(f"$ {' '.join(map(str, command))}")
        run = run_measured([str(c) for c in command], env=env, timeout=timeout)
        self.log(run.text())
        if run.returncode != 0 and time.time() >= self.ends - 1:
            raise PartTimeout(f"part {self.number} ran out of its {self.limit_s:.0f} s during {Path(command[0]).name}")
        return run


# ---------------------------------------------------------------- data, models, trainer runs

def demo_records(form, count, seed):
    """`count` demo records of scripts/make_demo_data.py (written once, under build/bench/data)."""
    with open(ensure_data(form, count, seed)) as f:
        return [json.loads(line) for line in f]


def joined(form, records, parts):
    """One record of `parts` demo records. causal: the first one's prompt, then everything else as the completion
    (a long answer to a short prompt: a prompt that fills max_length would leave nothing to train on)."""
    group = records[:parts]
    if form == "causal":
        rest = " ".join(r["prompt"] + r["completion"] for r in group[1:])
        return {"prompt": group[0]["prompt"], "completion": group[0]["completion"] + (" " + rest if rest else "")}
    return {key: " ".join(r[key] for r in group) for key in group[0]}


def realistic_data(form, examples, parts, seed, work, name):
    """`examples` records, each `parts[0]..parts[1]` demo records joined (uniformly), so lengths spread from short
    to past the maximum length (cut), as real fine-tuning sets do."""
    rng = random.Random(seed)
    counts = [rng.randint(*parts) for _ in range(examples)]
    source = demo_records(form, sum(counts), seed)
    out, at = [], 0
    for n in counts:
        out.append(joined(form, source[at:at + n], n))
        at += n
    return write_jsonl(work / "data" / f"{name}.jsonl", out)


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def model_dir(work, name, config, tokenizer_from):
    """config.json (random init: no weights file) and the tokenizer files of a tiny model (ids < its vocabulary)."""
    path = work / "models" / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    for file in (ROOT / tokenizer_from).iterdir():
        if file.name != "config.json":
            shutil.copy(file, path / file.name)
    return path


def image_preprocessor(path, size, clip):
    config = json.loads((path / "preprocessor_config.json").read_text())
    if clip:
        config.update(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    else:
        config.update(size={"height": size, "width": size})
    (path / "preprocessor_config.json").write_text(json.dumps(config, indent=1))


def sets(**values):
    """--set arguments from section__key=value (a JSON value for lists and booleans)."""
    out = []
    for key, value in values.items():
        text = json.dumps(value) if isinstance(value, (list, bool, dict)) or value is None else str(value)
        out += ["--set", f"{key.replace('__', '.')}={text}"]
    return out


def run_overrides(profile, model, data, out_dir, steps, **more):
    """What every run of a shipped config changes: the model and data made here, no evaluation, a fixed number of
    steps, one checkpoint at the last step (its write time is a figure), every step logged."""
    values = dict(model__path=model, data__train_files=[str(data)], data__validation_files=[],
                  data__validation_fraction=0, evaluation__every_steps=0, training__max_steps=steps,
                  checkpoint__output_dir=out_dir, checkpoint__every_steps=steps, checkpoint__save_final=False,
                  checkpoint__keep_best=False, device__type=profile["device"], device__wait_for_device=False,
                  device__min_free_memory=0, logging__every_steps=1, logging__tensorboard=False,
                  logging__progress="plain")
    values.update(more)
    return sets(**values)


class TrainerRun:
    """A finished trainer run and what its output says."""

    def __init__(self, run, out_dir):
        self.run, self.text = run, run.text()
        metrics = Path(out_dir) / "metrics.jsonl"
        self.records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        self.steps = [r for r in self.records if "loss" in r and "tokens_per_s" in r]

    @property
    def ok(self):
        return self.run.returncode == 0 and bool(self.steps)

    def failure(self):
        last = [line.strip() for _, line in self.run.lines
                if line.strip().startswith(("error", "hint")) or "] [error]" in line][-3:]
        return f"exit {self.run.returncode}: " + (" / ".join(last) or "(no error line)")[:300]

    def per_s(self, warmup, key="tokens_per_s"):
        timed = self.steps[warmup:] or self.steps
        values = [r[key] for r in timed if r.get(key)]
        return statistics.median(values) if values else 0.0

    def peak(self):
        return max((r.get("memory_peak", 0) for r in self.steps), default=0)

    def micro_batches(self):
        return [r["micro_batch"] for r in self.steps]

    def first_micro_batch(self):
        found = re.search(r"for \d+ steps of \d+ \w+; micro-batch (\d+)", self.text)
        return int(found.group(1)) if found else (self.steps[0]["micro_batch"] if self.steps else 0)

    def adaptations(self):
        return re.findall(r"step (\d+): (\d+) -> (\d+) \(([^)]*)\)", self.text)

    def parameters(self):
        found = re.search(r"\((\d+) parameters, (\d+) trainable\)", self.text)
        return (int(found.group(1)), int(found.group(2))) if found else (0, 0)

    def checkpoint_seconds(self):
        found = re.findall(r"checkpoint step \d+: \S+ \(([\d.]+) (\w+) written in ([\d.]+) s\)", self.text)
        if not found:
            return None, None
        size, unit, seconds = found[-1]
        return float(seconds), f"{size} {unit}"

    def probe_seconds(self):
        """From the first probe line to the training start line (log timestamps)."""
        probe = self.run.first(lambda line: "micro_batch_size=auto:" in line)
        start = self.run.first(lambda line: line.startswith("Training "))
        return start[0] - probe[0] if probe and start else None


def trainer(part, build_dir, config, overrides, out_dir):
    shutil.rmtree(out_dir, ignore_errors=True)
    run = part.run([build_dir / "trainer", "--config", config, *overrides])
    return TrainerRun(run, out_dir)


def plan_peak(part, build_dir, config, overrides, micro):
    """`trainer plan`'s peak at micro-batch `micro` (as configured): the plan is linear in the micro-batch between
    its rows (powers of two), so the two rows around it give it; its own recommendation too."""
    run = part.run([build_dir / "trainer", "plan", "--config", config, *overrides])
    rows = [(int(m.group(1)), to_bytes(m.group(2), m.group(3)))
            for m in re.finditer(r"^\s+(\d+)\s+([\d.]+) (B|KiB|MiB|GiB|TiB)\s+[\d.]+ \w+\s*$", run.text(), re.M)]
    recommended = re.search(r"recommendation: micro_batch_size (\d+)", run.text())
    fixed = re.search(r"weights \+ grads \+ \w+\s+([\d.]+) (B|KiB|MiB|GiB|TiB)", run.text())
    per_image = re.search(r"activations per image\s+([\d.]+) (B|KiB|MiB|GiB|TiB)", run.text())
    if run.returncode == 0 and fixed and per_image:  # an image model's plan: fixed part + activations per image
        largest = re.search(r"largest micro-batch\s+about (\d+)", run.text())
        return (to_bytes(*fixed.groups()) + micro * to_bytes(*per_image.groups()),
                int(largest.group(1)) if largest else None)
    if run.returncode != 0 or len(rows) < 2:
        return None, None
    below = [r for r in rows if r[0] <= micro] or rows[:1]
    above = [r for r in rows if r[0] > micro] or rows[-1:]
    (m0, p0), (m1, p1) = (below[-1], above[0]) if below[-1][0] != above[0][0] else (rows[-2], rows[-1])
    peak = p0 + (p1 - p0) * (micro - m0) / (m1 - m0)
    return peak, int(recommended.group(1)) if recommended else None


def to_bytes(number, unit):
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]


def human(n):
    return gpu_check_report.human_bytes(n) if n else "n/a"


def mfu(params, tokens_per_s, peak_flops):
    """6 x parameters x trained tokens/s (forward + backward; gpu-check's throughput rows count the same) against
    the card's dense bf16 peak: a lower bound (T5's input tokens and attention are not counted)."""
    if not peak_flops or not tokens_per_s:
        return None
    return 6.0 * params * tokens_per_s / peak_flops


def job_figures(part, check, build_dir, config, overrides, result, warmup, peak_flops, unit="tokens", plan=True):
    """The row of one shipped job: probe's micro-batch, adaptations, peak against the plan, rate, MFU, checkpoint."""
    if not result.ok:
        part.row(check, "FAIL", result.failure())
        return None
    micro = result.first_micro_batch()
    adaptations = result.adaptations()
    rate = result.per_s(warmup, f"{unit}_per_s" if unit != "tokens" else "tokens_per_s")
    params, trainable = result.parameters()
    peak = result.peak()
    plan_bytes, recommended = plan_peak(part, build_dir, config, overrides, micro) if plan else (None, None)
    ckpt_s, ckpt_size = result.checkpoint_seconds()
    utilisation = mfu(params, rate, peak_flops) if unit == "tokens" else None
    figures = dict(micro_batch=micro, micro_batches=result.micro_batches(), adaptations=adaptations,
                   peak_bytes=peak, plan_peak_bytes=plan_bytes, plan_recommended=recommended,
                   per_s=rate, unit=unit, parameters=params, trainable=trainable, mfu=utilisation,
                   checkpoint_s=ckpt_s, checkpoint_size=ckpt_size, probe_s=result.probe_seconds(),
                   loss_first=result.steps[0]["loss"], loss_last=result.steps[-1]["loss"], steps=len(result.steps),
                   wall_s=result.run.seconds)
    probe = f"probe {figures['probe_s']:.0f} s; " if figures["probe_s"] is not None else ""
    detail = (f"micro-batch {micro} ({probe}plan recommends {recommended if recommended else 'n/a'}), "
              f"{len(adaptations)} adaptations{': ' + '; '.join(f'step {s}: {a} -> {b} ({why})' for s, a, b, why in adaptations) if adaptations else ''}, "
              f"peak {human(peak)} vs plan {human(plan_bytes)}"
              f"{f' ({peak / plan_bytes:.2f}x)' if plan_bytes and peak else ''}, "
              f"{rate:,.1f} {unit}/s, MFU {f'{100 * utilisation:.1f}%' if utilisation is not None else 'n/a (no bf16 peak: not a known card)'}, "
              f"checkpoint {f'{ckpt_size} in {ckpt_s:.1f} s' if ckpt_s is not None else 'n/a'}, "
              f"loss {figures['loss_first']:.3f} -> {figures['loss_last']:.3f} in {len(result.steps)} steps")
    ok = rate > 0 and peak > 0 and (plan_bytes or not plan) and ckpt_s is not None
    part.row(check, "PASS" if ok else "FAIL", detail, **figures)
    return figures


# ---------------------------------------------------------------- the parts

class Context:
    def __init__(self, args, profile_name, log):
        self.args, self.log = args, log
        self.profile = PROFILES[profile_name]
        self.build_dir = Path(args.build_dir).resolve()
        self.work = Path(args.work).resolve()
        self.peak_flops = None
        self.qwen_base = None  # the 7B base trainer wrote (part 2), loaded by parts 2 and 3


def lengths_sets(lengths):
    return {f"data__{key}": value for key, value in lengths.items()}


def part1_t5xl(part, ctx):
    p = ctx.profile["t5xl"]
    config = ROOT / "configs/t5xl.json"
    batch = p.get("batch", 128)
    model = model_dir(ctx.work, "flan-t5-xl", p["model"], "configs/models/tiny-t5")
    data = realistic_data("seq2seq", batch * p["steps"], p["parts"], 1, ctx.work, "t5xl")
    out = ctx.work / "runs" / "t5xl"
    overrides = run_overrides(ctx.profile, model, data, out, p["steps"], model__init="random",
                              memory__limit=p["limit"], training__batch_size=batch, **lengths_sets(p["lengths"]))
    result = trainer(part, ctx.build_dir, config, overrides, out)
    job_figures(part, f"FLAN-T5-XL under {p['limit']}", ctx.build_dir, config, overrides, result, p["warmup"],
                ctx.peak_flops)
    shutil.rmtree(out, ignore_errors=True)  # an 11 GB checkpoint


def qwen_base(part, ctx):
    """The 7B base: trainer initialises it (random, no cap: fp32 initialisation of 7.6B parameters takes 30 GB) and,
    since LoRA on a random base saves the base for the adapter, writes it to output_dir/base in bf16. Later runs
    load it as a pretrained model (init=pretrained), as users do: quantized on load for QLoRA."""
    if ctx.qwen_base and (ctx.qwen_base / "config.json").exists():
        return ctx.qwen_base
    p = ctx.profile["qwen7b"]
    model = model_dir(ctx.work, "qwen2.5-7b-config", p["model"], "configs/models/tiny-qwen2")
    data = realistic_data("causal", 2, (1, 1), 5, ctx.work, "qwen-base")
    out = ctx.work / "runs" / "qwen-base"
    overrides = run_overrides(ctx.profile, model, data, out, 1, model__init="random", memory__limit=0,
                              training__batch_size=1, training__micro_batch_size=1, checkpoint__every_steps=0,
                              data__group_by_length=False, **lengths_sets(p["lengths"]))
    result = trainer(part, ctx.build_dir, ROOT / "configs/qwen2.5-7b-lora.json", overrides, out)
    base = out / "base"
    size = sum(f.stat().st_size for f in base.glob("*")) if base.exists() else 0
    if not result.ok or size == 0:
        part.row("7B base", "FAIL", "trainer could not write the random base: " + result.failure())
        return None
    part.row("7B base", "PASS", f"random init and the base written by trainer ({human(size)} of safetensors) in "
                                f"{result.run.seconds:.1f} s (the whole 1-step run)", bytes=size,
             seconds=result.run.seconds)
    ctx.qwen_base = base
    return base


def bitsandbytes_library(part, ctx):
    """QLoRA on a card needs bitsandbytes' CUDA library: the machine's bitsandbytes package, $TRAINER_BITSANDBYTES, or
    the copies in the kit (scripts/hf_kit.py); the row says which."""
    import importlib.util  # noqa: PLC0415
    if ctx.profile["device"] != "cuda":
        return
    if os.environ.get("TRAINER_BITSANDBYTES"):
        note = f"TRAINER_BITSANDBYTES={os.environ['TRAINER_BITSANDBYTES']}"
    elif importlib.util.find_spec("bitsandbytes") is not None:
        note = "the machine's bitsandbytes package"
    elif list((Path(ctx.args.kit) / "bitsandbytes").glob("libbitsandbytes_cuda*.so")):
        os.environ["TRAINER_BITSANDBYTES"] = str((Path(ctx.args.kit) / "bitsandbytes").resolve())
        note = f"the kit's copies: TRAINER_BITSANDBYTES={os.environ['TRAINER_BITSANDBYTES']}"
    else:
        note = "none found (no bitsandbytes package, no kit): QLoRA will say so"
    part.row("bitsandbytes", "PASS", note)


def part2_qwen(part, ctx):
    p = ctx.profile["qwen7b"]
    bitsandbytes_library(part, ctx)
    base = qwen_base(part, ctx)
    if base is None:
        return
    batch = p.get("batch", 16)
    data = realistic_data("causal", batch * p["steps"], p["parts"], 2, ctx.work, "qwen7b")
    for name, config, limit in (("LoRA", "configs/qwen2.5-7b-lora.json", p["limit"]),
                                ("QLoRA", "configs/qwen2.5-7b-qlora.json", p["qlora_limit"])):
        out = ctx.work / "runs" / f"qwen7b-{name.lower()}"
        overrides = run_overrides(ctx.profile, base, data, out, p["steps"], model__init="pretrained",
                                  memory__limit=limit, training__batch_size=batch, **lengths_sets(p["lengths"]))
        try:
            result = trainer(part, ctx.build_dir, ROOT / config, overrides, out)
            job_figures(part, f"Qwen2.5-7B {name} under {limit}", ctx.build_dir, ROOT / config, overrides, result,
                        p["warmup"], ctx.peak_flops)
        finally:
            shutil.rmtree(out, ignore_errors=True)


def part3_oom(part, ctx):
    p, o = ctx.profile["qwen7b"], ctx.profile["oom"]
    base = qwen_base(part, ctx)
    if base is None:
        return
    batch, steps, at = o["batch"], o["steps"], o["at"]
    rng = random.Random(3)
    short = demo_records("causal", batch * steps * o["short_parts"][1] + batch * o["long_parts"], 3)
    records, used = [], 0
    for step in range(1, steps + 1):
        for _ in range(batch):
            n = o["long_parts"] if step == at else rng.randint(*o["short_parts"])
            records.append(joined("causal", short[used:used + n], n))
            used += n
    data = write_jsonl(ctx.work / "data" / "oom.jsonl", records)
    config = ROOT / "configs/qwen2.5-7b-lora.json"

    def run(tag, limit):
        out = ctx.work / "runs" / f"oom-{tag}"
        overrides = run_overrides(ctx.profile, base, data, out, steps, model__init="pretrained", memory__limit=limit,
                                  training__batch_size=batch, training__micro_batch_size=batch,
                                  checkpoint__every_steps=0, data__shuffle=False, data__group_by_length=False,
                                  lora__dropout=0.0, **lengths_sets(o["lengths"]))
        result = trainer(part, ctx.build_dir, config, overrides, out)
        shutil.rmtree(out, ignore_errors=True)
        return result

    free = run("free", 0)
    if not free.ok or len(free.steps) < at:
        part.row("7B out-of-memory", "FAIL", "the uncapped run failed: " + free.failure())
        return
    before = max(r["memory_peak"] for r in free.steps[:at - 1])
    during = free.steps[at - 1]["memory_peak"]
    if during <= before:
        part.row("7B out-of-memory", "FAIL", f"the long batch at step {at} did not raise the peak "
                                             f"({human(before)} before, {human(during)} at it): no cap between them")
        return
    cap = (before + during) // 2
    capped = run("capped", cap)
    if not capped.ok:
        part.row("7B out-of-memory", "FAIL", f"under {human(cap)}: " + capped.failure())
        return
    adaptations = capped.adaptations()
    free_tokens = [r["tokens"] for r in free.steps]
    capped_tokens = [r["tokens"] for r in capped.steps]
    loss_free, loss_capped = free.steps[-1]["loss"], capped.steps[-1]["loss"]
    relative = abs(loss_capped - loss_free) / max(abs(loss_free), 1e-12)
    ok = bool(adaptations) and free_tokens == capped_tokens and relative <= 0.01
    part.row("7B out-of-memory", "PASS" if ok else "FAIL",
             f"cap {human(cap)} (peak {human(before)} before step {at}, {human(during)} at it): "
             + ("; ".join(f"step {s}: {a} -> {b} ({why})" for s, a, b, why in adaptations) or "NO adaptation")
             + f"; {len(capped.steps)} of {steps} steps, "
             + ("the same tokens every step" if free_tokens == capped_tokens else "DIFFERENT tokens")
             + f"; final loss {loss_capped:.5f} vs {loss_free:.5f} uncapped (relative {relative:.1e}, at most 1e-2); "
             f"wall {capped.run.seconds:.1f} s vs {free.run.seconds:.1f} s",
             cap_bytes=cap, peak_before=before, peak_at=during, adaptations=adaptations,
             loss_free=loss_free, loss_capped=loss_capped, relative_loss_difference=relative,
             same_tokens=free_tokens == capped_tokens, wall_s=[free.run.seconds, capped.run.seconds])


def part4_vs_hf(part, ctx):
    import vs_hf  # noqa: PLC0415 (its functions import transformers lazily)
    vs_hf.TRAINER = str(ctx.build_dir / "trainer")  # run_ours runs this one
    h = ctx.profile["hf"]
    kit_note, env_path = hf_kit.ensure(Path(ctx.args.kit), ctx.work / "hf-site", sys.executable,
                                       ["transformers", "accelerate", "datasets", "peft"])
    if env_path is None:
        part.row("python packages", "FAIL", kit_note)
        return
    part.row("python packages", "PASS", kit_note)
    if env_path:
        os.environ["PYTHONPATH"] = env_path + (os.pathsep + os.environ["PYTHONPATH"]
                                               if os.environ.get("PYTHONPATH") else "")
    device = ctx.profile["device"]
    for form, label in (("causal", "Qwen2"), ("seq2seq", "T5")):
        model = model_dir(ctx.work, f"hf-{form}", h[form], vs_hf.TINY_MODELS[form])
        lengths = h["lengths"][form]
        data = str(realistic_data(form, h["batch"] * h["steps"], h["parts"], 4, ctx.work, f"hf-{form}"))
        work = ctx.work / "runs" / f"hf-{form}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        config = vs_hf.ours_config(str(work / "ours.json"), str(model), form, data, str(work / "ours"), h["batch"],
                                   h["batch"], h["steps"], lengths, data_options={"packing": True},
                                   precision={"mode": "bf16-mixed"}, device={"type": device})
        ours_run, ours_steps = vs_hf.run_ours(config, timeout=part.left())
        ctx.log(ours_run.text())
        ours = TrainerRun(ours_run, work / "ours")
        if not ours.ok:
            part.row(f"{label} trainer", "FAIL", ours.failure())
            continue
        params = ours.parameters()[0]
        ours_rate = vs_hf.tokens_per_second(ours_steps, h["warmup"])
        ours_peak = ours.peak()
        best = {"flatten": True, "attn_implementation": "sdpa"} if form == "causal" else {"group_by_length": True}
        for variant, options in (("as users run it (padded)", {}), ("best options (" + ", ".join(best) + ")", best)):
            if (form, "best" if options else "users") not in h["rows"]:
                continue
            spec = vs_hf.hf_spec(str(model), form, data, str(work / f"hf-{len(options)}"), h["batch"], h["steps"],
                                 lengths, bf16=True, device=device, **options)
            run, steps = vs_hf.run_hf(spec, timeout=part.left())
            ctx.log(run.text())
            check = f"{label} {params / 1e6:.3g}M vs HF {variant}"
            if run.returncode != 0:
                part.left()  # a run the part's limit stopped is a TIMEOUT (raised here), not a failure of HF's
            if run.returncode != 0 or len(steps) <= h["warmup"]:
                tail = " / ".join(line for _, line in run.lines[-3:])
                part.row(check, "FAIL", f"HF exit {run.returncode}: {tail[:300]}")
                continue
            hf_rate = vs_hf.tokens_per_second(steps, h["warmup"])
            found = run.first(lambda line: line.startswith("BENCH peak_memory "))
            hf_peak, what = (int(found[1].split()[2]), "allocator") if found else (run.peak_rss, "process RSS")
            same = [s[1] for s in steps] == [s[1] for s in ours_steps]
            part.row(check, "PASS" if ours_rate and hf_rate and hf_peak else "FAIL",
                     f"target tokens/s trainer (data.packing) {ours_rate:,.0f} vs HF {hf_rate:,.0f} = "
                     f"{ours_rate / hf_rate:.2f}x; peak {human(ours_peak)} vs {human(hf_peak)} ({what}) = "
                     f"{ours_peak / hf_peak:.2f}x; {h['batch']} x {h['steps']} steps ({h['warmup']} warm-up), "
                     + ("the same tokens every step" if same else "each side's own order" if options.get(
                         "group_by_length") else "DIFFERENT tokens per step"),
                     ours_tokens_per_s=ours_rate, hf_tokens_per_s=hf_rate, ratio=ours_rate / hf_rate,
                     ours_peak=ours_peak, hf_peak=hf_peak, hf_peak_kind=what, peak_ratio=ours_peak / hf_peak,
                     parameters=params, same_tokens=same, hf_options=options)
        shutil.rmtree(work, ignore_errors=True)


def part5_images(part, ctx):
    images = ROOT / "data/demo/images"
    for key, name, config, data, tokenizer_from, clip in (
            ("vit", "ViT-B/16 LoRA", "configs/vit-base-flowers-lora.json", images / "train", "configs/models/tiny-vit",
             False),
            ("clip", "CLIP ViT-B/32", "configs/clip-cars.json", images / "train-captions.jsonl",
             "configs/models/tiny-clip", True)):
        p = ctx.profile[key]
        model = model_dir(ctx.work, key, p["model"], tokenizer_from)
        size = p["model"]["vision_config"]["image_size"] if clip else p["model"]["image_size"]
        image_preprocessor(model, size, clip)
        out = ctx.work / "runs" / key
        more = {"training__batch_size": p["batch"]} if "batch" in p else {}
        if ctx.profile["device"] == "cpu" and clip:
            more["precision__mode"] = "bf16-mixed"  # fp16-mixed is for cards without bf16; the CPU has no fp16 path
        overrides = run_overrides(ctx.profile, model, data, out, p["steps"], model__init="random",
                                  memory__limit=p["limit"], **more)
        result = trainer(part, ctx.build_dir, ROOT / config, overrides, out)
        job_figures(part, f"{name} under {p['limit']}", ctx.build_dir, ROOT / config, overrides, result, p["warmup"],
                    None, unit="pairs" if clip else "images")
        shutil.rmtree(out, ignore_errors=True)


def part6_generation(part, ctx):
    """scripts/bench/generate_eval.py on the card (bf16) or, rehearsed, its --quick tiny models on the CPU."""
    tool = ctx.build_dir / "trainer_parity"
    if not tool.exists():
        part.row("generation", "FAIL", f"{tool} is missing: build it (scripts/gpu-check builds it when --parts has 6)")
        return
    out = ctx.work / "generate-eval.json"
    command = [sys.executable, str(ROOT / "scripts/bench/generate_eval.py"), "--tool", str(tool), "--json", str(out)]
    if ctx.args.rehearse:
        command += ["--quick", "--threads", "1"]
    else:
        command += ["--device", "cuda", "--dtype", "bf16", "--examples", "128", "--batch", "32", "--rounds", "2"]
    out.unlink(missing_ok=True)
    run = part.run(command)
    if run.returncode != 0 or not out.exists():
        part.row("generation", "FAIL", f"generate_eval.py exit {run.returncode}: {run.text()[-300:]}")
        return
    result = json.loads(out.read_text())
    unit = "wall" if result["device"] != "cpu" else "cpu"
    for row in result["rows"]:
        ours, theirs = row[f"trainer_{unit}"], row[f"transformers_{unit}"]
        part.row(f"{row['model']} {row['decoding']}", "PASS",
                 f"examples/s ({unit}) trainer {ours:,.1f} vs Seq2SeqTrainer predict_with_generate {theirs:,.1f} = "
                 f"{ours / theirs:.2f}x; {row['same_answers']}/{row['examples']} answers the same "
                 f"({result['device']} {result['dtype']}, batch {result['batch']}, {result['max_new_tokens']} new "
                 f"tokens, best of {result['rounds']})", ratio=ours / theirs, **row)


PARTS = {1: ("FLAN-T5-XL, 32 GiB", part1_t5xl), 2: ("Qwen2.5-7B LoRA 24 GiB, QLoRA 16 GiB", part2_qwen),
         3: ("out-of-memory at 7B", part3_oom), 4: ("trainer vs transformers' Trainer", part4_vs_hf),
         5: ("ViT-B/16 and CLIP B/32", part5_images), 6: ("evaluation by generation vs Seq2SeqTrainer", part6_generation)}


# ---------------------------------------------------------------- main: one table, JSON and Markdown

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build-dir", required=True, help="the build holding trainer (CUDA; the CPU build to rehearse)")
    parser.add_argument("--out", required=True, help="folder for gpu-full.json, gpu-full.md and gpu-full.log")
    parser.add_argument("--parts", default="1,2,3,4,5,6", help="comma-separated part numbers (default: all)")
    parser.add_argument("--rehearse", action="store_true", help="tiny shapes on the CPU; the gpu tests are skipped")
    parser.add_argument("--no-gpu-tests", action="store_true", help="leave the gpu tests out (a second call)")
    parser.add_argument("--row", action="append", default=[], help="NAME|STATUS|DETAIL rows to print first")
    parser.add_argument("--deadline", type=float, default=0, help="Unix time by which the table must be written")
    parser.add_argument("--work", help="scratch folder for models, data and runs (default: BUILD_DIR/gpu-full)")
    parser.add_argument("--kit", default=str(ROOT / "build" / "hf-kit"),
                        help="the wheels made by `scripts/gpu-check --hf-kit DIR`, used for what the machine lacks")
    args = parser.parse_args()
    args.work = args.work or str(Path(args.build_dir) / "gpu-full")
    try:
        wanted = sorted({int(x) for x in args.parts.split(",") if x.strip()})
        assert wanted and all(x in PARTS for x in wanted)
    except (ValueError, AssertionError):
        parser.error(f"--parts {args.parts}: give part numbers from 1 to 6, comma-separated (e.g. 1,2,3)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "gpu-full.log", "w")

    def log(text):
        log_file.write(text + "\n")
        log_file.flush()

    ctx = Context(args, "rehearse" if args.rehearse else "card", log)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    rows = [row.split("|", 2) for row in args.row]
    started = time.time()
    if args.rehearse:
        rows.append(["GPU", "SKIP", "rehearsal on the CPU with tiny shapes (device.type=cpu)"])
        rows.append(["gpu tests", "SKIP", "rehearsal: the gpu tests need a card (run without --rehearse)"])
    else:
        name, ctx.peak_flops = gpu_check_report.gpu_info()
        rows.append(["GPU", "PASS" if name else "FAIL",
                     name + (f", bf16 peak {ctx.peak_flops / 1e12:.0f} TFLOP/s" if ctx.peak_flops else "")
                     if name else "no NVIDIA GPU visible to this Python's torch: every part will fail"])
        if args.no_gpu_tests:
            rows.append(["gpu tests", "SKIP", "--no-gpu-tests (run in an earlier call)"])
        else:
            tests_started = time.time()
            gpu_check_report.run_gpu_tests(Path(args.build_dir), rows)
            rows.append(["gpu tests time", "PASS", f"{time.time() - tests_started:.0f} s"])
    limits = REHEARSE_LIMITS_S if args.rehearse else PART_LIMITS_S
    results = {"parts": {}, "limits_s": limits, "rehearse": args.rehearse}
    for number in wanted:
        title, function = PARTS[number]
        if args.deadline and args.deadline - time.time() - RESERVE_S < 20:
            rows.append([f"{number} {title}", "SKIP", "no time left in this call's budget: run it in a call of its "
                                                      f"own (--parts {number})"])
            results["parts"][number] = {"title": title, "status": "SKIP"}
            continue
        part = Part(number, title, limits[number], args.deadline, log)
        log(f"==== part {number}: {title} (limit {part.limit_s:.0f} s)")
        try:
            function(part, ctx)
        except PartTimeout as e:
            part.row("time limit", "TIMEOUT", str(e))
        except Exception as e:  # noqa: BLE001 (a broken part must not stop the others)
            import traceback  # noqa: PLC0415
            log(traceback.format_exc())
            part.row("error", "FAIL", f"{type(e).__name__}: {str(e)[:300]} (traceback in gpu-full.log)")
        if not part.rows:
            part.row("no result", "FAIL", "the part produced no row")
        seconds = time.time() - part.started
        rows.append([f"{number} {title}", part.status, f"{seconds:.0f} s of its {part.limit_s:.0f} s"])
        rows.extend(part.rows)
        results["parts"][number] = {"title": title, "status": part.status, "seconds": seconds,
                                    "limit_s": part.limit_s, "checks": part.figures}
    shutil.rmtree(Path(args.work) / "runs", ignore_errors=True)
    shutil.rmtree(Path(args.work) / "models", ignore_errors=True)
    results["rows"] = rows
    results["seconds"] = time.time() - started
    ok = all(status in ("PASS",) or (status == "SKIP" and (args.rehearse or check == "gpu tests"))
             for check, status, _ in rows)
    results["ok"] = ok

    width = min(max(len(row[0]) for row in rows), 48)
    lines = [f"{'check':<{width}}  {'result':<7}  detail", f"{'-' * width}  -------  {'-' * 60}"]
    lines += [f"{check:<{width}}  {status:<7}  {detail}" for check, status, detail in rows]
    print("\n" + "\n".join(lines) + "\n")
    verdict = "gpu-check --full: " + ("PASSED" if ok else "FAILED (see the rows above that are not PASS)")
    print(verdict)
    (out / "gpu-full.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    md = ["| check | result | detail |", "|---|---|---|"]
    md += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    (out / "gpu-full.md").write_text("\n".join(md) + "\n\n" + verdict + "\n")
    log_file.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
