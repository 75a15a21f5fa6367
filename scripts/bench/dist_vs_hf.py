#!/usr/bin/env python3
"""Data parallelism against transformers' Trainer under torchrun (issue 18): the same work run by

  (a) `trainer launch --nproc-per-node N -- --config C`            (N ranks x 1 thread, Gloo on 127.0.0.1)
  (b) `torchrun --nproc-per-node N scripts/bench/hf_stack.py train`  (Trainer / Seq2SeqTrainer, its DDP on Gloo)

alternately (the order flipping each repetition), on this machine's CPU. Prints a Markdown table: target tokens/s
of each side over the steps after --warmup, their ratio, the loss at the first and the last step of each side, and
the peak RSS of every rank (and of the launcher / torchrun's agent), and the time from the launch to the end of the
first step (start-up, loading, the first step).

    .venv/bin/python scripts/bench/dist_vs_hf.py [--trainer /path/to/trainer] [--models tiny-t5 tiny-qwen2]
        # also: --models t5-60m qwen2-100m (vs_hf.py's shapes; use e.g. --batch 8 --steps 6 --warmup 2)
        [--repeats 3] [--steps 30] [--warmup 5] [--batch 16] [--timeout 900]
        [--packing]   # also (a) with data.packing=true: the same examples per step in fewer rows, a row of its own

Same work on both sides, and checked: the model directory's config.json (random init on each side), the same JSONL
(scripts/make_demo_data.py), the same tokenizer files, fp32, the global batch --batch split into equal contiguous
halves (trainer: training.batch_size is the global batch, micro_batch_size its per-rank share, one micro-batch per
rank; HF: per_device_train_batch_size = batch / N, accelerate hands rank r the r-th per-device batch of each
step), the same maximum lengths, AdamW lr 1e-3 with linear decay and clipping at 1.0, the config's dropout, data in
file order (trainer data.shuffle=false, HF train_sampling_strategy="sequential"). The target tokens of each step
are counted on each side (trainer: metrics.jsonl; HF: from the tokenized rows) and must agree step by step. Both
sides log a loss averaged over the global batch (trainer: summed over target tokens of the whole batch; HF: the
ranks' losses averaged), so the curves agree within the noise of the different random inits.

Environment of every rank on both sides: OMP_NUM_THREADS=1, GLOO_SOCKET_IFNAME=lo, MASTER_ADDR 127.0.0.1 (torchrun
--master-addr, trainer launch's own), a fresh port each run. Every run is
killed outright after --timeout seconds (every process seen below the command: torchrun puts its ranks in sessions
of their own), and any run still alive when this script exits (an error, Ctrl-C, SIGTERM) is killed too. Peak RSS: each process's VmHWM from /proc, polled every 0.2 s until it exits (the last reading, so a
rise in its final 0.2 s could be missed); ranks are told apart by their RANK variable.
"""
import argparse
import atexit
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (BENCH_DIR, HF_STACK, PY, ROOT, TINY_MODELS, TRAINER, ensure_data, fresh_dir,  # noqa: E402
                    load_average, log, machine_notes, median, ratio, table, write_json)
from vs_hf import LR, SEED, hf_spec, ours_config, trainer_steps  # noqa: E402
from vs_hf import model_dir as vs_hf_model_dir  # noqa: E402

MIB = 2**20
HF_STEP = re.compile(r"^BENCH step (\d+) loss (\S+) tokens (\d+)")
MICRO_LINE = re.compile(r"micro-batch (\d+)")
# the end summary's per-rank figures: "    rank 0: 1.18 GiB, 2.5 s" (peak memory, time in collectives)
COMM_LINE = re.compile(r"^\s*rank 0: [\d.]+ [KMG]?i?B, ([\d.]+) s(?:, \d+ records tokenized)?$", re.M)
# name: data form, model directory, maximum lengths (no record of the demo data is cut at these)
MODELS = {
    "tiny-t5": dict(form="seq2seq", path=TINY_MODELS["seq2seq"],
                    lengths={"max_input_length": 256, "max_target_length": 256}),
    "tiny-qwen2": dict(form="causal", path=TINY_MODELS["causal"], lengths={"max_length": 512}),
    # vs_hf.py's larger shapes (written under build/bench/models on first use): minutes per run on 2 loaded cores
    "t5-60m": dict(form="seq2seq", path=None, lengths={"max_input_length": 256, "max_target_length": 256}),
    "qwen2-100m": dict(form="causal", path=None, lengths={"max_length": 512}),
}
LIVE = {}  # the runs in progress: root pid -> {pid: start time} of every process seen below it


def kill_tree(root):
    """SIGKILL to every process seen in the run of `root` (and found below it now) that is still the process seen
    (same start time: a reused pid is left alone)."""
    seen = LIVE.pop(root, {})
    seen.update(descendants(root))
    for pid, started in seen.items():
        stat = proc_stat(pid)
        if stat and stat[1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def kill_live():
    for root in list(LIVE):
        kill_tree(root)


def stop(code):
    """A signal handler: kill every run in progress, then exit with `code`."""
    def handler(number, frame):
        log(f"signal {number}: killing the runs in progress")
        kill_live()
        os._exit(code)
    return handler


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_stat(pid):
    """(ppid, start time in clock ticks) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the name: state ppid pgrp session ...
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(root):
    """{pid: start time} of `root` and every process below it (torchrun starts its ranks in sessions of their
    own, so the process tree is followed, not the session)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := proc_stat(entry)):
            children.setdefault(stat[0], []).append((int(entry), stat[1]))
    found, queue = {}, [root]
    while queue:
        for pid, started in children.get(queue.pop(), []):
            found[pid] = started
            queue.append(pid)
    if (stat := proc_stat(root)):
        found[root] = stat[1]
    return found


def process_info(pid):
    """(RANK or None, VmHWM bytes, command) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            hwm = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    rank = env.get(b"RANK")
    return int(rank) if rank and rank.isdigit() else None, hwm, command


class Run:
    def __init__(self, returncode, lines, peaks, seconds, timed_out):
        self.returncode, self.lines, self.peaks, self.seconds, self.timed_out = \
            returncode, lines, peaks, seconds, timed_out

    def text(self):
        return "\n".join(line for _, line in self.lines)


def run_group(command, env, timeout):
    """Runs `command` from the repository root; timestamps its output lines (stdout and stderr merged), polls the
    peak RSS of every process below it, and kills all of them after `timeout` seconds or when it ends."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1, errors="replace")
    LIVE[process.pid] = {}
    peaks, done, timed_out = {}, threading.Event(), []

    def poll():
        while not done.is_set():
            found = descendants(process.pid)
            LIVE.get(process.pid, {}).update(found)
            for pid in found:
                if (info := process_info(pid)):
                    rank, hwm, cmd = info
                    peaks[pid] = (rank if rank is not None else peaks.get(pid, (None,))[0],
                                  max(hwm, peaks.get(pid, (None, 0))[1]), cmd)
            done.wait(0.2)

    def expire():
        timed_out.append(True)
        kill_tree(process.pid)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    watchdog = threading.Timer(timeout, expire)
    watchdog.start()
    lines = []

    def read():
        for line in process.stdout:
            lines.append((time.perf_counter() - start, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while reader.is_alive():  # the main thread waits in short slices, so that a signal's handler runs at once
            reader.join(0.5)
        returncode = process.wait()
    finally:
        watchdog.cancel()
        done.set()
        poller.join()
        kill_tree(process.pid)  # whatever outlived the command's own process
    return Run(returncode, lines, peaks, time.perf_counter() - start, bool(timed_out))


def rank_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TOKENIZERS_PARALLELISM="false")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def rank_peaks(run):
    """[peak RSS of rank 0, rank 1, ...], and the largest non-rank process's (the launcher / torchrun's agent)."""
    ranks, others = {}, 0
    for rank, hwm, _ in run.peaks.values():
        if rank is None:
            others = max(others, hwm)
        else:
            ranks[rank] = max(hwm, ranks.get(rank, 0))
    return [ranks[r] for r in sorted(ranks)], others


def run_ours(trainer, config_path, nproc, timeout):
    """Returns the run and its steps [(t, tokens, loss)] (rank 0's step lines, metrics.jsonl's tokens)."""
    with open(config_path) as f:
        config = json.load(f)
    metrics = os.path.join(config["checkpoint"]["output_dir"], "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    command = [trainer, "launch", "--nproc-per-node", str(nproc), "--master-port", str(free_port()), "--",
               "--config", config_path]
    run = run_group(command, rank_env(), timeout)
    return run, trainer_steps(run, metrics)


def run_hf(spec, nproc, timeout):
    """torchrun with hf_stack.py train on every rank, a fresh datasets cache; returns the run and its steps."""
    spec_path = spec["output_dir"] + ".spec.json"
    write_json(spec_path, spec)
    torchrun = os.path.join(os.path.dirname(PY), "torchrun")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(rank_env(), HF_DATASETS_CACHE=cache, HF_HOME=cache)
        command = [torchrun, "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
                   str(free_port()), HF_STACK, "train", spec_path]
        run = run_group(command, env, timeout)
    steps = [(t, int(m.group(3)), float(m.group(2))) for t, line in run.lines if (m := HF_STEP.match(line))]
    return run, steps


def tokens_per_second(steps, warmup):
    if len(steps) <= warmup:
        return None
    return sum(tokens for _, tokens, _ in steps[warmup:]) / (steps[-1][0] - steps[warmup - 1][0])


def fail(side, name, run, steps, expected):
    tail = "\n".join(line for _, line in run.lines[-25:])
    why = "timed out" if run.timed_out else f"exit {run.returncode}"
    sys.exit(f"{side} on {name} failed ({why}, {len(steps)} of {expected} steps):\n{tail}")


def measure(name, args):
    m = MODELS[name]
    nproc, steps = args.nproc, args.steps + args.warmup
    if args.batch % nproc:
        sys.exit(f"--batch {args.batch} is not divisible by --nproc {nproc}")
    path = os.path.join(ROOT, m["path"]) if m["path"] else vs_hf_model_dir(name)
    data = ensure_data(m["form"], max(4096, steps * args.batch))
    work = fresh_dir(os.path.join(BENCH_DIR, "runs", "dist_vs_hf", name))
    config = ours_config(os.path.join(work, "ours.json"), path, m["form"], data, os.path.join(work, "ours"),
                         args.batch, args.batch // nproc, steps, m["lengths"],
                         logging={"every_steps": 1, "progress": "plain", "tensorboard": False})
    spec = hf_spec(path, m["form"], data, os.path.join(work, "hf"), args.batch // nproc, steps, m["lengths"],
                   ddp_cpu=True)
    configs = {"ours": config}
    if args.packing:  # the same examples in every step, packed: the same weights as padded rows (tests say so)
        configs["packed"] = ours_config(os.path.join(work, "packed.json"), path, m["form"], data,
                                        os.path.join(work, "packed"), args.batch, args.batch // nproc, steps,
                                        m["lengths"], data_options={"packing": True},
                                        logging={"every_steps": 1, "progress": "plain", "tensorboard": False})
    sides = list(configs) + ["hf"]
    result = {"model": name, "hf": [], "load": [], **{side: [] for side in configs}}
    for r in range(args.repeats):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            load = load_average()
            result["load"].append(load)
            if side in configs:
                run, per_step = run_ours(args.trainer, configs[side], nproc, args.timeout)
            else:
                run, per_step = run_hf(spec, nproc, args.timeout)
            if run.returncode != 0 or len(per_step) != steps:
                fail(side, name, run, per_step, steps)
            ranks, other = rank_peaks(run)
            micro = MICRO_LINE.findall(run.text()) if side in configs else []
            comm = COMM_LINE.search(run.text()) if side in configs else None
            sample = {"tokens_per_s": tokens_per_second(per_step, args.warmup), "tokens": [s[1] for s in per_step],
                      "losses": [s[2] for s in per_step], "rank_rss": ranks, "other_rss": other,
                      "wall_s": run.seconds, "first_step_s": per_step[0][0], "load": load, "micro": micro[:1],
                      "comm_s": float(comm.group(1)) if comm else None}
            result[side].append(sample)
            log(f"{name} rep {r + 1}/{args.repeats} {side}: {sample['tokens_per_s']:.0f} tokens/s, loss "
                f"{sample['losses'][0]:.3f} -> {sample['losses'][-1]:.3f}, rank RSS "
                f"{'/'.join(f'{x / MIB:.0f}' for x in ranks)} MiB (+{other / MIB:.0f}), wall {run.seconds:.0f} s, "
                f"load {load:.1f}" + (f", rank 0 in collectives {sample['comm_s']:.1f} s" if comm else ""))
    return result


def summary_row(result, args, ours="ours"):
    o, h = result[ours], result["hf"]
    same = all(x["tokens"] == o[0]["tokens"] for x in o + h)
    model = result["model"] + (", trainer with data.packing" if ours == "packed" else "")
    cells = [model, f"{args.nproc} x {args.batch // args.nproc} = {args.batch}", f"{args.steps} (+{args.warmup})"]
    rates = {side: median([x["tokens_per_s"] for x in result[side]]) for side in (ours, "hf")}
    cells += [f"{rates[ours]:,.0f}", f"{rates['hf']:,.0f}", ratio(rates[ours], rates["hf"])]
    # T5ForConditionalGeneration averages its loss over the rank's own tokens and ignores num_items_in_batch, yet
    # accepts **kwargs, so transformers' Trainer (average_tokens_across_devices) multiplies it by the number of
    # ranks as if it were a sum over the global tokens: the logged loss (and the gradient) is N x the mean. Shown
    # divided by N, with the logged value after it.
    scale = args.nproc if MODELS[result["model"]]["form"] == "seq2seq" else 1
    for index in (0, -1):
        ours_loss, hf_loss = median([x["losses"][index] for x in o]), median([x["losses"][index] for x in h])
        hf_text = f"{hf_loss / scale:.3f}" + (f" (logged {hf_loss:.3f})" if scale != 1 else "")
        cells.append(f"{ours_loss:.3f} / {hf_text}")
    for side in (ours, "hf"):
        per_rank = [median([x["rank_rss"][i] for x in result[side]]) for i in range(args.nproc)]
        other = median([x["other_rss"] for x in result[side]])
        cells.append(" / ".join(f"{v / MIB:,.0f}" for v in per_rank) + f" (+{other / MIB:,.0f})")
    cells.append(" / ".join(f"{median([x['first_step_s'] for x in result[side]]):.1f}" for side in (ours, "hf")))
    comm = [x["comm_s"] for x in o if x["comm_s"] is not None]
    cells += ["yes" if same else "NO", f"{median(comm):.1f}" if comm else "",
              f"{min(result['load']):.1f}-{max(result['load']):.1f}"]
    return cells


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", default=TRAINER, help="the binary to measure (default: $TRAINER_BINARY or "
                                                           "build/trainer)")
    parser.add_argument("--models", nargs="+", default=["tiny-t5", "tiny-qwen2"], choices=list(MODELS))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="the global batch")
    parser.add_argument("--steps", type=int, default=30, help="measured steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=900, help="seconds one run may take before it is killed")
    parser.add_argument("--packing", action="store_true",
                        help="also trainer with data.packing=true (the same examples per step, packed into fewer "
                             "rows: the same weights as padded rows), a row of its own")
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()
    args.trainer = os.path.abspath(args.trainer)
    if not os.access(args.trainer, os.X_OK):
        sys.exit(f"--trainer {args.trainer}: not an executable (build it: cmake --build build)")
    atexit.register(kill_live)
    for number, code in ((signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)):
        signal.signal(number, stop(code))  # SIGINT too where a shell started this with SIGINT ignored
    notes = machine_notes()
    log(notes)
    try:
        results = [measure(name, args) for name in args.models]
    finally:
        kill_live()
    print(f"{args.nproc} ranks x 1 thread on each side, Gloo on 127.0.0.1; fp32, AdamW lr {LR:g}, seed {SEED}; "
          f"medians of {args.repeats} alternating repetitions\nbefore: {notes}\nafter: {machine_notes()}\n")
    print(table(["model", "ranks x per-rank batch = global", "steps (+warm-up)", "trainer tok/s", "HF tok/s",
                 "ratio", "loss step 1 trainer / HF", "loss last trainer / HF",
                 "trainer peak RSS MiB per rank (+launcher)", "HF peak RSS MiB per rank (+torchrun agent)",
                 "first step s trainer / HF",
                 "same tokens every step", "trainer rank 0 in collectives s", "load avg"],
                [summary_row(r, args, ours) for r in results for ours in ("ours", "packed") if ours in r]))
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
