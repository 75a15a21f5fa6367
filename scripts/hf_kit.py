#!/usr/bin/env python3
"""The Python packages that `scripts/gpu-check --full` part 4 runs transformers' Trainer with, carried to a card
machine that has no network (issue 36). The machine's own torch is always used; nothing is downloaded there.

    .venv/bin/python scripts/hf_kit.py build DIR     # here: wheels of transformers, peft, accelerate, datasets,
                                                     # safetensors, tokenizers and their dependencies, made from the
                                                     # packages installed in this Python (pip download is not needed)
    python3 scripts/hf_kit.py check                  # which of them a Python has (and their versions)

`build` also copies bitsandbytes' CUDA 13 libraries into DIR/bitsandbytes (part 2's QLoRA on a card without
bitsandbytes: scripts/gpu_full.py points TRAINER_BITSANDBYTES there).

`build` packs each installed distribution of the dependency closure (torch and the NVIDIA libraries left out) into a
wheel: its files as RECORD lists them, without byte code, named with the tag its WHEEL file gives. Only wheels that
any CPython 3 can load travel: pure Python (py3-none-any, and pyXY-none-any, noted) and the stable ABI (abi3: tokenizers,
safetensors). Compiled packages of one Python version (numpy, pyarrow, pandas, regex, PyYAML, psutil, xxhash) cannot
travel from this Python 3.11 to another version: DIR/MACHINE.txt lists them, and the card's image has them
(docs/building.md). `ensure` (called by scripts/gpu_full.py on the card) installs from DIR only the distributions the
machine lacks, by unzipping them into a folder put first on PYTHONPATH, and checks that the imports then work; if
they do not, it installs the whole kit there and checks again.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

# What part 4 imports, and what the issue asks to carry; their dependencies follow from the installed metadata.
TOP = ["transformers", "peft", "accelerate", "datasets", "safetensors", "tokenizers"]
NEVER = re.compile(r"^(torch|triton|nvidia-.*|setuptools|pip|wheel)$")
BUDGET_BYTES = 64 * 2**20  # what travels to the card in all (the working tree included)


def normalize(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(names):
    from importlib import metadata  # noqa: PLC0415

    from packaging.requirements import Requirement  # noqa: PLC0415
    seen, todo = {}, [normalize(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen or NEVER.match(name):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            seen[name] = None
            continue
        seen[name] = dist
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
                continue
            todo.append(normalize(requirement.name))
    return seen


def wheel_tag(dist):
    tags = [line.split(":", 1)[1].strip() for line in (dist.read_text("WHEEL") or "").splitlines()
            if line.startswith("Tag:")]
    return tags[0] if tags else "unknown"


def portable(tag):
    """Loads on any CPython 3 of the same platform: pure Python or the stable ABI."""
    python, abi, _ = (tag.split("-") + ["", ""])[:3]
    return abi == "abi3" or (abi == "none" and python.startswith("py"))


# bitsandbytes' CUDA libraries for the card's QLoRA (part 2): trainer loads them itself (TRAINER_BITSANDBYTES, a folder:
# it picks libbitsandbytes_cudaXY.so by the CUDA runtime torch was built with). Only the runtimes cards' images carry
# (CUDA 13: the cu12 builds are 21-26 MiB each, too large to travel); each is about 4 MiB.
BITSANDBYTES_CUDA = ["libbitsandbytes_cuda130.so", "libbitsandbytes_cuda132.so"]


def carry_bitsandbytes(out):
    """Copies the installed bitsandbytes' CUDA libraries into out/bitsandbytes; returns their bytes (0 without it)."""
    import importlib.util  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    spec = importlib.util.find_spec("bitsandbytes")
    if spec is None or not spec.origin:
        print("bitsandbytes is not installed here: no CUDA library for QLoRA on the card")
        return 0
    source, target = Path(spec.origin).parent, out / "bitsandbytes"
    target.mkdir(exist_ok=True)
    total = 0
    for name in BITSANDBYTES_CUDA:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
            total += (target / name).stat().st_size
            print(f"{(target / name).stat().st_size / 2**20:7.2f} MiB  bitsandbytes/{name}")
    return total


def build(directory):
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    packed, machine, absent = [], [], []
    for name, dist in sorted(closure(TOP).items()):
        if dist is None:
            absent.append(name)
            continue
        tag = wheel_tag(dist)
        version = dist.version
        if not portable(tag):
            machine.append(f"{dist.metadata['Name']}=={version} ({tag})")
            continue
        wheel = out / f"{dist.metadata['Name'].replace('-', '_')}-{version}-{tag}.whl"
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as archive:
            for file in dist.files or []:
                path = Path(str(file))
                if path.parts[0] == ".." or "__pycache__" in path.parts or path.suffix == ".pyc":
                    continue  # console scripts outside site-packages, byte code
                source = Path(dist.locate_file(file))
                if source.is_file():
                    archive.write(source, str(path))
        packed.append((wheel.name, wheel.stat().st_size, tag))
    total = sum(size for _, size, _ in packed) + carry_bitsandbytes(out)
    (out / "MACHINE.txt").write_text(
        "Compiled for one Python version, so not carried: the card's Python must have these (its image does)\n"
        + "".join(f"  {line}\n" for line in machine)
        + ("Not installed here (left out): " + ", ".join(absent) + "\n" if absent else ""))
    for name, size, tag in packed:
        note = "  (pure Python for one version: " + tag.split("-")[0] + ")" if re.match(r"py\d\d+-", tag) else ""
        print(f"{size / 2**20:7.2f} MiB  {name}{note}")
    print(f"{len(packed)} wheels, {total / 2**20:.1f} MiB in {out} (budget for all that travels: "
          f"{BUDGET_BYTES / 2**20:.0f} MiB); not carried (the machine's own): {', '.join(machine) or 'none'}")
    if total > BUDGET_BYTES:
        print(f"hf_kit: {total / 2**20:.1f} MiB is over the {BUDGET_BYTES / 2**20:.0f} MiB that can travel",
              file=sys.stderr)
        return 1
    return 0


CHECK = r"""
import importlib, importlib.util, json, os, sys
from importlib import metadata
out = {}
found_only = os.environ.get("HF_KIT_FIND_ONLY") == "1"  # where the package is, without importing it (seconds faster)
for module in sys.argv[1:]:
    try:
        if found_only:
            if importlib.util.find_spec(module) is None:
                raise ImportError("not found")
        else:
            importlib.import_module(module)
        try:
            out[module] = metadata.version(module)
        except Exception:
            out[module] = "?"
    except Exception as e:
        out[module] = "MISSING: " + type(e).__name__ + ": " + str(e)[:160]
print(json.dumps(out))
"""


def check(python, modules, pythonpath=None, find_only=False):
    """{module: version, or "MISSING: why"} in a fresh process of `python` (find_only: found, not imported)."""
    import os  # noqa: PLC0415
    env = dict(os.environ, HF_KIT_FIND_ONLY="1" if find_only else "0")
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    run = subprocess.run([python, "-c", CHECK, *modules], capture_output=True, text=True, env=env, check=False)
    try:
        return json.loads(run.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {m: "MISSING: the check failed: " + run.stderr.strip()[-200:] for m in modules}


def installed_distributions(python, names, pythonpath=None):
    import os  # noqa: PLC0415
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    code = ("import json, sys\nfrom importlib import metadata\nout = {}\nfor n in sys.argv[1:]:\n"
            "    try: out[n] = metadata.version(n)\n    except Exception: out[n] = None\nprint(json.dumps(out))")
    run = subprocess.run([python, "-c", code, *names], capture_output=True, text=True, env=env, check=False)
    return json.loads(run.stdout) if run.returncode == 0 else {n: None for n in names}


def install(wheels, site):
    site.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)


def ensure(kit, site, python, modules):
    """(note, PYTHONPATH to add: "" when the machine has everything, None when the imports cannot be made to work)."""
    import shutil  # noqa: PLC0415
    have = check(python, modules, find_only=True)  # the HF runs themselves import them: a broken one fails there
    missing = [m for m, v in have.items() if v.startswith("MISSING")]
    versions = ", ".join(f"{m} {v}" for m, v in have.items() if not v.startswith("MISSING"))
    if not missing:
        return f"the machine's Python has {versions}", ""
    wheels = sorted(Path(kit).glob("*.whl")) if Path(kit).is_dir() else []
    if not wheels:
        return (f"missing {', '.join(missing)} ({'; '.join(have[m] for m in missing)[:200]}) and no wheels in "
                f"{kit}: make them with `scripts/gpu-check --hf-kit {kit}` and carry that folder"), None
    names = {w.name.split("-")[0]: w for w in wheels}
    present = installed_distributions(python, list(names))
    lacking = [w for n, w in names.items() if present.get(n) is None]
    shutil.rmtree(site, ignore_errors=True)
    install(lacking, site)
    after = check(python, modules, str(site))
    how = f"from {kit}: {', '.join(w.name.split('-')[0] for w in lacking) or 'nothing'} (what the machine lacks)"
    if any(v.startswith("MISSING") for v in after.values()):
        shutil.rmtree(site, ignore_errors=True)
        install(wheels, site)
        after = check(python, modules, str(site))
        how = f"from {kit}: all {len(wheels)} wheels (the machine's own versions did not import together)"
    still = [f"{m}: {v}" for m, v in after.items() if v.startswith("MISSING")]
    if still:
        return f"the kit did not make them importable: {'; '.join(still)[:300]}", None
    return (f"the machine's Python had {versions or 'none of them'}; missing {', '.join(missing)}; installed " + how
            + "; now " + ", ".join(f"{m} {v}" for m, v in after.items())), str(site)


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "build":
        return build(sys.argv[2])
    if len(sys.argv) >= 2 and sys.argv[1] == "check":
        print(json.dumps(check(sys.executable, ["transformers", "peft", "accelerate", "datasets", "safetensors",
                                                "tokenizers"]), indent=1))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
