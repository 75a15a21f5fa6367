"""The docker files, checked without an engine (scripts/docker-check builds and runs them where one exists):
everything the Dockerfile copies or mounts from the build context exists and is not excluded by .dockerignore;
scripts/setup and the image install the one Debian package list; the compose services name configs that validate,
mount the paths those configs read and write, reserve a GPU (the training job) and take secrets from the
environment at run time; the image runs trainer as a non-root user with no secret baked in."""
import fnmatch
import os
import pathlib
import re
import shlex
import subprocess

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
COMPOSE = DOCKER / "docker-compose.training.yml"
TRAINER = os.environ.get("TRAINER_BINARY", str(ROOT / "build" / "trainer"))


def interpolate(value):
    """${VAR:-default} -> default, ${VAR} -> "" (what compose does with VAR unset)."""
    return re.sub(r"\$\{[A-Z_][A-Z0-9_]*(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


def mount_points(service):
    # "${MODELS_DIR:-./models}:/models:ro" -> "/models"
    return {re.sub(r"\$\{[^}]*\}", "HOST", v).split(":")[1] for v in service["volumes"]}


def services():
    return yaml.safe_load(COMPOSE.read_text())["services"]


def compose():
    return services()["trainer"]


def dockerfile_instructions():
    """(instruction, arguments) per instruction: comment lines dropped, continuation lines joined."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.strip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(line.strip().partition(" ")[0].upper(), line.strip().partition(" ")[2]) for line in text.splitlines() if line.strip()]


def dockerignored(path):
    """Whether .dockerignore excludes PATH (relative to the root): the last matching pattern wins, '!' re-includes,
    a pattern that matches a parent folder matches everything below it."""
    excluded = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        parts = pathlib.PurePosixPath(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatchcase(p, pattern) or fnmatch.fnmatchcase(p, pattern.replace("**/", "")) for p in prefixes):
            excluded = not negate
    return excluded


def test_dockerfile_copies_and_mounts_only_what_exists_and_is_in_the_build_context():
    sources = []
    for instruction, arguments in dockerfile_instructions():
        if instruction in ("COPY", "ADD"):
            words = [w for w in shlex.split(arguments) if not w.startswith("--")]
            if "--from=" in arguments:
                continue  # from another stage, not from the build context
            sources += words[:-1]
        if instruction == "RUN":
            sources += re.findall(r"--mount=type=bind,source=([^,\s]+)", arguments)
    assert "scripts/debian-packages.txt" in sources and "requirements.txt" in sources, sources
    for source in sources:
        assert (ROOT / source).exists(), f"docker/Dockerfile uses {source}, which does not exist"
        assert not dockerignored(source), f"docker/Dockerfile uses {source}, which .dockerignore excludes"
    # The image builds trainer alone: no tests in the build context's copies.
    assert not any(s == "tests" or s.startswith("tests/") for s in sources), sources
    assert "-DTRAINER_BUILD_TESTS=OFF" in (DOCKER / "build-trainer.sh").read_text()


def test_setup_and_the_image_install_the_one_debian_package_list():
    packages = [line.split("#")[0].strip() for line in (ROOT / "scripts" / "debian-packages.txt").read_text().splitlines()]
    packages = [p for p in packages if p]
    assert {"g++", "cmake", "ninja-build", "libsentencepiece-dev", "libcurl4-openssl-dev"} <= set(packages), packages
    setup = (ROOT / "scripts" / "setup").read_text()
    assert re.search(r"mapfile -t APT_PACKAGES < <\(sed .* scripts/debian-packages\.txt\)", setup), \
        "scripts/setup must read its packages from scripts/debian-packages.txt"
    assert not re.search(r"APT_PACKAGES=\(", setup), "scripts/setup must not list packages of its own"
    build_stage = DOCKERFILE.read_text().split("\nFROM ")[1]
    assert "COPY scripts/debian-packages.txt /tmp/debian-packages.txt" in build_stage
    assert re.search(r"/tmp/debian-packages\.txt\s*\\?\s*\|\s*xargs apt-get install", build_stage), \
        "the build stage must install the list it copies"
    # Both strip comments the same way: what setup reads is what the image installs.
    sed = "sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d'"
    assert sed in setup and sed in build_stage
    read = subprocess.run(["bash", "-c", f"{sed} scripts/debian-packages.txt"], cwd=ROOT, capture_output=True, text=True)
    assert read.stdout.split() == packages


def test_compose_file_has_no_empty_defaults():
    # podman-compose 1.0.3 substitutes ${VAR:-default} only for a non-empty default: ${VAR:-} reaches the container
    # as the literal text "${VAR:-}" (trainer then refused TRAINER_WEBHOOK_URL). ${VAR} is "" when unset in both.
    assert not re.search(r"\$\{\w+:?-\}", COMPOSE.read_text())


def test_compose_paths_exist():
    for name, service in services().items():
        build = service["build"]
        context = (DOCKER / build["context"]).resolve()
        assert (context / build["dockerfile"]).is_file(), (name, build)
        for volume in service["volumes"]:
            source = interpolate(volume).split(":")[0]
            if source.startswith("../"):  # a path in the repository (the others are the user's, or named volumes)
                assert (DOCKER / source).exists(), f"{name} mounts {source}, which does not exist"
            elif not source.startswith(("/", "./")):
                assert source in yaml.safe_load(COMPOSE.read_text())["volumes"], f"{name}: volume {source} is not declared"


def test_compose_commands_name_configs_that_validate():
    for name, service in services().items():
        command = [interpolate(word) for word in service["command"]]
        config = command[command.index("--config") + 1]
        assert config.startswith("/app/configs/"), "the image copies configs/ to /app/configs"
        local = ROOT / "configs" / pathlib.Path(config).name
        assert local.is_file(), f"{config} is not in configs/"
        sets = [arg for i, arg in enumerate(command) if i > 0 and command[i - 1] == "--set"]
        # --print-config parses and validates the whole config (types, ranges, unknown keys) without touching paths.
        arguments = [TRAINER, "--config", str(local), "--print-config"] + [a for s in sets for a in ("--set", s)]
        result = subprocess.run(arguments, capture_output=True, text=True, cwd=ROOT)
        assert result.returncode == 0, (name, result.stderr)
        resolved = yaml.safe_load(result.stdout)
        mounts = mount_points(service)
        assert any(resolved["checkpoint"]["output_dir"].startswith(m + "/") for m in mounts), (name, resolved["checkpoint"])
        assert "--resume-if-present" in command, f"{name}: an up after a stop or a crash must resume"
        if name == "trainer":
            # The model is under a mount point, or a Hub id read through the Hugging Face cache volume.
            path = resolved["model"]["path"]
            assert any(path.startswith(m + "/") for m in mounts) or (not path.startswith("/") and "/hf-cache" in mounts), path
            assert all(any(f.startswith(m + "/") for m in mounts) for f in resolved["data"]["train_files"])


def test_smoke_service_runs_the_tiny_job_on_the_cpu_image():
    smoke = services()["smoke"]
    assert smoke["profiles"] == ["smoke"], "docker compose up alone must not start the smoke job"
    assert smoke["build"]["args"]["TORCH_VARIANT"] == "cpu"
    assert "/app/configs/tiny-t5.json" in smoke["command"]
    assert "/app/data/demo" in mount_points(smoke) and "/output" in mount_points(smoke)
    assert "deploy" not in smoke


def test_compose_reserves_a_gpu_and_sets_memory_and_environment():
    service = compose()
    assert service["build"]["args"]["TORCH_VARIANT"] == "cuda"
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    # One data-parallel rank per reserved GPU, both from GPUS (docker/.env), through trainer launch.
    command = service["command"]
    assert command[:2] == ["launch", "--nproc-per-node"] and command[3] == "--", command
    assert command[2] == devices[0]["count"] == "${GPUS:-1}", (command, devices)
    assert re.search(r"^GPUS=\d+$", (DOCKER / ".env.example").read_text(), re.MULTILINE)
    assert service["shm_size"] and service["mem_limit"]
    assert "PYTORCH_ALLOC_CONF" in service["environment"]
    # Secrets come from the environment (or docker/.env, read by compose for interpolation) at run time.
    for variable in ("HF_TOKEN", "TRAINER_WEBHOOK_URL"):
        assert service["environment"][variable] == "${" + variable + "}", service["environment"]
    assert "env_file" not in service, "podman-compose 1.0.3 cannot read env_file's long form; use environment"
    assert service["stop_signal"] == "SIGTERM", "trainer checkpoints and exits 0 on SIGTERM"
    assert service["restart"].startswith("on-failure")
    assert mount_points(service) == {"/models", "/data", "/output", "/hf-cache"}


def test_env_file_is_not_committed_and_the_example_holds_no_secret():
    ignored = subprocess.run(["git", "check-ignore", "-q", "docker/.env"], cwd=ROOT)
    assert ignored.returncode == 0, "docker/.env must be ignored by git"
    example = (DOCKER / ".env.example").read_text()
    for line in example.splitlines():
        if re.match(r"\s*[A-Z_]*(URL|KEY|TOKEN|SECRET)[A-Z_]*\s*=\s*\S", line):
            raise AssertionError(f"a secret is set in .env.example: {line}")
    assert ".env" in (ROOT / ".dockerignore").read_text()


def test_dockerfile_is_multi_stage_non_root_with_trainer_as_entrypoint():
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\w+)", text, re.MULTILINE)
    assert stages == ["build", "runtime"], stages
    assert re.search(r"^ARG BASE_IMAGE=debian:bookworm-slim$", text, re.MULTILINE)
    last_stage = text[text.rindex("\nFROM "):]
    assert re.search(r"^USER\s+(?!root)\w+", last_stage, re.MULTILINE), "the runtime stage must not run as root"
    assert re.search(r'^ENTRYPOINT\s+\["/usr/bin/tini", "--", "/opt/trainer/bin/trainer"\]', last_stage, re.MULTILINE)
    assert re.search(r'^VOLUME\s+\["/output", "/hf-cache"\]', last_stage, re.MULTILINE)
    assert re.search(r"^ENV HF_HOME=/hf-cache$", last_stage, re.MULTILINE)
    for line in text.splitlines():
        assert not re.match(r"\s*(ENV|ARG)\s+\S*(URL|KEY|TOKEN|SECRET|PASSWORD)", line), f"secret baked in: {line}"
    # The build installs the torch pinned in requirements.txt, before the sources: a source change keeps that layer.
    assert text.index("COPY requirements.txt") < text.index("install-torch.sh \"${TORCH_VARIANT}\"") < text.index("COPY src ")
    assert "grep '^torch==' /src/requirements.txt" in (DOCKER / "install-torch.sh").read_text()
    # pip's settings reach the build as secrets, never as a layer.
    assert "--mount=type=secret,id=pip.conf" in text and "--mount=type=secret,id=ca-bundle" in text
    assert "--mount=type=cache,target=/root/.cache/ccache" in text
