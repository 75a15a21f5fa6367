"""The resolved configuration trainer prints (and stores with checkpoints) is plain JSON that Python reads, and
feeding it back to trainer reproduces it exactly."""
import json


def test_print_config_is_json_with_every_section(run_trainer):
    printed = run_trainer("--config", "configs/t5xl.json", "--print-config").stdout
    config = json.loads(printed)
    assert list(config) == ["model", "tokenizer", "data", "training", "evaluation", "optimizer", "scheduler",
                            "precision", "lora", "memory", "device", "checkpoint", "logging", "distributed",
                            "contrastive", "dpo"]
    assert config["training"]["batch_size"] == 128
    assert config["training"]["micro_batch_size"] == "auto"
    assert config["precision"]["mode"] == "bf16"
    assert config["data"]["max_target_length"] == 512


def test_printed_config_round_trips_through_trainer(run_trainer, tmp_path):
    first = run_trainer("--config", "configs/qwen2.5-7b-lora.json", "--set", "training.batch_size=32",
                        "--set", "memory.limit=20GiB", "--print-config").stdout
    saved = tmp_path / "resolved.json"
    saved.write_text(first)
    second = run_trainer("--config", saved, "--print-config").stdout
    assert first == second
    resolved = json.loads(first)
    assert resolved["training"]["batch_size"] == 32
    assert resolved["memory"]["limit"] == "20GiB"
    assert resolved["lora"]["r"] == 128


def test_overrides_are_type_checked(run_trainer):
    result = run_trainer("--config", "configs/tiny-t5.json", "--set", "training.batch_size=big", "--print-config",
                         check=False)
    assert result.returncode == 2
    assert "--set training.batch_size=big (training.batch_size): expected an integer" in result.stderr
