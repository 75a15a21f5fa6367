"""`scripts/gpu-check --full OUTDIR --rehearse`: the card run of issue 36 (the shipped jobs at their real sizes, trainer
against transformers' Trainer, evaluation by generation against Seq2SeqTrainer) with tiny shapes on the CPU, so that the script is known to work before card time is
spent. Every part must report real numbers in the table and the JSON, and the run must pass as a whole; a part that
breaks (an error, a missing figure, a timeout) fails this test.

Also: the wheels that carry transformers & co. to a card machine without network (`scripts/hf_kit.py`): made from
this Python's installed packages, only portable ones (pure Python or abi3), and `ensure` installs what a Python
lacks so that the imports work.
"""
import json
import pathlib
import resource
import subprocess
import sys
import time

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory, trainer_binary):
    out = tmp_path_factory.mktemp("gpu-full")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    run = subprocess.run([str(ROOT / "scripts/gpu-check"), "--full", str(out), "--rehearse", "--build-dir",
                          str(trainer_binary.parent), "--python", sys.executable],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    seconds = time.time() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(f"gpu-check --full --rehearse took {seconds:.0f} s, {cpu:.0f} s of CPU")
    return run, out, cpu


def test_the_rehearsal_passes_and_prints_one_table_with_every_part(rehearsal):
    run, out, _ = rehearsal
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "gpu-check --full: PASSED" in run.stdout
    table = run.stdout
    for number in range(1, 7):
        assert f"\n{number} " in table, f"part {number} missing from the table:\n{table}"
    for file in ("gpu-full.json", "gpu-full.md", "gpu-full.log"):
        assert (out / file).stat().st_size > 0, file
    markdown = (out / "gpu-full.md").read_text()
    assert markdown.count("| PASS |") >= 10 and "| FAIL |" not in markdown and "TIMEOUT" not in markdown


def test_every_part_reports_real_figures(rehearsal):
    _, out, _ = rehearsal
    results = json.loads((out / "gpu-full.json").read_text())
    parts = {int(k): v for k, v in results["parts"].items()}
    assert sorted(parts) == [1, 2, 3, 4, 5, 6]
    assert all(p["status"] == "PASS" for p in parts.values()), {k: p["status"] for k, p in parts.items()}

    def jobs(number):
        return [c for c in parts[number]["checks"].values() if "per_s" in c]

    # Parts 1, 2 and 5: the shipped jobs' figures, read from trainer's metrics.jsonl, log and `trainer plan`.
    shipped = jobs(1) + jobs(2) + jobs(5)
    assert len(shipped) == 5, parts
    for job in shipped:
        assert job["micro_batch"] >= 1 and job["per_s"] > 0 and job["peak_bytes"] > 0, job
        # the plan's figure at the probed micro-batch (the tiny CLIP's measured peak is a tenth of its estimate)
        assert job["plan_peak_bytes"] > 0, job
        assert job["checkpoint_s"] is not None and job["checkpoint_s"] >= 0 and job["checkpoint_size"], job
        assert job["steps"] >= 2 and job["parameters"] > 0, job
    assert {job["unit"] for job in jobs(5)} == {"images", "pairs"}
    assert parts[2]["checks"]["7B base"]["bytes"] > 0
    # Part 3: the capped run shrank at the long batch and ended at the uncapped run's loss with the same tokens.
    oom = parts[3]["checks"]["7B out-of-memory"]
    assert oom["adaptations"] and oom["same_tokens"] and oom["relative_loss_difference"] <= 0.01, oom
    assert oom["peak_before"] < oom["cap_bytes"] < oom["peak_at"], oom
    # Part 4: trainer against HF as users run it (Qwen2) and with its best options (T5; on a card both models get
    # both): ratios of tokens/s and peak.
    rows = [c for c in parts[4]["checks"].values() if "ratio" in c]
    assert len(rows) == 2, parts[4]
    for row in rows:
        assert row["ours_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0 and row["ratio"] > 0, row
        assert row["ours_peak"] > 0 and row["hf_peak"] > 0, row
    assert any(row["hf_options"].get("group_by_length") for row in rows)
    assert all(row["same_tokens"] for row in rows if not row["hf_options"])  # padded HF: the same examples
    # Part 6: evaluation by generation against Seq2SeqTrainer, both models, greedy and beams; in fp32 on the CPU
    # greedy answers agree.
    rows = [c for c in parts[6]["checks"].values() if "ratio" in c]
    assert sorted((row["model"], row["decoding"]) for row in rows) == [
        ("tiny qwen2", "beams 4"), ("tiny qwen2", "greedy"), ("tiny t5", "beams 4"), ("tiny t5", "greedy")], parts[6]
    for row in rows:
        assert row["ratio"] > 0 and row["trainer_cpu"] > 0 and row["transformers_cpu"] > 0, row
        if row["decoding"] == "greedy":
            assert row["same_answers"] == row["examples"], row


def test_hf_kit_carries_portable_wheels_and_installs_what_a_python_lacks(tmp_path):
    import hf_kit
    kit = tmp_path / "kit"
    build = subprocess.run([sys.executable, str(ROOT / "scripts/hf_kit.py"), "build", str(kit)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    wheels = sorted(kit.glob("*.whl"))
    names = {w.name.split("-")[0].lower() for w in wheels}
    assert {"transformers", "peft", "accelerate", "datasets", "safetensors", "tokenizers"} <= names, names
    assert all(hf_kit.portable(w.name[:-4].split("-", 2)[2]) for w in wheels), [w.name for w in wheels]
    assert sum(w.stat().st_size for w in wheels) < hf_kit.BUDGET_BYTES
    assert "numpy" in (kit / "MACHINE.txt").read_text()  # compiled for one Python: the machine's own
    # bitsandbytes' CUDA 13 libraries, for QLoRA on a card without bitsandbytes (part 2 points TRAINER_BITSANDBYTES there)
    libraries = sorted(p.name for p in (kit / "bitsandbytes").glob("*.so"))
    assert libraries == ["libbitsandbytes_cuda130.so", "libbitsandbytes_cuda132.so"], libraries
    assert sum(w.stat().st_size for w in wheels) + sum(
        p.stat().st_size for p in (kit / "bitsandbytes").glob("*.so")) < hf_kit.BUDGET_BYTES
    note, path = hf_kit.ensure(kit, tmp_path / "site", sys.executable, ["transformers", "datasets"])
    assert path == "" and "the machine's Python has transformers" in note, note
    note, path = hf_kit.ensure(tmp_path / "none", tmp_path / "site", sys.executable, ["no_such_module_here"])
    assert path is None and "no wheels" in note, note
    # A machine like the card's: its own torch, numpy and the other compiled packages, no transformers, peft,
    # accelerate or datasets. This Python without its site-packages (-S), given only those, stands in for it.
    from importlib import metadata
    machine = tmp_path / "machine-site"
    machine.mkdir()
    own = ["torch", "numpy", "PyYAML", "regex", "pyarrow", "pandas", "pydantic_core", "xxhash", "sympy", "mpmath",
           "networkx", "Jinja2", "MarkupSafe", "typing_extensions", "filelock", "fsspec", "python-dateutil", "tzdata",
           "tqdm", "packaging", "psutil", "huggingface_hub", "safetensors", "tokenizers", "hf-xet", "httpx2",
           "httpcore2", "h11", "anyio", "idna", "click", "typer", "rich", "shellingham", "Pygments", "markdown-it-py",
           "mdurl", "annotated-doc", "truststore", "six"]
    for name in own:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for top in {pathlib.PurePath(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            source = pathlib.Path(dist.locate_file(top))
            if source.exists() and not (machine / top).exists():
                (machine / top).symlink_to(source)
    bare = tmp_path / "machine-python"
    bare.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{machine}" exec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    modules = ["transformers", "peft", "accelerate", "datasets"]
    before = hf_kit.check(str(bare), modules)
    assert before["transformers"].startswith("MISSING") and before["datasets"].startswith("MISSING"), before
    note, path = hf_kit.ensure(kit, tmp_path / "site", str(bare), modules)
    assert path, note
    after = hf_kit.check(str(bare), modules, path)
    assert not any(v.startswith("MISSING") for v in after.values()), after
    installed = {p.name.split("-")[0].lower() for p in (tmp_path / "site").glob("*.dist-info")}
    assert {"transformers", "peft", "accelerate", "datasets"} <= installed, installed
