#!/usr/bin/env python3
"""ZeRO-1 (distributed.shard_optimizer): optimizer-state bytes per rank, sharded against unsharded. One optimizer
step of each model, once in one process (every unsharded rank holds this much) and on N = 2 and 3 ranks with
sharded state (`trainer launch`, Gloo on 127.0.0.1). The bytes are what each rank's checkpoint part holds (the
optimizer state tensors it keeps; the RNG state left out), read from the safetensors headers. Goal: each rank
1/N of the unsharded state within 5%.

Bytes do not depend on the machine's load (the step's time does, and is not measured here).

    .venv/bin/python scripts/bench/zero1_state.py [--models t5-60m qwen2-100m] [--ranks 2 3]
"""
import argparse
import json
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BENCH_DIR, TRAINER, ensure_data, fresh_dir, log, machine_notes, run_measured, table  # noqa: E402
from vs_hf import MODELS, model_dir, ours_config  # noqa: E402

SHORT = {"seq2seq": {"max_input_length": 32, "max_target_length": 32}, "causal": {"max_length": 64}}


def state_bytes(path):
    """Bytes of the tensors in a safetensors file, without the RNG state."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
               if k != "__metadata__" and not k.startswith("rng."))


def run(config_path, ranks, sharded):
    with open(config_path) as f:
        out_dir = json.load(f)["checkpoint"]["output_dir"]
    fresh_dir(out_dir)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    args = ["--config", config_path, "--set", f"distributed.shard_optimizer={'true' if sharded else 'false'}"]
    command = [TRAINER] + args if ranks == 1 else [TRAINER, "launch", "--nproc-per-node", str(ranks), "--"] + args
    result = run_measured(command, env=env, timeout=3600)
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed (exit {result.returncode}):\n" + result.text()[-3000:])
    checkpoint = os.path.join(out_dir, "checkpoint-1")
    with open(os.path.join(checkpoint, "train_state.json")) as f:
        files = json.load(f).get("optimizer_files", ["optimizer.safetensors"])
    return [state_bytes(os.path.join(checkpoint, name)) for name in files]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["t5-60m", "qwen2-100m"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 3])
    args = parser.parse_args()
    rows = []
    for name in args.models:
        m = MODELS[name]
        work = fresh_dir(os.path.join(BENCH_DIR, "runs", "zero1", name))
        config = ours_config(os.path.join(work, "config.json"), model_dir(name), m["form"], ensure_data(m["form"], 256),
                             os.path.join(work, "out"), 6, 1, 1, SHORT[m["form"]],
                             evaluation={"every_steps": 0, "sample_prompts": []})
        log(f"{name}: one process")
        (whole,) = run(config, 1, False)
        for n in args.ranks:
            log(f"{name}: {n} ranks, sharded")
            parts = run(config, n, True)
            ideal = whole / n
            worst = max(abs(p / ideal - 1) for p in parts)
            rows.append([name, n, f"{whole / 2**20:.1f}", f"{ideal / 2**20:.1f}",
                         " / ".join(f"{p / 2**20:.1f}" for p in parts), f"{sum(parts) / 2**20:.1f}",
                         f"{100 * worst:.1f}%", "yes" if worst <= 0.05 else "no"])
    print(machine_notes())
    print(table(["model", "ranks N", "unsharded MiB per rank", "1/N MiB", "sharded MiB per rank", "sum MiB",
                 "largest deviation from 1/N", "within 5%"], rows))


if __name__ == "__main__":
    main()
