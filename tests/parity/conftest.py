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
def run_trainer(trainer_binary):
    def run(*args, check=True):
        result = subprocess.run([str(trainer_binary), *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                                timeout=300)
        if check and result.returncode != 0:
            raise AssertionError(f"trainer {' '.join(map(str, args))} exited {result.returncode}:\n{result.stderr}")
        return result
    return run
