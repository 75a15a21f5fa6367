#!/usr/bin/env python3
"""Fully sharded weights (distributed.shard_weights, issue 56): memory per rank at 1, 2 and 4 ranks, and the same
work under PyTorch's FSDP2 (scripts/bench/fsdp2_loop.py: transformers' model, `fully_shard` per decoder layer and the
root, as torchtitan applies it) under torchrun, alternately, on this machine's CPU (Gloo on 127.0.0.1, one thread per
rank).

    .venv/bin/python scripts/bench/sharded_memory.py [--model qwen2-100m] [--ranks 1 2 4] [--steps 4] [--batch 8]
        [--max-length 256] [--repeats 1] [--skip-fsdp2] [--prefetch-off]

Same work on both sides: vs_hf.py's model directory (config.json, random init on each side), the same recipe JSONL
in file order, the same tokenizer, fp32, AdamW lr 1e-3, clipping at 1.0, the global batch split into equal contiguous
shares (trainer: training.batch_size global, micro_batch_size its share: one micro-batch per rank). One process is
trainer unsharded (what every rank of unsharded data parallelism holds) and FSDP2 on one rank. trainer reads the
weights transformers saved (random), each rank its pieces unit by unit; FSDP2 builds on the meta device, shards and
initialises each rank's shards (torchtitan's way): neither side ever holds the whole model on a rank.

Measured per rank: the peak RSS (VmHWM of each rank's process, polled every 0.2 s: dist_vs_hf.run_group), and for
trainer the peak of its tensors (the CPU budget allocator's count, in the run's summary), which is what sharding
divides: weights, gradients, optimizer state, activations. tokens/s over the steps after the first. The weights +
gradients + AdamW state of the whole model are 16 bytes a parameter; per rank sharded they should fall as 1/N, plus
the units held gathered (the embeddings and head for a step, one block, and the next one while it is prefetched).
--prefetch-off adds trainer sharded with distributed.prefetch=false, run alternately with the default (prefetch on):
what gathering the next unit while one computes is worth.
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BENCH_DIR, PY, TRAINER, ensure_data, fresh_dir, log, machine_notes, table, write_json  # noqa: E402
from dist_vs_hf import free_port, rank_env, rank_peaks, run_group  # noqa: E402
from vs_hf import LR, SEED, model_dir, ours_config, trainer_steps  # noqa: E402

FSDP2_LOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fsdp2_loop.py")
FSDP2_STEP = re.compile(r"^BENCH step (\d+) tokens (\d+) loss (\S+)")
RANK_TENSORS = re.compile(r"^\s+rank (\d+): ([\d.]+) ([KMG]i?B)")
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def pretrained_dir(directory):
    """`directory`'s model with random weights saved by transformers (and its tokenizer files): trainer then reads
    each rank's pieces unit by unit, never the whole model."""
    path = directory + "-weights"
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        import shutil
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
        model.save_pretrained(path)
        for name in os.listdir(directory):
            if name != "config.json":
                shutil.copy(os.path.join(directory, name), os.path.join(path, name))
    return path


def tokens_per_second(steps):
    if len(steps) < 2:
        return None
    return sum(tokens for _, tokens, _ in steps[1:]) / (steps[-1][0] - steps[0][0])


def run_ours(config_path, ranks, timeout, prefetch=True):
    with open(config_path) as f:
        out_dir = json.load(f)["checkpoint"]["output_dir"]
    fresh_dir(out_dir)
    args = ["--config", config_path]
    if ranks > 1:
        args += ["--set", "distributed.shard_weights=true", "--set", f"distributed.prefetch={str(prefetch).lower()}"]
        command = [TRAINER, "launch", "--nproc-per-node", str(ranks), "--master-port", str(free_port()), "--"] + args
    else:
        command = [TRAINER] + args
    run = run_group(command, rank_env(), timeout)
    if run.returncode != 0:
        sys.exit(f"trainer on {ranks} rank(s) failed:\n" + "\n".join(line for _, line in run.lines[-30:]))
    steps = trainer_steps(run, os.path.join(out_dir, "metrics.jsonl"))
    tensors = {}
    for _, line in run.lines:
        if (m := RANK_TENSORS.match(line)):
            tensors[int(m.group(1))] = float(m.group(2)) * UNITS[m.group(3)] / 2**20
    if ranks == 1:  # one process: its summary's peak memory line
        for _, line in run.lines:
            if (m := re.search(r"peak memory ([\d.]+) ([KMG]i?B)", line)):
                tensors[0] = float(m.group(1)) * UNITS[m.group(2)] / 2**20
    peaks, _ = rank_peaks(run)
    if ranks == 1 and not peaks:
        peaks = [max(hwm for _, hwm, _ in run.peaks.values())]
    # Between steps (rank 0's last progress line): what stays, the weights, gradients and optimizer state.
    steady = None
    for _, line in run.lines:
        if (m := re.search(r"\] step \d+/\d+ .* memory ([\d.]+) ([KMG]i?B) \(peak", line)):
            steady = float(m.group(1)) * UNITS[m.group(2)] / 2**20
    return steps, peaks, [tensors.get(r) for r in range(ranks)], steady


def run_fsdp2(spec, ranks, timeout):
    spec_path = spec["output"] + f".{ranks}.spec.json"
    write_json(spec_path, spec)
    torchrun = os.path.join(os.path.dirname(PY), "torchrun")
    command = [torchrun, "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1", "--master-port",
               str(free_port()), FSDP2_LOOP, spec_path]
    run = run_group(command, rank_env(), timeout)
    if run.returncode != 0:
        sys.exit(f"FSDP2 on {ranks} rank(s) failed:\n" + "\n".join(line for _, line in run.lines[-30:]))
    steps = [(t, int(m.group(2)), float(m.group(3))) for t, line in run.lines if (m := FSDP2_STEP.match(line))]
    peaks, _ = rank_peaks(run)
    return steps, peaks


def mib(values):
    return " / ".join("-" if v is None else f"{v / 2**20:.0f}" if v > 2**16 else f"{v:.0f}" for v in values)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2-100m")
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--skip-fsdp2", action="store_true")
    parser.add_argument("--prefetch-off", action="store_true", help="also trainer sharded without prefetch")
    args = parser.parse_args()
    work = fresh_dir(os.path.join(BENCH_DIR, "runs", "sharded-memory", args.model))
    data = ensure_data("causal", args.batch * args.steps)
    directory = model_dir(args.model)
    weights = pretrained_dir(directory)
    rows = []
    for ranks in args.ranks:
        config = ours_config(os.path.join(work, f"config-{ranks}.json"), directory, "causal", data,
                             os.path.join(work, f"ours-{ranks}"), args.batch, args.batch // ranks, args.steps,
                             {"max_length": args.max_length}, evaluation={"every_steps": 0, "sample_prompts": []},
                             memory={"limit": "64GiB"}, model={"path": weights, "init": "pretrained"})
        spec = {"model_dir": directory, "data": data, "max_length": args.max_length, "batch_size": args.batch,
                "steps": args.steps, "lr": LR, "seed": SEED, "output": os.path.join(work, "fsdp2")}
        for repeat in range(args.repeats):
            sides = ["ours", "ours-no-prefetch", "fsdp2"]
            sides = sides if repeat % 2 == 0 else sides[::-1]
            for side in sides:
                if side == "fsdp2" and args.skip_fsdp2 or side == "ours-no-prefetch" and (not args.prefetch_off or
                                                                                          ranks == 1):
                    continue
                log(f"{args.model}: {side} on {ranks} rank(s), repeat {repeat + 1}")
                if side.startswith("ours"):
                    prefetch = side == "ours"
                    steps, peaks, tensors, steady = run_ours(config, ranks, args.timeout, prefetch)
                    rows.append(["trainer" + (" sharded" if ranks > 1 else "") +
                                 (" (no prefetch)" if not prefetch else ""), ranks,
                                 f"{tokens_per_second(steps) or 0:.0f}", f"{steps[-1][2]:.4f}" if steps else "-",
                                 mib(peaks), mib(tensors), "-" if steady is None else f"{steady:.0f}"])
                else:
                    steps, peaks = run_fsdp2(spec, ranks, args.timeout)
                    rows.append(["FSDP2", ranks, f"{tokens_per_second(steps) or 0:.0f}",
                                 f"{steps[-1][2]:.4f}" if steps else "-", mib(peaks), "-", "-"])
    print(machine_notes())
    print(table(["side", "ranks", "target tokens/s", "last loss", "peak RSS MiB per rank",
                 "trainer's tensors, peak MiB per rank", "trainer's tensors between steps MiB (rank 0)"], rows))


if __name__ == "__main__":
    main()
