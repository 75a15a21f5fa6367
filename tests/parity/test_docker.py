"""The docker files: the compose job names a config that validates, reserves a GPU, mounts models/data/output and
takes its environment from an uncommitted .env; the image runs trainer as a non-root user with no secrets baked in.
(Images are not built by the test suite: the CI machine has no docker daemon.)"""
import os
import pathlib
import re
import subprocess

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
TRAINER = os.environ.get("TRAINER_BINARY", str(ROOT / "build" / "trainer"))


def mount_points(service):
    # "${MODELS_DIR:-./models}:/models:ro" -> "/models"
    return {re.sub(r"\$\{[^}]*\}", "HOST", v).split(":")[1] for v in service["volumes"]}


def compose():
    return yaml.safe_load((DOCKER / "docker-compose.training.yml").read_text())["services"]["trainer"]


def test_compose_command_names_a_config_that_validates():
    service = compose()
    command = service["command"]
    config = command[command.index("--config") + 1]
    assert config.startswith("/app/configs/"), "the image copies configs/ to /app/configs"
    local = ROOT / "configs" / pathlib.Path(config).name
    assert local.is_file(), f"{config} is not in configs/"
    # --print-config parses and validates the whole config (types, ranges, unknown keys) without touching paths.
    result = subprocess.run([TRAINER, "--config", str(local), "--print-config"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    # The paths the config reads and writes are the compose file's mount points.
    mounts = mount_points(service)
    resolved = yaml.safe_load(result.stdout)
    model = resolved["model"]["path"]
    hub_id = not model.startswith(("/", ".", "~")) and model.split("@")[0].count("/") <= 1  # from the HF cache
    assert hub_id or any(model.startswith(m + "/") for m in mounts), model
    assert all(any(f.startswith(m + "/") for m in mounts) for f in resolved["data"]["train_files"])
    assert any(resolved["checkpoint"]["output_dir"].startswith(m + "/") for m in mounts)


def test_compose_reserves_a_gpu_and_sets_memory_and_environment():
    service = compose()
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    # One data-parallel rank per reserved GPU, both from GPUS (docker/.env), through trainer launch.
    command = service["command"]
    assert command[:2] == ["launch", "--nproc-per-node"] and command[3] == "--", command
    assert command[2] == devices[0]["count"] == "${GPUS:-1}", (command, devices)
    assert re.search(r"^GPUS=\d+$", (DOCKER / ".env.example").read_text(), re.MULTILINE)
    assert service["shm_size"] and service["mem_limit"]
    assert "PYTORCH_ALLOC_CONF" in service["environment"]
    assert service["env_file"][0]["path"] == ".env"
    assert service["stop_signal"] == "SIGTERM", "trainer checkpoints and exits 0 on SIGTERM"
    assert mount_points(service) == {"/models", "/data", "/output"}


def test_env_file_is_not_committed_and_the_example_holds_no_secret():
    ignored = subprocess.run(["git", "check-ignore", "-q", "docker/.env"], cwd=ROOT)
    assert ignored.returncode == 0, "docker/.env must be ignored by git"
    example = (DOCKER / ".env.example").read_text()
    for line in example.splitlines():
        if re.match(r"\s*[A-Z_]*(URL|KEY|TOKEN|SECRET)[A-Z_]*\s*=", line):
            raise AssertionError(f"a secret is set in .env.example: {line}")
    assert ".env" in (ROOT / ".dockerignore").read_text()


def test_dockerfile_is_multi_stage_non_root_with_trainer_as_entrypoint():
    text = (DOCKER / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\w+)", text, re.MULTILINE)
    assert len(stages) >= 2, stages
    last_stage = text[text.rindex("\nFROM "):]
    assert re.search(r"^USER\s+(?!root)\w+", last_stage, re.MULTILINE), "the runtime stage must not run as root"
    assert re.search(r'^ENTRYPOINT\s+\[.*"/opt/trainer/bin/trainer"\]', last_stage, re.MULTILINE)
    for line in text.splitlines():
        assert not re.match(r"\s*(ENV|ARG)\s+\S*(URL|KEY|TOKEN|SECRET|PASSWORD)", line), f"secret baked in: {line}"
    # The build installs the torch pinned in requirements.txt (the CUDA build on PyPI).
    assert "requirements.txt" in text and "torch==" in text
