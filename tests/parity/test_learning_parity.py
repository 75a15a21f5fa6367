"""Learning parity: the precision and optimizer settings of the shipped configs learn like fp32 on the tiny T5.

configs/tiny-t5.json at configs/t5xl.json's learning rate (1e-4), constant schedule: after the same steps on the
same data, each setting's validation loss must be within a few percent of the fp32 run's. Rounding fp32 updates to
nearest into bf16 weights (optimizer.bf16_update=nearest, the old behaviour) loses most of them at this learning
rate; the test checks that it fails the same bound, so the bound can tell a setting that learns from one that
does not. scripts/bench/learning_parity.py prints the longer table in the README.
"""
import json

import pytest

STEPS = 80
TOLERANCE = 0.03  # relative validation-loss difference to fp32

COMMON = ["--config", "configs/tiny-t5.json", "--set", "optimizer.lr=1e-4", "--set", "scheduler.name=constant",
          "--set", "scheduler.warmup_steps=0", "--set", f"training.max_steps={STEPS}", "--set",
          "evaluation.every_steps=0", "--set", "evaluation.sample_prompts=[]", "--set", "checkpoint.every_steps=0",
          "--set", "checkpoint.save_final=false", "--set", "logging.progress=off"]

SETTINGS = {
    "bf16 (default: stochastic rounding)": ["precision.mode=bf16"],
    "bf16, kahan": ["precision.mode=bf16", "optimizer.bf16_update=kahan"],
    "bf16, bf16 moments": ["precision.mode=bf16", "optimizer.state_dtype=bf16"],
    "bf16-mixed": ["precision.mode=bf16-mixed"],
}


def validation_loss(run_trainer, out_dir, settings):
    args = list(COMMON) + ["--set", f"checkpoint.output_dir={out_dir}"]
    for s in settings:
        args += ["--set", s]
    run_trainer(*args)
    losses = [json.loads(line)["eval_loss"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()
              if "eval_loss" in line]
    assert losses, "no validation loss was logged"
    return losses[-1]


@pytest.fixture(scope="module")
def fp32_loss(run_trainer, tmp_path_factory):
    return validation_loss(run_trainer, tmp_path_factory.mktemp("fp32"), [])


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_setting_learns_like_fp32(name, fp32_loss, run_trainer, tmp_path):
    loss = validation_loss(run_trainer, tmp_path, SETTINGS[name])
    assert abs(loss - fp32_loss) <= TOLERANCE * fp32_loss, f"{name}: validation loss {loss:.4f}, fp32 {fp32_loss:.4f}"


def test_round_to_nearest_fails_the_same_bound(fp32_loss, run_trainer, tmp_path):
    loss = validation_loss(run_trainer, tmp_path, ["precision.mode=bf16", "optimizer.bf16_update=nearest"])
    assert loss > (1 + TOLERANCE) * fp32_loss, f"nearest: {loss:.4f} vs fp32 {fp32_loss:.4f}: the bound is too loose"
