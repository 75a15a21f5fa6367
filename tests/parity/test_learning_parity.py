"""Learning parity: the precision and optimizer settings of the shipped configs learn like fp32 on the tiny T5.

configs/tiny-t5.json at configs/t5xl.json's learning rate (1e-4), constant schedule: after the same steps on the
same data, each setting's validation loss must be within a few percent of the fp32 run's. Rounding fp32 updates to
nearest into bf16 weights (optimizer.bf16_update=nearest, the old behaviour) loses most of them at this learning
rate; the test checks that it fails the same bound, so the bound can tell a setting that learns from one that
does not. scripts/bench/learning_parity.py prints the longer table in docs/benchmarks.md (Kahan with AdamW, bf16 moments,
LoRA); six runs of 80 steps here, about a minute on an idle 2-core machine.
"""
import json

import pytest

STEPS = 80
TOLERANCE = 0.03  # relative validation-loss difference to fp32

COMMON = ["--config", "configs/tiny-t5.json", "--set", "optimizer.lr=1e-4", "--set", "scheduler.name=constant",
          "--set", "scheduler.warmup_steps=0", "--set", f"training.max_steps={STEPS}", "--set",
          "evaluation.every_steps=0", "--set", "evaluation.sample_prompts=[]", "--set", "checkpoint.every_steps=0",
          "--set", "checkpoint.save_final=false", "--set", "logging.progress=off"]

# setting -> (its --set overrides, the fp32 run it is compared with: the same optimizer in fp32)
SETTINGS = {
    "bf16 (default: stochastic rounding)": ["precision.mode=bf16"],
    "bf16, adafactor, kahan (configs/t5xl.json)": ["precision.mode=bf16", "optimizer.name=adafactor",
                                                   "optimizer.bf16_update=kahan"],
    "bf16-mixed (configs/qwen2.5-7b-lora.json)": ["precision.mode=bf16-mixed"],
}
FP32_KEYS = ("optimizer.name=",)


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
    """The fp32 run of a setting's optimizer, run once per optimizer."""
    cache = {}

    def loss(settings):
        key = tuple(s for s in settings if s.startswith(FP32_KEYS))
        if key not in cache:
            cache[key] = validation_loss(run_trainer, tmp_path_factory.mktemp("fp32"), list(key))
        return cache[key]
    return loss


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_setting_learns_like_fp32(name, fp32_loss, run_trainer, tmp_path):
    loss, reference = validation_loss(run_trainer, tmp_path, SETTINGS[name]), fp32_loss(SETTINGS[name])
    assert abs(loss - reference) <= TOLERANCE * reference, f"{name}: validation loss {loss:.4f}, fp32 {reference:.4f}"


def test_round_to_nearest_fails_the_same_bound(fp32_loss, run_trainer, tmp_path):
    loss = validation_loss(run_trainer, tmp_path, ["precision.mode=bf16", "optimizer.bf16_update=nearest"])
    reference = fp32_loss([])
    assert loss > (1 + TOLERANCE) * reference, f"nearest: {loss:.4f} vs fp32 {reference:.4f}: the bound is too loose"
