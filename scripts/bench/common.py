"""What the benchmarks in scripts/bench share: paths, demo data and model directories (cached under build/bench,
which git ignores), running a command while timestamping its output lines and taking its peak RSS, medians, and
Markdown tables."""
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# TRAINER_BINARY: a copy of the binary to measure, so that rebuilding build/trainer during a long run does not
# change what is measured half way.
TRAINER = os.environ.get("TRAINER_BINARY") or os.path.join(ROOT, "build", "trainer")
PY = sys.executable
BENCH_DIR = os.path.join(ROOT, "build", "bench")
HF_STACK = os.path.join(ROOT, "scripts", "bench", "hf_stack.py")
CONFIGS = {"seq2seq": "configs/tiny-t5.json", "causal": "configs/tiny-qwen2.json"}
TINY_MODELS = {"seq2seq": "configs/models/tiny-t5", "causal": "configs/models/tiny-qwen2"}


def log(message):
    print(message, file=sys.stderr, flush=True)


def ensure_data(form, records, seed=1):
    """Recipe JSONL from scripts/make_demo_data.py, written once and kept under build/bench."""
    path = os.path.join(BENCH_DIR, "data", f"recipes-{form}-{records}-seed{seed}.jsonl")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        subprocess.run([PY, os.path.join(ROOT, "scripts", "make_demo_data.py"), "--form", form, "--records",
                        str(records), "--seed", str(seed), "--out", path + ".part"], check=True)
        os.replace(path + ".part", path)
    return path


class Run:
    """One finished command: exit code, its output lines with the seconds since start, peak RSS, wall time."""

    def __init__(self, returncode, lines, peak_rss, seconds):
        self.returncode, self.lines, self.peak_rss, self.seconds = returncode, lines, peak_rss, seconds

    def text(self):
        return "\n".join(line for _, line in self.lines)

    def first(self, predicate):
        """(seconds, line) of the first line for which predicate(line) holds, else None."""
        return next(((t, line) for t, line in self.lines if predicate(line)), None)


def run_measured(command, env=None, preexec_fn=None, timeout=None, echo=False):
    """Runs `command` from the repository root under GNU time, reads its stdout and stderr (merged) line by line
    and timestamps each line on arrival. The peak RSS is the command's own high-water mark, as GNU time reports
    it: measuring from this Python process would count its RSS too, since a forked child inherits it. Without
    /usr/bin/time (a bare GPU machine) the command runs as it is and the peak RSS is 0."""
    gnu_time = os.path.exists("/usr/bin/time")
    with tempfile.NamedTemporaryFile("r", suffix=".time") as report:
        start = time.perf_counter()
        wrapper = ["/usr/bin/time", "-f", "%M", "-o", report.name] if gnu_time else []
        # With a timeout the command gets a process group of its own, and the watchdog kills the group: killing
        # GNU time alone would leave the command running, holding the pipe open until it ends.
        process = subprocess.Popen([*wrapper, *command], cwd=ROOT, env=env,
                                   preexec_fn=preexec_fn, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, bufsize=1, errors="replace", start_new_session=bool(timeout))

        def kill_group():
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        watchdog = threading.Timer(timeout, kill_group) if timeout else None
        if watchdog:
            watchdog.start()
        lines = []
        for line in process.stdout:
            lines.append((time.perf_counter() - start, line.rstrip("\n")))
            if echo:
                log("    " + line.rstrip("\n"))
        returncode = process.wait()
        if watchdog:
            watchdog.cancel()
        seconds = time.perf_counter() - start
        report.seek(0)
        fields = report.read().split()
        peak_rss = int(fields[-1]) * 1024 if fields and fields[-1].isdigit() else 0
    return Run(returncode, lines, peak_rss, seconds)


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def write_json(path, value):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(value, f, indent=1)


def fresh_dir(path):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def machine_notes():
    """One line about the machine and its load right now (other jobs share it)."""
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch  # only for its version and thread count
    return (f"{datetime.date.today().isoformat()}, {platform.node() or 'host'}: {os.cpu_count()} x {cpu}, "
            f"{mem:.0f} GiB RAM, {platform.system()} {platform.release()}; torch {torch.__version__} "
            f"({torch.get_num_threads()} threads); load average {load}")


def load_average():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def table(header, rows):
    """A Markdown table; numbers right-aligned."""
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(out)


def ratio(ours, theirs, digits=2):
    if not ours or not theirs:
        return "n/a"
    return f"{ours / theirs:.{digits}f}x"
