#!/usr/bin/env python3
"""trainer's training throughput under different run-time environments, the variants run alternately (the order
rotating every repetition) on the same config, data and machine: the fused kernels on and off
(TRAINER_FUSED_KERNELS=0), and the intra-op thread count and OpenMP wait policy (OMP_NUM_THREADS,
OMP_WAIT_POLICY; the torch wheel's OpenMP is libgomp, so KMP_* variables do nothing). Target
tokens/s over the steps after the warm-up, from the moments trainer logs each step (vs_hf.py's measurement),
medians over the repetitions, and the ratio to the first variant of each group. Prints Markdown tables.

    .venv/bin/python scripts/bench/runtime_env.py --parts fused threads [--models tiny-t5 tiny-qwen2] [--repeats 3]
"""
import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, TINY_MODELS, ensure_data, log, machine_notes, median, table  # noqa: E402
from vs_hf import LENGTHS, MODELS, model_dir, ours_config, run_ours, tokens_per_second  # noqa: E402

MODELS = dict(MODELS, **{"tiny-qwen2": dict(form="causal", batch=16, steps=20, warmup=3)})
PARTS = {
    # name: [(variant, environment)], the first variant is the baseline of the ratios
    "fused": [("composition (TRAINER_FUSED_KERNELS=0)", {"TRAINER_FUSED_KERNELS": "0", "OMP_NUM_THREADS": "1"}),
              ("fused kernels (default)", {"OMP_NUM_THREADS": "1"})],
    "threads": [("1 thread", {"OMP_NUM_THREADS": "1"}),
                ("2 threads (libgomp default wait)", {"OMP_NUM_THREADS": "2"}),
                ("2 threads, OMP_WAIT_POLICY=passive", {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "passive"}),
                ("2 threads, OMP_WAIT_POLICY=active", {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "active"})],
}


def one_run(tmp, name, precision, env, steps=None):
    spec = dict(MODELS[name], **({"steps": steps} if steps else {}))
    data = ensure_data(spec["form"], max(400, spec["batch"] * (spec["steps"] + 2)))
    out_dir = os.path.join(tmp, "out")
    model = os.path.join(ROOT, TINY_MODELS[spec["form"]]) if name.startswith("tiny") else model_dir(name)
    config = ours_config(os.path.join(tmp, "config.json"), model, spec["form"], data, out_dir,
                         spec["batch"], spec["batch"], spec["steps"], LENGTHS[spec["form"]],
                         precision={"mode": precision})
    saved = {key: os.environ.get(key) for key in ("TRAINER_FUSED_KERNELS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                                  "GOMP_SPINCOUNT")}
    for key in saved:
        os.environ.pop(key, None)
    os.environ.update(env)
    try:
        run, steps = run_ours(config)
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
    if run.returncode != 0:
        raise SystemExit(f"trainer failed ({name}, {env}):\n{run.text()[-2000:]}")
    return tokens_per_second(steps, spec["warmup"]), steps[-1][2] if steps else None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["fused", "threads"], choices=sorted(PARTS))
    parser.add_argument("--models", nargs="+", default=["tiny-t5", "tiny-qwen2"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, help="steps per run (default: vs_hf.py's per model; 3 are warm-up)")
    args = parser.parse_args()
    for part in args.parts:
        variants = PARTS[part]
        rows = []
        for name in args.models:
            for precision in args.precisions if part == "fused" else args.precisions[:1]:
                speeds = {variant: [] for variant, _ in variants}
                losses = {variant: None for variant, _ in variants}
                with tempfile.TemporaryDirectory() as tmp:
                    for r in range(args.repeats):
                        order = variants[r % len(variants):] + variants[:r % len(variants)]
                        for variant, env in order:
                            speed, loss = one_run(tmp, name, precision, env, args.steps)
                            speeds[variant].append(speed)
                            losses[variant] = loss
                            log(f"{part} {name} {precision} {variant}: {speed:.0f} tokens/s, final loss {loss}")
                base = median(speeds[variants[0][0]])
                for variant, _ in variants:
                    tps = median(speeds[variant])
                    rows.append([name, precision, variant, f"{tps:.0f}", f"{tps / base:.3f}x", f"{losses[variant]:.4f}"])
        print(f"\n### {part}\n")
        print(machine_notes())
        print(f"{args.repeats} repetitions per variant, alternating; medians\n")
        print(table(["model", "precision", "variant", "target tokens/s", "vs first", "final loss"], rows))


if __name__ == "__main__":
    main()
