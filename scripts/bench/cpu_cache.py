#!/usr/bin/env python3
"""The CPU allocator's cache of freed large blocks (memory/cpu_budget.h) on against off (TRAINER_CPU_CACHE=0), on
the throughput benchmark's trainer runs: t5-60m and qwen2-100m, fp32 and bf16-mixed, packed rows, the same
config both ways, the two sides alternating (the order swapped every repetition). Reports target tokens/s over the
steps after the warm-up (medians), the process's minor page faults and its peak RSS. The cache changes no result
(the same memory is handed out again; losses are printed to show it).

    .venv/bin/python scripts/bench/cpu_cache.py [--models t5-60m qwen2-100m] [--precision bf16-mixed] [--repeats 3]
"""
import argparse
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BENCH_DIR, ensure_data, fresh_dir, log, machine_notes, median, table  # noqa: E402
from vs_hf import LENGTHS, MODELS, model_dir, ours_config, run_ours, tokens_per_second  # noqa: E402

MIB = 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["t5-60m", "qwen2-100m"])
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16-mixed"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    rows = []
    for name in args.models:
        for precision in args.precision:
            m = MODELS[name]
            steps = m["steps"] + m["warmup"]
            path = model_dir(name)
            data = ensure_data(m["form"], max(4096, steps * m["batch"]))
            work = fresh_dir(os.path.join(BENCH_DIR, "runs", "cpu-cache", f"{name}-{precision}"))
            config = ours_config(os.path.join(work, "ours.json"), path, m["form"], data, os.path.join(work, "ours"),
                                 m["batch"], m["batch"], steps, LENGTHS[m["form"]], precision={"mode": precision},
                                 data_options={"packing": True})
            samples = {"on": [], "off": []}
            for r in range(args.repeats):
                for side in (["on", "off"] if r % 2 == 0 else ["off", "on"]):
                    if side == "off":
                        os.environ["TRAINER_CPU_CACHE"] = "0"
                    else:
                        os.environ.pop("TRAINER_CPU_CACHE", None)
                    before = resource.getrusage(resource.RUSAGE_CHILDREN)
                    run, per_step = run_ours(config, args.threads)
                    after = resource.getrusage(resource.RUSAGE_CHILDREN)
                    if run.returncode != 0:
                        sys.exit(f"{name} {precision} cache {side}: trainer exited {run.returncode}\n{run.text()[-3000:]}")
                    faults = after.ru_minflt - before.ru_minflt  # GNU time's and trainer's; time's own are few
                    sample = (tokens_per_second(per_step, m["warmup"]), faults, run.peak_rss, per_step[-1][2])
                    samples[side].append(sample)
                    log(f"{name} {precision} cache {side}: {sample[0]:.0f} tokens/s, {faults:,} minor faults, "
                        f"peak RSS {run.peak_rss / MIB:.0f} MiB, last loss {sample[3]:.4f}")
            os.environ.pop("TRAINER_CPU_CACHE", None)
            on = {k: median([s[i] for s in samples["on"]]) for i, k in enumerate(["tps", "faults", "rss"])}
            off = {k: median([s[i] for s in samples["off"]]) for i, k in enumerate(["tps", "faults", "rss"])}
            rows.append([f"{name}, {precision}", f"{off['tps']:.0f}", f"{on['tps']:.0f}", f"{on['tps'] / off['tps']:.3f}x",
                         f"{off['faults']:,.0f}", f"{on['faults']:,.0f}",
                         f"{off['rss'] / MIB:,.0f} / {on['rss'] / MIB:,.0f}",
                         f"{samples['off'][0][3]:.4f} / {samples['on'][0][3]:.4f}"])
    print(machine_notes())
    print(table(["run", "tokens/s, cache off", "cache on", "on / off", "minor faults off", "on",
                 "peak RSS MiB off / on", "last loss off / on"], rows))


if __name__ == "__main__":
    main()
