"""Shared fixtures: where the repository and the built trainer binary are."""
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def root():
    return ROOT


@pytest.fixture(scope="session")
def trainer_binary():
    path = pathlib.Path(os.environ.get("TRAINER_BINARY", ROOT / "build" / "trainer"))
    if not path.exists():
        pytest.fail(f"{path} does not exist: build first (scripts/setup) or set TRAINER_BINARY")
    return path


@pytest.fixture(scope="session")
def built_tool():
    """A helper binary the build puts beside trainer (trainer_chat_tool, ...), or the path in `variable`."""
    def find(name, variable):
        binary = os.environ.get("TRAINER_BINARY", str(ROOT / "build" / "trainer"))
        path = pathlib.Path(os.environ.get(variable, pathlib.Path(binary).parent / name))
        if not path.exists():
            pytest.fail(f"{path} does not exist: build first (cmake --build build --target {name})")
        return path
    return find


@pytest.fixture(scope="session")
def run_trainer(trainer_binary):
    def run(*args, check=True):
        result = subprocess.run([str(trainer_binary), *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                                timeout=300)
        if check and result.returncode != 0:
            raise AssertionError(f"trainer {' '.join(map(str, args))} exited {result.returncode}:\n{result.stderr}")
        return result
    return run
