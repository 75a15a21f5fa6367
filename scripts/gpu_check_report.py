"""The second half of scripts/gpu-check: runs the CTest tests labelled `gpu` and one throughput run per model on
the built trainer, and prints one table. Exit status 0 only when every row passed (a skipped test is no pass:
it means the machine has no usable GPU, which is what the check is there to find out).

Uses the Python of the CUDA PyTorch that trainer was built against (for the card's name and the gpu tests'
snapshot reader), and nothing from the network.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

# Dense bf16 tensor-core peaks from the vendors' data sheets (TFLOP/s, no sparsity). The longest name that the
# card's name contains wins; TRAINER_GPU_BF16_TFLOPS overrides (a card not listed, or a power-capped one).
BF16_PEAK_TFLOPS = {
    "B200": 2250.0,
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 80GB HBM3": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 756.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "A40": 150.0,
    "A10G": 70.0,
    "A10": 125.0,
    "RTX 6000 Ada": 364.0,
    "RTX A6000": 155.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "V100": 0.0,  # no bf16 tensor cores
    "T4": 0.0,
}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def gpu_info() -> tuple[str, float | None]:
    """The first visible card's name and its bf16 peak in FLOP/s (None when unknown), or ("", None)."""
    try:
        import warnings  # noqa: PLC0415

        warnings.filterwarnings("ignore")  # e.g. "Failed to initialize NumPy" from a torch without numpy
        import torch  # noqa: PLC0415 (only this helper needs it)

        if not torch.cuda.is_available():
            return "", None
        name = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 (no torch, no driver: no GPU as far as this check goes)
        return "", None
    override = os.environ.get("TRAINER_GPU_BF16_TFLOPS")
    if override:
        return name, float(override) * 1e12
    matches = [key for key in BF16_PEAK_TFLOPS if key.lower() in name.lower()]
    if not matches:
        return name, None
    peak = BF16_PEAK_TFLOPS[max(matches, key=len)]
    return name, peak * 1e12 if peak > 0 else None


def run_gpu_tests(build_dir: Path, rows: list[list[str]]) -> bool:
    junit = build_dir.resolve() / "gpu-tests.xml"  # ctest takes a relative path from the build directory
    junit.unlink(missing_ok=True)
    ctest = subprocess.run(
        ["ctest", "--test-dir", str(build_dir), "-L", "gpu", "--output-on-failure", "--output-junit", str(junit)],
        capture_output=True, text=True, check=False)
    (build_dir / "gpu-tests.log").write_text(ctest.stdout + ctest.stderr)
    if not junit.exists():
        rows.append(["gpu tests", "FAIL", "ctest wrote no results; see " + str(build_dir / "gpu-tests.log")])
        return False
    cases = ET.parse(junit).getroot().iter("testcase")
    ok = True
    count = 0
    for case in cases:
        count += 1
        name = case.get("name", "?")
        out = "".join(node.text or "" for node in case.iter("system-out"))
        if case.find("failure") is not None or case.get("status") == "fail":
            ok = False
            reason = next((line.strip() for line in out.splitlines() if "Failure" in line or "error" in line.lower()),
                          "failed")
            rows.append([name, "FAIL", reason[:100] + f" (log: {build_dir / 'gpu-tests.log'})"])
        elif case.find("skipped") is not None or case.get("status") in ("notrun", "disabled"):
            ok = False
            found = re.search(r"Skipped\n(.*)", out)
            rows.append([name, "SKIP", found.group(1).strip() if found else "skipped"])
        else:
            rows.append([name, "PASS", f"{float(case.get('time', '0')):.1f} s"])
    if count == 0:
        rows.append(["gpu tests", "FAIL", "no test labelled gpu was found in " + str(build_dir)])
        return False
    return ok


def throughput(build_dir: Path, config: str, steps: int, precision: str, peak: float | None,
               rows: list[list[str]]) -> bool:
    label = "throughput " + Path(config).stem
    with tempfile.TemporaryDirectory(prefix="trainer-gpu-check-") as tmp:
        command = [str(build_dir / "trainer"), "--config", config,
                   "--set", "device.type=cuda", "--set", "memory.limit=0", "--set", f"precision.mode={precision}",
                   "--set", f"training.max_steps={steps}", "--set", "evaluation.every_steps=0",
                   "--set", "evaluation.sample_prompts=[]", "--set", "checkpoint.every_steps=0",
                   "--set", "checkpoint.save_final=false", "--set", f"checkpoint.output_dir={tmp}/run"]
        run = subprocess.run(command, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            last = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
            rows.append([label, "FAIL", f"exit {run.returncode}: {last[:100]}"])
            return False
        records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    steps_seen = [r for r in records if "tokens_per_s" in r]
    # The first fifth of the steps warm up (allocator, kernel selection) and are left out.
    timed = steps_seen[len(steps_seen) // 5:] or steps_seen
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in timed) if timed else 0.0
    peak_memory = max((r.get("memory_peak", 0) for r in steps_seen), default=0)
    found = re.search(r"\((\d+) parameters", run.stdout + run.stderr)
    parameters = int(found.group(1)) if found else 0
    flops = 6.0 * parameters * tokens_per_s  # forward + backward per trained token
    share = f"{100.0 * flops / peak:.3g}% of bf16 peak" if peak else "bf16 peak unknown (TRAINER_GPU_BF16_TFLOPS)"
    rows.append([label, "PASS", f"{tokens_per_s:,.0f} tokens/s, peak {human_bytes(peak_memory)}, "
                                f"{flops / 1e12:.3f} TFLOP/s model ({parameters:,} parameters), {share}"])
    return tokens_per_s > 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--build-dir", type=Path, required=True)
    parser.add_argument("--row", action="append", default=[], help="NAME|STATUS|DETAIL rows to print first")
    parser.add_argument("--config", action="append", default=[], help="a trainer config for a throughput row")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precision", default="bf16-mixed")
    args = parser.parse_args()

    rows = [row.split("|", 2) for row in args.row]
    ok = all(row[1] == "PASS" for row in rows)
    name, peak = gpu_info()
    if name:
        rows.append(["GPU", "PASS", name + (f", bf16 peak {peak / 1e12:.0f} TFLOP/s" if peak else "")])
    else:
        rows.append(["GPU", "FAIL", "no NVIDIA GPU visible to this Python's torch (torch.cuda.is_available() is "
                                    "False): the gpu tests skip and no throughput can be measured"])
        ok = False
    ok = run_gpu_tests(args.build_dir, rows) and ok
    for config in args.config:
        if name:
            ok = throughput(args.build_dir, config, args.steps, args.precision, peak, rows) and ok
        else:
            rows.append(["throughput " + Path(config).stem, "SKIP", "no GPU"])

    width = max(len(row[0]) for row in rows)
    print()
    print(f"{'check':<{width}}  result  detail")
    print(f"{'-' * width}  ------  {'-' * 60}")
    for check, status, detail in rows:
        print(f"{check:<{width}}  {status:<6}  {detail}")
    print()
    print("gpu-check: " + ("PASSED" if ok else "FAILED (see the rows above that are not PASS)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
