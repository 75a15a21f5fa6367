"""The layer order (docs/architecture.md#layers): scripts/check-layers passes on the repository, lists an upward
include planted in a small fabricated tree (and only that one), reports what it cannot place, and its order is the
one the documentation draws. No build needed.
"""

import importlib.machinery
import importlib.util
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check-layers"


def check_layers(root):
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60)


def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_no_include_in_the_repository_crosses_the_layer_order():
    result = check_layers(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no include crosses the layer order" in result.stdout


def test_a_planted_upward_include_is_listed_and_nothing_else(tmp_path):
    write(tmp_path, "src/util/strings.h", '#pragma once\n#include "util/other.h"\n')  # same layer: fine
    write(tmp_path, "src/util/other.h", "#pragma once\n")
    write(tmp_path, "src/util/rng.cpp", '// random bits\n#include "util/strings.h"\n  #  include "train/step.h"\n')
    write(tmp_path, "src/train/step.h", '#pragma once\n#include "models/model.h"\n#include "trainer/errors.h"\n')
    write(tmp_path, "src/train/step.cpp", '#include "step.h"\n')  # beside the file, as the compiler finds it
    write(tmp_path, "src/models/model.h", '#pragma once\n#include "trainer/config.h"\n')
    write(tmp_path, "include/trainer/errors.h", "#pragma once\n")
    write(tmp_path, "include/trainer/config.h", '#pragma once\n#include "trainer/errors.h"\n#include <string>\n')
    write(tmp_path, "src/main.cpp", '#include "train/step.h"\n#include "trainer/version.h"\n')
    result = check_layers(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "src/util/rng.cpp:3: includes train/step.h (layer util may not include layer train)"]

    # A public header is in the layer of what it declares: errors.h (util) may not include run.h (train).
    (tmp_path / "src/util/rng.cpp").write_text('#include "util/strings.h"\n')
    write(tmp_path, "include/trainer/run.h", '#pragma once\n#include "trainer/config.h"\n')
    write(tmp_path, "include/trainer/errors.h", '#pragma once\n#include "trainer/run.h"\n')
    result = check_layers(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "include/trainer/errors.h:2: includes trainer/run.h (layer util may not include layer train)"]

    (tmp_path / "include/trainer/errors.h").write_text("#pragma once\n")
    result = check_layers(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_what_the_check_cannot_place_is_reported(tmp_path):
    write(tmp_path, "src/widgets/widget.cpp", '#include "util/strings.h"\n')  # a folder in no layer
    write(tmp_path, "include/trainer/widget.h", "#pragma once\n")              # a public header in no layer
    write(tmp_path, "src/util/strings.h", '#pragma once\n#include "util/missing.h"\n')
    result = check_layers(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert "src/widgets/widget.cpp: in no layer" in out, out
    assert "include/trainer/widget.h: in no layer" in out, out
    assert "src/util/strings.h:2: includes util/missing.h, which is no file under src/ or include/" in out, out


def test_the_documented_diagram_is_the_checked_order():
    loader = importlib.machinery.SourceFileLoader("check_layers", str(SCRIPT))
    spec = importlib.util.spec_from_loader("check_layers", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    drawn = [m.group(1) for m in re.finditer(r"^    (\w+) +src/", section, re.MULTILINE)]
    assert list(reversed(drawn)) == module.LAYERS, drawn
    for folder in sorted(p.name for p in (ROOT / "src").iterdir() if p.is_dir()):
        assert folder in module.LAYERS, f"src/{folder} is in no layer"
    for header in sorted(p.name for p in (ROOT / "include" / "trainer").glob("*.h")):
        assert header in module.PUBLIC_HEADERS, f"include/trainer/{header} is in no layer"


def load_check_layers():
    loader = importlib.machinery.SourceFileLoader("check_layers", str(SCRIPT))
    spec = importlib.util.spec_from_loader("check_layers", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def archive(build, name, sources):
    """The static library `name` in `build`, of the C++ `sources` ({file name: text}) compiled by g++."""
    objects = []
    for file, text in sources.items():
        (build / file).write_text(text)
        obj = build / (file + ".o")
        subprocess.run(["g++", "-c", str(build / file), "-o", str(obj)], check=True, timeout=60)
        objects.append(str(obj))
    subprocess.run(["ar", "rcs", str(build / name), *objects], check=True, timeout=60)


def test_links_lists_a_call_up_the_layer_order_and_nothing_else(tmp_path):
    """--links reads the built archives: a train function called from util is listed (the linker alone accepts it
    when train's object is already pulled in); calls down the order, within a layer and to outside libraries pass."""
    module = load_check_layers()
    for names in module.LIBRARIES.values():
        for name in names:
            archive(tmp_path, name, {})
    archive(tmp_path, "libtrainer_util.a", {"strings.cpp": "int trim() { return 1; }\n"})
    archive(tmp_path, "libtrainer_train.a", {
        "engine.cpp": "int trim(); int puts(const char*);\nint run_engine() { puts(\"x\"); return trim(); }\n"})
    archive(tmp_path, "libtrainer_cli.a", {"cli.cpp": "int run_engine();\nint run_cli() { return run_engine(); }\n"})
    result = subprocess.run([sys.executable, str(SCRIPT), "--links", str(tmp_path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no library uses a layer above its own" in result.stdout

    archive(tmp_path, "libtrainer_util.a", {"counter_rng.cpp": "int run_engine();\nint mix() { return run_engine(); }\n"})
    result = subprocess.run([sys.executable, str(SCRIPT), "--links", str(tmp_path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "libtrainer_util.a(counter_rng.cpp.o): uses run_engine(), defined in libtrainer_train.a(engine.cpp.o) "
        "(layer util may not use layer train)"], result.stdout

    (tmp_path / "libtrainer_memory.a").unlink()
    result = subprocess.run([sys.executable, str(SCRIPT), "--links", str(tmp_path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert f"{tmp_path / 'libtrainer_memory.a'}: missing" in result.stdout


def test_every_layer_library_is_checked():
    """CMakeLists.txt's layer libraries are the ones --links reads: none left out, none it reads that is not built."""
    module = load_check_layers()
    text = (ROOT / "CMakeLists.txt").read_text()
    built = set(re.findall(r"^trainer_layer\((trainer_\w+)", text, re.MULTILINE))
    built |= set(re.findall(r"^add_library\((trainer_\w+) STATIC", text, re.MULTILINE))
    built -= {"trainer_fake_bitsandbytes", "trainer_cuda_kernels"}  # a test stand-in; CUDA builds' kernels
    read = {name[len("lib"):-len(".a")] for names in module.LIBRARIES.values() for name in names}
    assert read == built, (sorted(read - built), sorted(built - read))
    for name in re.findall(r"^trainer_layer\((trainer_\w+)", text, re.MULTILINE):
        assert name[len("trainer_"):] in module.LIBRARIES, name
