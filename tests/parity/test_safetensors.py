"""trainer's safetensors reader and writer against the Python safetensors package and transformers: files that
Python writes (every dtype, scalars, empty tensors, metadata) are read by trainer and written back; Python reads
trainer's files exactly (dtype, shape, bytes, metadata with "format": "pt"); and a sharded transformers
checkpoint re-saved by trainer loads in transformers with from_pretrained, unchanged.

The C++ side is the SafetensorsExternal suite of build/trainer_tests, driven by environment variables."""
import json
import os
import re
import shutil
import subprocess

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
          torch.float8_e5m2fnuz, torch.uint16, torch.uint32, torch.uint64, torch.complex64]


@pytest.fixture(scope="session")
def trainer_tests(trainer_binary):
    path = trainer_binary.parent / "trainer_tests"
    if not path.exists():
        pytest.fail(f"{path} does not exist: build first (cmake --build build)")
    return path


def run_external(trainer_tests, test, **env):
    result = subprocess.run([str(trainer_tests), f"--gtest_filter=SafetensorsExternal.{test}"],
                            env={**os.environ, **{k: str(v) for k, v in env.items()}}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[  PASSED  ] 1 test" in result.stdout and "SKIPPED" not in result.stdout, result.stdout


def random_tensor(dtype, shape, generator):
    """Random bytes reinterpreted as `dtype` (all bit patterns, NaNs included), so only an exact copy compares
    equal."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    size = torch.empty((), dtype=dtype).element_size()
    numel = int(torch.tensor(shape).prod()) if shape else 1
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def same(a, b):
    """Exact equality of dtype, shape and bytes (NaN-safe, and defined for every dtype)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def test_python_files_round_trip_through_trainer(trainer_tests, tmp_path):
    generator = torch.Generator().manual_seed(0)
    originals = {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        originals[name] = ({"weight": random_tensor(dtype, [3, 5], generator),
                            "bias": random_tensor(dtype, [7], generator)}, None)
    originals["mixed"] = ({"model.layers.0.self_attn.q_proj.weight": random_tensor(torch.bfloat16, [4, 6], generator),
                           "scalar": torch.tensor(1.5),
                           "empty": torch.empty(0, 3, dtype=torch.float16),
                           "ids": torch.arange(5),
                           "flag": torch.tensor([True, False])},
                          {"format": "pt", "step": "12", "note": "ünïcode"})
    for name, (tensors, metadata) in originals.items():
        save_file(tensors, tmp_path / f"{name}.safetensors", metadata=metadata)

    run_external(trainer_tests, "RewritesEveryFileOfTheDirectory", TRAINER_SAFETENSORS_DIR=tmp_path)

    for name, (tensors, metadata) in originals.items():
        ours = tmp_path / f"{name}.ours.safetensors"
        loaded = load_file(ours)
        assert sorted(loaded) == sorted(tensors), name
        for key, tensor in tensors.items():
            assert same(loaded[key], tensor), f"{name}: {key}"
        with safe_open(ours, framework="pt") as f:
            assert f.metadata() == {**(metadata or {}), "format": "pt"}, name
        header_size = int.from_bytes(ours.read_bytes()[:8], "little")
        assert header_size % 8 == 0


def test_transformers_loads_a_checkpoint_trainer_resaved(root, trainer_tests, tmp_path):
    config = transformers.AutoConfig.from_pretrained(root / "configs" / "models" / "tiny-t5")
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config)
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded by transformers
    assert (tmp_path / "model.safetensors.index.json").exists()

    run_external(trainer_tests, "ResavesATransformersModelDirectory", TRAINER_HF_MODEL_DIR=tmp_path,
                 TRAINER_HF_MAX_SHARD_BYTES=150_000)

    ours = tmp_path / "ours"
    index = json.loads((ours / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert shards == sorted(p.name for p in ours.glob("*.safetensors"))
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    assert index["metadata"]["total_size"] == sum(load_file(ours / s)[k].nbytes for k, s in
                                                  index["weight_map"].items())
    shutil.copy(tmp_path / "config.json", ours / "config.json")
    reloaded, info = transformers.AutoModelForSeq2SeqLM.from_pretrained(ours, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    expected = model.state_dict()
    for key, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, expected[key]), key
