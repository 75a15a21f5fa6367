#!/usr/bin/env python3
"""Data parallelism on this machine's cores: 2 ranks x 1 thread (`trainer launch --nproc-per-node 2`, Gloo on
127.0.0.1) against 1 process x 2 threads, the same global batch, the same steps, run alternately. Prints a table:
tokens/s of each side (steps after the warm-up), their ratio, peak RSS (one process; the launcher's largest rank),
and the share of rank 0's step time spent in collectives (waiting for the other rank included).

    .venv/bin/python scripts/bench/distributed_scaling.py [--models t5-60m qwen2-100m] [--repeats 2]

With --overlap: 2 ranks with distributed.overlap_grad_reduce on against off (the gradient sums started during the
last micro-batch's backward, or all after it), alternating, micro-batch --micro (default: each rank's whole share,
so every step's one backward overlaps); tokens/s of each side, their ratio, rank 0's time in collectives.

    .venv/bin/python scripts/bench/distributed_scaling.py --overlap [--models ...] [--repeats 3] [--micro 4] \
        [--bucket-size 64KiB]
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BENCH_DIR, TRAINER, ensure_data, fresh_dir, load_average, log, run_measured  # noqa: E402
from vs_hf import LENGTHS, MODELS, model_dir, ours_config  # noqa: E402

STEP_LINE = re.compile(r"\] step (\d+)/\d+ loss")
# The end summary's line for rank 0: "    rank 0: <peak memory>, <seconds in collectives> s" (text runs add
# ", <n> records tokenized").
COMM_LINE = re.compile(r"^    rank 0: [^,]+, ([\d.]+) s(?:, \d+ records tokenized)?$", re.M)


def short_run(binary, config, out_dir, ranks, threads, steps, batch, micro, extra=()):
    """A short measured run of `config` (relative to the repository root) on `ranks` processes (`trainer launch`;
    1: plain trainer) of `threads` intra-op threads and as many data workers each, no evaluation or checkpoints,
    one log line per step; exits on failure. Returns the run, {step: seconds since the start}, {step: examples or
    tokens counted by metrics.jsonl} and rank 0's seconds in collectives (0 for one process)."""
    fresh_dir(out_dir)
    settings = [f"training.max_steps={steps}", f"training.batch_size={batch}", f"training.micro_batch_size={micro}",
                "evaluation.every_steps=0", "data.validation_files=[]", "checkpoint.every_steps=0",
                "checkpoint.save_final=false", "logging.every_steps=1", "logging.tensorboard=false",
                f"data.num_workers={threads}", f"checkpoint.output_dir={out_dir}", *extra]
    args = ["--config", config]
    for setting in settings:
        args += ["--set", setting]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS=str(threads))
    command = [binary, *args] if ranks == 1 else [binary, "launch", "--nproc-per-node", str(ranks), "--", *args]
    run = run_measured(command, env=env, timeout=1800)
    if run.returncode != 0:
        sys.exit(f"{' '.join(command)} failed (exit {run.returncode}):\n" + run.text()[-3000:])
    times = {int(m.group(1)): t for t, line in run.lines if (m := STEP_LINE.search(line))}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        counted = {r["step"]: r["tokens"] for r in map(json.loads, f) if "loss" in r}
    comm = COMM_LINE.search(run.text())
    return run, times, counted, float(comm.group(1)) if comm else 0.0


def one_run(config_path, ranks):
    """Runs the config on `ranks` processes (1: plain trainer with 2 threads); returns tokens/s, peak RSS, the
    collective seconds of rank 0 and the wall time of the measured steps."""
    with open(config_path) as f:
        config = json.load(f)
    metrics = os.path.join(config["checkpoint"]["output_dir"], "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    if ranks == 1:
        env["OMP_NUM_THREADS"] = "2"
        command = [TRAINER, "--config", config_path]
    else:
        env["OMP_NUM_THREADS"] = "1"
        command = [TRAINER, "launch", "--nproc-per-node", str(ranks), "--", "--config", config_path]
    run = run_measured(command, env=env, timeout=3600)
    if run.returncode != 0:
        sys.exit(f"{' '.join(command)} failed (exit {run.returncode}):\n" + run.text()[-3000:])
    times = {int(m.group(1)): t for t, line in run.lines if (m := STEP_LINE.search(line))}
    with open(metrics) as f:
        tokens = {r["step"]: r["tokens"] for r in map(json.loads, f) if "loss" in r}
    return run, times, tokens


def measure(name, repeats, warmup):
    m = MODELS[name]
    steps = m["steps"] + warmup
    path = model_dir(name)
    data = ensure_data(m["form"], 4096)
    work = fresh_dir(os.path.join(BENCH_DIR, "runs", "distributed", name))
    config = ours_config(os.path.join(work, "config.json"), path, m["form"], data, os.path.join(work, "out"),
                         m["batch"], 1, steps, LENGTHS[m["form"]], logging={"every_steps": 1, "progress": "plain",
                                                                            "tensorboard": False})
    sides = {1: [], 2: []}
    for r in range(repeats):
        for ranks in ([1, 2] if r % 2 == 0 else [2, 1]):
            load = load_average()
            run, times, tokens = one_run(config, ranks)
            last = max(times)
            rate = (tokens[last] - tokens[warmup]) / (times[last] - times[warmup])
            comm = COMM_LINE.search(run.text())
            sample = {"tokens_per_s": rate, "peak_rss": run.peak_rss, "comm_s": float(comm.group(1)) if comm else 0.0,
                      "wall_s": run.seconds, "load": load}
            sides[ranks].append(sample)
            log(f"{name} rep {r + 1}/{repeats} {ranks} rank(s): {rate:.0f} tokens/s, load {load}")
    return {"model": name, "batch": m["batch"], "steps": steps, "sides": sides}


def measure_overlap(name, repeats, warmup, micro, bucket_size):
    m = MODELS[name]
    steps = m["steps"] + warmup
    data = ensure_data(m["form"], 4096)
    work = fresh_dir(os.path.join(BENCH_DIR, "runs", "distributed-overlap", name))
    micro = micro or m["batch"] // 2
    configs = {}
    for side in ("on", "off"):
        configs[side] = ours_config(os.path.join(work, f"config-{side}.json"), model_dir(name), m["form"], data,
                                    os.path.join(work, "out-" + side), m["batch"], micro, steps, LENGTHS[m["form"]],
                                    logging={"every_steps": 1, "progress": "plain", "tensorboard": False},
                                    distributed={"overlap_grad_reduce": side == "on",
                                                 **({"bucket_size": bucket_size} if bucket_size else {})})
    sides = {"on": [], "off": []}
    for r in range(repeats):
        for side in (["on", "off"] if r % 2 == 0 else ["off", "on"]):
            load = load_average()
            run, times, tokens = one_run(configs[side], 2)
            last = max(times)
            rate = (tokens[last] - tokens[warmup]) / (times[last] - times[warmup])
            comm = COMM_LINE.search(run.text())
            sides[side].append({"tokens_per_s": rate, "comm_s": float(comm.group(1)) if comm else 0.0,
                                "wall_s": run.seconds, "load": load})
            log(f"{name} rep {r + 1}/{repeats} overlap {side}: {rate:.0f} tokens/s, load {load}")
    return {"model": name, "batch": m["batch"], "micro": micro, "bucket": bucket_size or "25MB", "sides": sides}


def print_overlap(results, repeats, warmup):
    print("| model | batch (micro-batch per rank) | bucket_size | overlap off: tokens/s | overlap on: tokens/s | ratio (on / off) "
          "| per-pair ratios | rank 0 in collectives: off / on | load average |")
    print("|---|---:|---|---:|---:|---:|---|---:|---|")
    for r in results:
        off = [s["tokens_per_s"] for s in r["sides"]["off"]]
        on = [s["tokens_per_s"] for s in r["sides"]["on"]]
        pairs = ", ".join(f"{a / b:.2f}" for a, b in zip(on, off))
        comm = {k: median([s["comm_s"] / s["wall_s"] for s in r["sides"][k]]) for k in ("off", "on")}
        loads = sorted(s["load"] for k in ("on", "off") for s in r["sides"][k])
        print(f"| {r['model']} | {r['batch']} ({r['micro']}) | {r['bucket']} | {median(off):.0f} | {median(on):.0f} | "
              f"{median(on) / median(off):.2f}x | {pairs} | {comm['off']:.0%} / {comm['on']:.0%} | "
              f"{loads[0]}-{loads[-1]} |")
    print(f"\n2 ranks x 1 thread (Gloo, 127.0.0.1) each side; {repeats} runs of each side, alternating; medians. "
          f"Measured steps: after {warmup} warm-up steps.")


def median(values):
    values = sorted(values)
    return values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["t5-60m", "qwen2-100m"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--overlap", action="store_true", help="overlap_grad_reduce on vs off on 2 ranks")
    parser.add_argument("--micro", type=int, default=0, help="with --overlap: the micro-batch (0: batch / 2)")
    parser.add_argument("--bucket-size", default="", help="with --overlap: distributed.bucket_size (default 25MB)")
    args = parser.parse_args()
    if args.overlap:
        print_overlap([measure_overlap(name, args.repeats, args.warmup, args.micro, args.bucket_size) for name in args.models],
                      args.repeats, args.warmup)
        return
    results = [measure(name, args.repeats, args.warmup) for name in args.models]
    print("| model | batch | 1 process x 2 threads: tokens/s | 2 ranks x 1 thread: tokens/s | ratio (2 ranks / 1) "
          "| rank 0 time in collectives |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        one = median([s["tokens_per_s"] for s in r["sides"][1]])
        two = median([s["tokens_per_s"] for s in r["sides"][2]])
        comm = median([s["comm_s"] / s["wall_s"] for s in r["sides"][2]])
        print(f"| {r['model']} | {r['batch']} | {one:.0f} | {two:.0f} | {two / one:.2f}x | {comm:.0%} of the run |")
    print(f"\n{args.repeats} runs of each side, alternating; medians. Measured steps: after {args.warmup} warm-up "
          f"steps. Micro-batch 1 on both sides (the same per-example work).")


if __name__ == "__main__":
    main()
